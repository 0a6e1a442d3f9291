"""Every rejection of the KV insert, one test each, on meta and CPU tensors: raised before any
compile or launch, as LayoutError naming the argument, the expectation and the actual value."""

from __future__ import annotations

from unittest import mock

import pytest
import torch

import cute_kernels
from cute_kernels import LayoutError, check_kv_rope_insert
from cute_kernels.kv_rope_insert import KERNELS
from cute_kernels.layouts import CacheFormat
from cute_kernels.testing import cpu_launches
from cute_kernels.testing import kv_rope_insert_case as make_case

DEVICES = ["meta", "cpu"]


def _args(device, fmt="v4_packed", **overrides):
    case = make_case(fmt, 8, 16, "cpu")
    args = dict(
        kv=case.kv, k_cache=case.k_cache, slot_mapping=case.slot_mapping,
        positions=case.positions, cos_sin_cache=case.cos_sin_cache, block_size=16,
        fp8_scale=case.fp8_scale, kv_mxfp8=case.kv_mxfp8,
    )
    if device == "meta":
        args = {k: (v.to("meta") if isinstance(v, torch.Tensor) else v) for k, v in args.items()}
        cache = args["k_cache"]  # .to("meta") keeps strides only for dense tensors
        args["k_cache"] = torch.empty_strided(
            cache.shape, case.k_cache.stride(), dtype=cache.dtype, device="meta"
        )
    for key, value in overrides.items():
        args[key] = value(args) if callable(value) else value
    return args


def _rejects(args, *fragments):
    """The LayoutError blames the argument ``fragments[0]`` and holds the other fragments."""
    with pytest.raises(LayoutError) as err:
        check_kv_rope_insert(**args)
    msg = str(err.value)
    assert msg.startswith(f"{fragments[0]}: expected"), msg
    for fragment in fragments[1:]:
        assert fragment in msg, msg
    assert "got" in msg, msg


@pytest.mark.parametrize("fmt", ["v4_packed", "v41_mxfp8", "bf16", "fp8"])
@pytest.mark.parametrize("device", DEVICES)
def test_accepts_supported_layouts(device, fmt):
    assert check_kv_rope_insert(**_args(device, fmt)) is None


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", ["v4_packed", "v41_mxfp8", "bf16"])
def test_scale_of_another_cache_is_not_read(device, fmt):
    """A scale tensor of any kind passes for a cache that does not read it (a caller may pass
    its layer's scale whatever the cache; rejections of other types: REJECTIONS)."""
    scale = torch.ones(2, 2, dtype=torch.float16)
    assert check_kv_rope_insert(**_args(device, fmt, fp8_scale=scale)) is None


def _like(t, **kw):
    return torch.empty(kw.pop("shape", t.shape), dtype=kw.pop("dtype", t.dtype), device=t.device)


def _strided(shape, stride, numel, dtype=None):
    """A cache view with the given geometry on the arguments' device."""
    def make(a):
        c = a["k_cache"]
        backing = torch.empty(numel, dtype=dtype or c.dtype, device=c.device)
        return backing.as_strided(shape, stride)
    return make


def _other(args) -> str:
    return "cpu" if args["kv"].is_meta else "meta"


