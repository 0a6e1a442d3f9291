"""C128 compressor on the CPU: the float64 reference against first principles, every rejection
(meta and CPU tensors), and one compile key for every token count."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

import cute_kernels
from cute_kernels import LayoutError, check_compress_c128, reference
from cute_kernels.compress_c128 import CORE_ENV, STREAM_MIN_TOKENS, CompressC128Key
from cute_kernels.layouts import C128_FORMATS, CacheFormat
from cute_kernels.testing import POISON, c128_mismatch
from cute_kernels.testing import compress_c128_case as make_case

FORMATS = [f.value for f in C128_FORMATS]


def _window_loop(case, token: int) -> torch.Tensor:
    """One token's normed window, written out row by row in float64."""
    pos = int(case.positions[token])
    req = int(case.token_to_req[token])
    rows = []
    for p in range(pos - 127, pos + 1):
        page = int(case.block_table[req, p // 8])
        rows.append(case.state_cache[page, p % 8].double())
    rows = torch.stack(rows)
    kv, score = rows[:, :512], rows[:, 512:]
    weights = torch.exp(score - score.max(0).values) / torch.exp(score - score.max(0).values).sum(0)
    x = (weights * kv).sum(0)
    return x / torch.sqrt((x * x).mean() + case.eps) * case.norm_weight.double()


def test_normed_windows_match_a_row_by_row_computation():
    case = make_case("v4_packed", 40, 2, "cpu")
    tokens = torch.nonzero(case.boundary).flatten()
    y = reference.c128_normed_windows(case.state_cache, case.block_table, case.token_to_req,
                                      case.positions, case.norm_weight, case.eps, tokens)
    for i, t in enumerate(tokens.tolist()[:5]):
        torch.testing.assert_close(y[i], _window_loop(case, t), rtol=1e-12, atol=1e-12)


def _record(case, token: int):
    slot = int(case.kv_slot_mapping[token])
    kb = case.kv_block_size
    page = (slot // kb) * case.k_cache.stride(0)
    flat = case.backing.view(torch.uint8)
    data = flat[page + (slot % kb) * 576 : page + (slot % kb) * 576 + 576]
    scales = flat[page + kb * 576 + (slot % kb) * 8 : page + kb * 576 + (slot % kb) * 8 + 8]
    return data, scales


def test_packed_record_quantises_and_rotates_the_normed_window():
    case = make_case("v4_packed", 40, 2, "cpu")
    reference.compress_c128(*case.args())
    for token in torch.nonzero(case.boundary).flatten().tolist()[:6]:
        y = _window_loop(case, token)
        data, scales = _record(case, token)
        assert scales[7] == 0
        q = y[:448].to(torch.bfloat16).double().reshape(7, 64)
        for g in range(7):
            e = math.ceil(math.log2(max(q[g].abs().max().item(), 1e-4) / 448))
            assert scales[g] - 127 == e
            decoded = data[64 * g : 64 * g + 64].view(torch.float8_e4m3fn).double() * 2.0**e
            assert bool(((decoded - q[g]).abs() <= q[g].abs() * 2**-4 + 2.0 ** (e - 9)).all())
        start = int(case.positions[token]) - 127
        cos, sin = case.cos_sin_cache[start, :32].double(), case.cos_sin_cache[start, 32:].double()
        e_, o_ = y[448::2], y[449::2]
        rope = torch.stack([e_ * cos - o_ * sin, e_ * sin + o_ * cos], -1).flatten()
        got = data[448:].view(torch.bfloat16).double()
        assert bool(((got - rope).abs() <= rope.abs() * 2**-8 + 1e-30).all())


def _record_bytes(case, slots: torch.Tensor) -> torch.Tensor:
    """Byte mask over the backing of the records of ``slots`` (specs/compress_c128.md):
    packed, 576 value bytes at ``page + row * 576`` and 8 scale bytes at ``page + kb * 576 +
    row * 8``; plain, 512 values at ``page + row * stride(1)``."""
    elem = case.k_cache.element_size()
    kb = case.kv_block_size
    page = (case.k_cache.storage_offset() * elem
            + (slots // kb) * case.k_cache.stride(0) * elem)
    row = slots % kb
    if case.k_cache.dtype == torch.uint8:
        regions = [(page + row * 576, 576), (page + kb * 576 + row * 8, 8)]
    else:
        regions = [(page + row * case.k_cache.stride(1) * elem, 512 * elem)]
    mask = torch.zeros(case.backing.view(torch.uint8).numel(), dtype=torch.bool)
    for start, n in regions:
        mask[(start.unsqueeze(1) + torch.arange(n)).flatten()] = True
    return mask


def _skip_reasons(case) -> list[str | None]:
    """Token by token, from the spec's rule ("Inputs") and not from the reference: None for a
    token that writes its record, else why it does not."""
    requests, columns = case.block_table.shape
    slots = case.k_cache.shape[0] * case.k_cache.shape[1]
    reasons = []
    for t in range(case.positions.shape[0]):
        p = int(case.positions[t])
        req = int(case.token_to_req[t])
        kv_slot = int(case.kv_slot_mapping[t])
        if int(case.slot_mapping[t]) < 0 or kv_slot < 0:
            reasons.append("negative slot")
        elif (p + 1) % 128 != 0:
            reasons.append("not on a boundary")
        elif not 0 <= req < requests:
            reasons.append("request")
        elif not 127 <= p < 8 * columns:
            reasons.append("window")
        elif p - 127 >= case.cos_sin_cache.shape[0]:
            reasons.append("cos/sin row")
        elif kv_slot >= slots:
            reasons.append("record slot")
        else:
            reasons.append(None)
    return reasons


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_only_boundary_tokens_with_both_slots_write(fmt):
    """Every changed byte lies in the record of a boundary token with both slots (told token
    by token from the spec's rule), and most of those records' bytes change (a byte may keep
    the poison's value by chance)."""
    case = make_case(fmt, 77, 2, "cpu")
    writes = torch.tensor([r is None for r in _skip_reasons(case)])
    assert torch.equal(case.boundary, writes)
    reference.compress_c128(*case.args())
    changed = case.backing.view(torch.uint8).flatten() != POISON
    footprint = _record_bytes(case, case.kv_slot_mapping[writes])
    assert not bool((changed & ~footprint).any())
    assert int(changed.sum()) > 0.9 * int(footprint.sum())
    assert int(case.boundary.sum()) < int(((case.positions + 1) % 128 == 0).sum())  # some skipped


def test_no_boundary_writes_nothing():
    case = make_case("bf16", 64, 2, "cpu", boundary_every=0)
    reference.compress_c128(*case.args())
    assert bool((case.backing.view(torch.uint8) == POISON).all())


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_record_comparison_accepts_the_reference_and_names_a_wrong_record(fmt):
    """``testing.c128_mismatch`` (the GPU tests' and ``make perf``'s check): the reference's
    own output passes; a record with one value moved far, or a byte written outside the
    records, is named."""
    case = make_case(fmt, 40, 2, "cpu", seed=3)
    reference.compress_c128(*case.args())
    assert c128_mismatch(case, case.backing) is None
    token = int(torch.nonzero(case.boundary).flatten()[0])
    slot = int(case.kv_slot_mapping[token])
    record = case.k_cache[slot // 2, slot % 2]
    wrong = case.backing.clone()
    wrong_record = wrong.as_strided(case.k_cache.shape, case.k_cache.stride())[slot // 2, slot % 2]
    if fmt == "v4_packed":  # a RoPE dim (bf16 bytes 448 + 2i) negated
        wrong_record[449] = record[449] ^ 0x80
        assert "RoPE" in c128_mismatch(case, wrong)
    else:
        wrong_record[0] = -3 * record[0].float() - 1  # far beyond one ulp / e4m3 step
        assert "off" in c128_mismatch(case, wrong)
    stray = case.backing.clone()
    unwritten = int(torch.nonzero(stray.view(torch.uint8) == POISON).flatten()[-1])
    stray.view(torch.uint8)[unwritten] = 0
    assert c128_mismatch(case, stray) == "bytes outside the records changed"


def _rotated(case, token: int, y: torch.Tensor) -> torch.Tensor:
    """``y`` with its dims 448..511 rotated pair by pair (GPT-J: dims 448 + 2j, 449 + 2j) at
    the window's first position, in float64."""
    table = case.cos_sin_cache[int(case.positions[token]) - 127].double()
    cos, sin = table[:32], table[32:]
    even, odd = y[448::2], y[449::2]
    out = y.clone()
    out[448::2] = even * cos - odd * sin
    out[449::2] = even * sin + odd * cos
    return out


def test_full_caches_hold_the_rounded_values():
    """Every boundary token's record of a full cache, all 512 dims, from a row-by-row float64
    computation: the bf16 cache the rounded values, the fp8 cache their e4m3 codes."""
    for fmt in ("bf16", "fp8"):
        case = make_case(fmt, 20, 64, "cpu")
        reference.compress_c128(*case.args())
        tokens = torch.nonzero(case.boundary).flatten().tolist()
        assert len(tokens) >= 3
        for token in tokens:
            slot = int(case.kv_slot_mapping[token])
            row = case.k_cache[slot // 64, slot % 64].double()
            v = _rotated(case, token, _window_loop(case, token)).to(torch.bfloat16).double()
            if fmt == "bf16":
                torch.testing.assert_close(row, v)
            else:
                want = (v / 0.05).clamp(-448, 448)
                assert bool(((row - want).abs() <= want.abs() * 2**-4 + 2**-9).all())


def _meta_key(tokens: int) -> CompressC128Key:
    args = [a.to("meta") if isinstance(a, torch.Tensor) else a
            for a in make_case("v4_packed", tokens, 2, "cpu").args()]
    return cute_kernels.compress_c128.validate(*args)


def test_one_compile_key_per_core_for_every_token_count(monkeypatch):
    """Fewer than STREAM_MIN_TOKENS tokens take the cluster core, the rest the stream core:
    two compile keys across every token count."""
    monkeypatch.setenv("CUTE_KERNELS_ARCH", "sm_90a")
    packed = CacheFormat.V4_PACKED
    by_tokens = {t: _meta_key(t) for t in (1, 17, STREAM_MIN_TOKENS - 1, STREAM_MIN_TOKENS,
                                           1024, 4096)}
    assert {t for t, key in by_tokens.items() if key.core == "cluster"} == {
        1, 17, STREAM_MIN_TOKENS - 1}
    assert set(by_tokens.values()) == {CompressC128Key(packed, "bfloat16", "sm_90a", core)
                                       for core in ("cluster", "stream")}


@pytest.mark.parametrize("core", ["cluster", "stream"])
def test_core_can_be_forced(monkeypatch, core):
    monkeypatch.setenv("CUTE_KERNELS_ARCH", "sm_90a")
    monkeypatch.setenv(CORE_ENV, core)
    assert {_meta_key(t).core for t in (1, 4096)} == {core}


def test_unknown_core_is_rejected(monkeypatch):
    monkeypatch.setenv("CUTE_KERNELS_ARCH", "sm_90a")
    monkeypatch.setenv(CORE_ENV, "tma")
    with pytest.raises(LayoutError, match=f"{CORE_ENV}: expected auto or one of cluster, "
                                          "stream, got 'tma'"):
        _meta_key(64)


# -- rejections -----------------------------------------------------------------------------

NAMES = ("state_cache", "block_table", "token_to_req", "positions", "slot_mapping",
         "norm_weight", "eps", "cos_sin_cache", "k_cache", "kv_slot_mapping", "kv_block_size",
         "fp8_scale")


def _meta(t):
    if not isinstance(t, torch.Tensor):
        return t
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")


def _args(device, fmt="v4_packed", **overrides):
    case = make_case(fmt, 16, 2, "cpu")
    args = dict(zip(NAMES, case.args(), strict=True))
    if device == "meta":
        args = {k: _meta(v) for k, v in args.items()}
    for key, value in overrides.items():
        args[key] = value(args) if callable(value) else value
    return args


def _new(t, shape, dtype=None, stride=None):
    dtype = dtype or t.dtype
    if stride is None:
        return torch.empty(shape, dtype=dtype, device=t.device)
    return torch.empty_strided(shape, stride, dtype=dtype, device=t.device)


def _rejects(args, *fragments):
    """The LayoutError blames the argument ``fragments[0]`` and holds the other fragments."""
    with pytest.raises(LayoutError) as err:
        check_compress_c128(**args)
    msg = str(err.value)
    assert msg.startswith(f"{fragments[0]}: expected"), msg
    assert all(f in msg for f in fragments[1:]) and "got" in msg, msg


REJECTIONS = {
    "state_cache_without_pages": (dict(state_cache=lambda a: _new(a["state_cache"],
                                                                  (0, 8, 1024))),
                                  ("state_cache", "at least one page")),
    "state_dtype": (dict(state_cache=lambda a: _new(a["state_cache"], (4, 8, 1024),
                                                    torch.bfloat16)), ("state_cache", "float32")),
    "state_block_size_4": (dict(state_cache=lambda a: _new(a["state_cache"], (4, 4, 1024))),
                           ("state_cache", "block size 8")),
    "state_overlap_width": (dict(state_cache=lambda a: _new(a["state_cache"], (4, 8, 2048))),
                            ("state_cache", "no overlap")),
    "state_head_256": (dict(state_cache=lambda a: _new(a["state_cache"], (4, 8, 512))),
                       ("state_cache", "1024")),
    "state_rank": (dict(state_cache=lambda a: _new(a["state_cache"], (32, 1024))),
                   ("state_cache", "3-D")),
    "state_row_stride": (dict(state_cache=lambda a: _new(a["state_cache"], (4, 8, 1024),
                                                         stride=(8 * 1040, 1040, 1))),
                         ("state_cache", "row stride 1024")),
    "state_pages_overlap": (dict(state_cache=lambda a: _new(a["state_cache"], (4, 8, 1024),
                                                            stride=(4096, 1024, 1))),
                            ("state_cache", "pages must not overlap")),
    "state_page_stride_16B": (dict(state_cache=lambda a: _new(a["state_cache"], (4, 8, 1024),
                                                              stride=(8194, 1024, 1))),
                              ("state_cache", "multiple of 16 bytes")),
    "block_table_dtype": (dict(block_table=lambda a: a["block_table"].long()),
                          ("block_table", "int32")),
    "block_table_rank": (dict(block_table=lambda a: a["block_table"].flatten()),
                         ("block_table", "2-D")),
    "block_table_strided": (dict(block_table=lambda a: _new(a["block_table"], (4, 10),
                                                            stride=(1, 4))),
                            ("block_table", "unit stride")),
    "token_to_req_dtype": (dict(token_to_req=lambda a: a["token_to_req"].long()),
                           ("token_to_req", "int32")),
    "positions_dtype": (dict(positions=lambda a: a["positions"].int()), ("positions", "int64")),
    "slot_mapping_dtype": (dict(slot_mapping=lambda a: a["slot_mapping"].int()),
                           ("slot_mapping", "int64")),
    "kv_slot_dtype": (dict(kv_slot_mapping=lambda a: a["kv_slot_mapping"].int()),
                      ("kv_slot_mapping", "int64")),
    "kv_slot_length": (dict(kv_slot_mapping=lambda a: a["kv_slot_mapping"][:-1]),
                       ("kv_slot_mapping", "one per token")),
    "slots_not_contiguous": (dict(slot_mapping=lambda a: _new(a["slot_mapping"], (16,),
                                                              stride=(2,))),
                             ("slot_mapping", "contiguous")),
    "norm_weight_dtype": (dict(norm_weight=lambda a: a["norm_weight"].half()),
                          ("norm_weight", "bfloat16")),
    "norm_weight_width": (dict(norm_weight=lambda a: a["norm_weight"][:256]),
                          ("norm_weight", "512")),
    "eps_negative": (dict(eps=-1.0), ("eps", "non-negative")),
    "cos_sin_dtype": (dict(cos_sin_cache=lambda a: a["cos_sin_cache"].double()),
                      ("cos_sin_cache", "float32")),
    "cos_sin_width": (dict(cos_sin_cache=lambda a: a["cos_sin_cache"][:, :32].contiguous()),
                      ("cos_sin_cache", "64")),
    "k_cache_rank": (dict(k_cache=lambda a: a["k_cache"][0]), ("k_cache", "3-D")),
    "k_cache_dtype": (dict(k_cache=lambda a: _new(a["k_cache"], (4, 2, 584), torch.float16)),
                      ("k_cache", "torch.uint8")),
    "k_cache_width_528": (dict(k_cache=lambda a: _new(a["k_cache"], (4, 2, 528))),
                          ("k_cache", "record width 584")),
    "k_cache_inner_stride": (dict(k_cache=lambda a: _new(a["k_cache"], (4, 2, 584),
                                                         stride=(2400, 1200, 2))),
                             ("k_cache", "stride 1 in dim 2")),
    "kv_block_size_mismatch": (dict(kv_block_size=64), ("kv_block_size", "k_cache.shape[1]")),
    "kv_block_size_type": (dict(kv_block_size=2.0), ("kv_block_size", "positive int")),
    "positions_0d": (dict(positions=lambda a: a["positions"][0]), ("positions", "1-D")),
    "positions_none": (dict(positions=None), ("positions", "torch.Tensor")),
    "positions_a_list": (dict(positions=[127, 255]), ("positions", "torch.Tensor")),
    "positions_an_int": (dict(positions=127), ("positions", "torch.Tensor")),
    "eps_overflows_a_float": (dict(eps=10**400), ("eps", "finite")),
    "eps_a_string": (dict(eps="1e-6"), ("eps", "float")),
    "index_on_other_device": (dict(positions=lambda a: torch.empty(
        16, dtype=torch.int64, device="cpu" if a["state_cache"].is_meta else "meta")),
        ("positions", "state_cache's device")),
}


@pytest.mark.parametrize("device", ["meta", "cpu"])
@pytest.mark.parametrize("name", list(REJECTIONS))
def test_rejection(device, name):
    overrides, fragments = REJECTIONS[name]
    _rejects(_args(device, **overrides), *fragments)


@pytest.mark.parametrize("device", ["meta", "cpu"])
def test_fp8_cache_without_scale(device):
    _rejects(_args(device, "fp8", fp8_scale=None), "fp8_scale", "float32")


@pytest.mark.parametrize("device", ["meta", "cpu"])
def test_fp8_scale_numel(device):
    _rejects(_args(device, "fp8", fp8_scale=lambda a: _new(a["fp8_scale"], (2,))),
             "fp8_scale", "one element")


@pytest.mark.parametrize("device", ["meta", "cpu"])
def test_scale_of_another_cache_is_none_or_a_tensor(device):
    """Not read for a packed or bf16 cache: a tensor of any kind is accepted (a caller may
    pass its layer's scale whatever the cache), anything else is rejected by name."""
    check_compress_c128(**_args(device, fp8_scale=lambda a: torch.ones(3, dtype=torch.float64)))
    check_compress_c128(**_args(device, "bf16", fp8_scale=None))
    _rejects(_args(device, fp8_scale=0.5), "fp8_scale", "None or a torch.Tensor")
    _rejects(_args(device, "bf16", fp8_scale="1.0"), "fp8_scale", "None or a torch.Tensor")


@pytest.mark.parametrize("device", ["meta", "cpu"])
def test_unsupported_arch(device, monkeypatch):
    monkeypatch.setenv("CUTE_KERNELS_ARCH", "sm_89")
    with pytest.raises(LayoutError, match="arch: expected one of"):
        check_compress_c128(**_args(device))


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("device", ["meta", "cpu"])
def test_accepts_supported_layouts(device, fmt):
    assert check_compress_c128(**_args(device, fmt)) is None


def test_kernel_needs_cuda_tensors():
    with pytest.raises(LayoutError, match="state_cache: expected a CUDA tensor"):
        cute_kernels.compress_c128(**_args("cpu"))


@pytest.mark.parametrize("fmt", FORMATS)
def test_out_of_range_indices(fmt):
    """A boundary token whose request, window (block-table entries, cos/sin row) or record
    slot lies outside its tensor writes nothing; a page id outside the state cache is read
    clamped into it. So the reference equals the one of the same case with those tokens'
    record slots -1 and the block table clamped, and the guard page behind the cache keeps
    its poison."""
    case = make_case(fmt, 600, 2, "cpu", seed=9, out_of_range=True)
    reasons = _skip_reasons(case)
    assert torch.equal(case.boundary, torch.tensor([r is None for r in reasons]))
    for kind in ("request", "window", "cos/sin row", "record slot"):
        assert reasons.count(kind) >= 2, kind  # each way out of range is exercised
    skipped = torch.tensor([r not in (None, "negative slot", "not on a boundary")
                            for r in reasons])
    assert int(case.boundary.sum()) >= 20
    num_pages = case.state_cache.shape[0]
    outside = (case.block_table < 0) | (case.block_table >= num_pages)
    assert bool(outside.any())
    reference.compress_c128(*case.args())
    kv_slots = case.kv_slot_mapping.clone()
    kv_slots[skipped] = -1
    clamped = dataclasses.replace(
        case, kv_slot_mapping=kv_slots, block_table=case.block_table.clamp(0, num_pages - 1))
    backing, cache = clamped.fresh_cache()
    reference.compress_c128(*clamped.args(cache))
    assert torch.equal(case.backing.view(torch.uint8), backing.view(torch.uint8))
    guard = case.backing.view(torch.uint8)[case.k_cache.shape[0] * case.k_cache.stride(0)
                                           * case.k_cache.element_size():]
    assert guard.numel() > 0 and bool((guard == POISON).all())