REJECTIONS = {  # name -> (format, overrides, fragments of the message)
    "kv_not_a_tensor": ("v4_packed", dict(kv=[1.0]), ("kv", "torch.Tensor")),
    "kv_dtype": ("v4_packed", dict(kv=lambda a: a["kv"].half()), ("kv", "torch.bfloat16")),
    "kv_rank": ("v4_packed", dict(kv=lambda a: a["kv"].unsqueeze(0)), ("kv", "2-D")),
    "kv_width": ("v4_packed", dict(kv=lambda a: a["kv"][:, :448]), ("kv", "512")),
    "kv_not_contiguous": ("v4_packed", dict(kv=lambda a: _like(a["kv"], shape=(512, 11)).t()),
                          ("kv", "contig")),
    "cache_dtype": ("v4_packed", dict(k_cache=lambda a: a["k_cache"].to(torch.float16)),
                    ("k_cache", "torch.uint8")),
    "cache_rank": ("v4_packed", dict(k_cache=lambda a: a["k_cache"][0]), ("k_cache", "3-D")),
    "cache_block_dim_differs_from_block_size": ("v4_packed", dict(block_size=32),
                                                ("k_cache", "size 32 in dim 1")),
    "block_size_not_positive": ("v4_packed", dict(block_size=0), ("block_size", "positive")),
    "block_size_not_int": ("v4_packed", dict(block_size=16.0), ("block_size",)),
    "block_size_none": ("v4_packed", dict(block_size=None), ("block_size", "positive int")),
    "packed_width_for_v41": ("v4_packed", dict(kv_mxfp8=True), ("k_cache", "528")),
    "kv_mxfp8_a_string": ("v4_packed", dict(kv_mxfp8="False"), ("kv_mxfp8", "a bool")),
    "kv_mxfp8_a_tensor": ("bf16", dict(kv_mxfp8=lambda a: torch.ones(
        3, dtype=torch.bool, device=a["kv"].device)), ("kv_mxfp8", "a bool")),
    "kv_mxfp8_none": ("v4_packed", dict(kv_mxfp8=None), ("kv_mxfp8", "a bool")),
    "bf16_width": ("bf16", dict(k_cache=lambda a: _like(a["k_cache"], shape=(2, 16, 584))),
                   ("k_cache", "record width 512")),
    "cache_inner_stride": ("v4_packed", dict(k_cache=_strided(
        (2, 16, 584), (16 * 584 * 2, 584 * 2, 2), 2 * 16 * 584 * 2)),
        ("k_cache", "stride 1 in dim 2")),
    "page_stride_not_16_byte_multiple": ("v4_packed", dict(k_cache=_strided(
        (2, 16, 584), (9352 + 4, 584, 1), 2 * 9400)),
        ("k_cache", "stride(0) a multiple of 16 bytes")),
    "pages_overlap": ("v4_packed", dict(k_cache=_strided(
        (2, 16, 584), (9344 - 16, 584, 1), 3 * 9344)), ("k_cache", "pages must not overlap")),
    "plain_row_stride_not_16_byte_multiple": ("bf16", dict(k_cache=_strided(
        (2, 16, 512), (16 * 516, 516, 1), 2 * 16 * 516)), ("k_cache", "stride(1) a multiple")),
    "cache_on_another_device": ("v4_packed", dict(k_cache=lambda a: torch.empty_strided(
        a["k_cache"].shape, a["k_cache"].stride(), dtype=torch.uint8, device=_other(a))),
        ("k_cache", "kv's device")),
    "slot_mapping_dtype": ("v4_packed", dict(slot_mapping=lambda a: a["slot_mapping"].int()),
                           ("slot_mapping", "torch.int64")),
    "positions_dtype": ("v4_packed", dict(positions=lambda a: a["positions"].int()),
                        ("positions", "torch.int64")),
    "slot_mapping_rank": ("v4_packed", dict(slot_mapping=lambda a: a["slot_mapping"].reshape(
        2, -1)), ("slot_mapping", "1-D")),
    "positions_0d": ("v4_packed", dict(positions=lambda a: a["positions"][0]),
                     ("positions", "1-D")),
    "positions_not_contiguous": ("v4_packed", dict(positions=lambda a: _like(
        a["positions"], shape=(22,))[::2]), ("positions", "contiguous")),
    "positions_length": ("v4_packed", dict(positions=lambda a: a["positions"][:-1]),
                         ("positions", "one per kv row")),
    "positions_a_list": ("v4_packed", dict(positions=[0, 1]), ("positions", "torch.Tensor")),
    "more_slots_than_kv_rows": ("v4_packed", dict(slot_mapping=lambda a: _like(
        a["slot_mapping"], shape=(12,))), ("slot_mapping", "at most 11")),
    "slots_on_another_device": ("v4_packed", dict(slot_mapping=lambda a: torch.empty(
        8, dtype=torch.int64, device=_other(a))), ("slot_mapping", "kv's device")),
    "cos_sin_dtype": ("v4_packed", dict(cos_sin_cache=lambda a: a["cos_sin_cache"].bfloat16()),
                      ("cos_sin_cache", "torch.float32")),
    "cos_sin_width": ("v4_packed", dict(cos_sin_cache=lambda a: a["cos_sin_cache"][
        :, :32].contiguous()), ("cos_sin_cache", "size 64")),
    "cos_sin_not_contiguous": ("v4_packed", dict(cos_sin_cache=lambda a: _like(
        a["cos_sin_cache"], shape=(64, 40)).t()), ("cos_sin_cache", "contiguous")),
    "fp8_cache_without_scale": ("fp8", dict(fp8_scale=None), ("fp8_scale", "float32")),
    "fp8_scale_dtype": ("fp8", dict(fp8_scale=lambda a: a["fp8_scale"].double()),
                        ("fp8_scale", "torch.float32")),
    "fp8_scale_numel": ("fp8", dict(fp8_scale=lambda a: _like(a["fp8_scale"], shape=(2,))),
                        ("fp8_scale", "one element")),
    "fp8_scale_a_float": ("fp8", dict(fp8_scale=0.7), ("fp8_scale", "torch.Tensor")),
    # not read for the other caches, but still None or a tensor
    "fp8_scale_a_string_for_bf16": ("bf16", dict(fp8_scale="1.0"),
                                    ("fp8_scale", "None or a torch.Tensor")),
    "fp8_scale_a_float_for_packed": ("v4_packed", dict(fp8_scale=0.7),
                                     ("fp8_scale", "None or a torch.Tensor")),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(REJECTIONS))
def test_rejection(device, name):
    fmt, overrides, fragments = REJECTIONS[name]
    _rejects(_args(device, fmt, **overrides), *fragments)


@pytest.mark.parametrize("device", DEVICES)
def test_unsupported_arch(device, monkeypatch):
    monkeypatch.setenv("CUTE_KERNELS_ARCH", "sm_80")
    with pytest.raises(LayoutError, match="arch: expected one of sm_90a, sm_100a, got sm_80"):
        check_kv_rope_insert(**_args(device))


def test_misaligned_kv_base():
    args = _args("cpu")
    storage = torch.empty(args["kv"].numel() + 8, dtype=torch.bfloat16)
    args["kv"] = storage[4 : 4 + args["kv"].numel()].view(args["kv"].shape)  # 8-byte offset
    _rejects(args, "kv", "aligned to 16 bytes")


def test_misaligned_cache_base():
    args = _args("cpu")
    c = args["k_cache"]
    storage = torch.empty(c.stride(0) * c.shape[0] + 8, dtype=torch.uint8)
    args["k_cache"] = storage[8:].as_strided(c.shape, c.stride())
    _rejects(args, "k_cache", "aligned to 16 bytes")


@pytest.mark.parametrize("fmt", ["v4_packed", "bf16"])
def test_cache_of_2_31_slots(fmt):
    """The kernel keeps a slot in 32 bits: a cache of 2^31 slots (meta: a 1+ TiB cache) is
    refused, one of 2^31 - 1 is not refused for its size."""
    def cache(pages, block):
        layout = CacheFormat(fmt)
        return torch.empty(pages, block, layout.record_width, dtype=layout.dtype, device="meta")

    _rejects(_args("meta", fmt, k_cache=cache(2**25, 64), block_size=64), "k_cache",
             "at most 2147483647 slots", "33554432 pages x 64")
    odd = 2**31 - 1  # a prime: one page of that many rows
    assert check_kv_rope_insert(**_args("meta", fmt, k_cache=cache(1, odd), block_size=odd)) is None


def test_more_than_2_30_rows():
    """The kernel counts rows in 32 bits: a call of 2^30 + 1 slots (meta: 1 TiB of kv) is
    refused, one of 2^30 is not."""
    def rows(count):  # the case's kv, slot_mapping and positions, with `count` rows
        return {name: lambda args, name=name: args[name].new_empty((count, *args[name].shape[1:]))
                for name in ("kv", "slot_mapping", "positions")}

    _rejects(_args("meta", **rows(2**30 + 1)), "slot_mapping", "at most 1073741824 entries",
             "got 1073741825")
    assert check_kv_rope_insert(**_args("meta", **rows(2**30))) is None


def test_kernel_needs_cuda_tensors():
    with pytest.raises(LayoutError, match="kv: expected a CUDA tensor, got device cpu"):
        cute_kernels.kv_rope_insert(**_args("cpu"))


def test_rejection_happens_before_any_compile():
    """With the host path run as on a GPU (CPU tensors taken for CUDA ones, compiled functions
    recorded): the accepted call reaches its kernel, the rejected one neither compiles nor
    launches."""
    with cpu_launches() as launches, mock.patch.object(KERNELS, "get",
                                                        wraps=KERNELS.get) as lookups:
        cute_kernels.kv_rope_insert(**_args("cpu"))
        assert len(launches) == 1 and lookups.call_count == 1
        with pytest.raises(LayoutError, match="kv: expected"):
            cute_kernels.kv_rope_insert(**_args("cpu", kv=lambda a: a["kv"].half()))
        assert len(launches) == 1 and lookups.call_count == 1  # no compiled function asked for
