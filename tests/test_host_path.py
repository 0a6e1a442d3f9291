"""The remembered-layout fast path of the ops (cute_kernels.ops): a layout accepted once skips the
full validation, and everything the validation would reject is still rejected with the same
message, whatever was accepted before."""

from __future__ import annotations

import pytest
import torch

import cute_kernels
from cute_kernels import LayoutError, ops
from cute_kernels.testing import (
    compress_c128_case,
    kv_rope_insert_case,
    stacked_kv_proj_case,
)


def _message(fn, *args) -> str | None:
    try:
        fn(*args)
    except LayoutError as err:
        return str(err)
    return None


def _offset(t: torch.Tensor, elements: int = 1) -> torch.Tensor:
    """The same values at an address ``elements`` further on (a misaligned base)."""
    flat = torch.empty(t.numel() + elements, dtype=t.dtype)
    view = flat[elements:].view(t.shape)
    view.copy_(t)
    return view


CASES = {
    "kv_rope_insert": lambda: kv_rope_insert_case("bf16", 8, 16, "cpu").args(),
    "compress_c128": lambda: compress_c128_case("v4_packed", 16, 2, "cpu").args(),
    "stacked_kv_proj": lambda: stacked_kv_proj_case(8, hidden=128).args(),
}


@pytest.mark.parametrize("name", list(CASES))
def test_accepted_layout_is_remembered_and_a_changed_one_is_validated_again(name):
    op = getattr(cute_kernels, name)
    op.forget_layouts()
    args = CASES[name]()
    assert op.check(*args) is None
    assert op.check(*args) is None
    # A misaligned first tensor: a new signature, so the full validation runs and rejects.
    bad = (_offset(args[0]), *args[1:])
    first = _message(op.check, *bad)
    assert first is not None and "aligned" in first
    assert _message(op.check, *bad) == first  # rejections are never remembered
    assert op.check(*args) is None


@pytest.mark.parametrize("name", list(CASES))
def test_every_rejection_survives_an_accepted_twin(name):
    """Accept the layout, then change one argument at a time in ways the validation
    rejects: each change is a new signature, rejected exactly as on a fresh process."""
    op = getattr(cute_kernels, name)
    args = CASES[name]()
    op.forget_layouts()
    fresh = []
    variants = []
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor) and a.numel() > 1:
            variants.append(args[:i] + (a.to(torch.float16),) + args[i + 1:])
            variants.append(args[:i] + (a.unsqueeze(0),) + args[i + 1:])
    for v in variants:
        op.forget_layouts()
        fresh.append(_message(op.check, *v))
    op.forget_layouts()
    assert op.check(*args) is None
    for v, want in zip(variants, fresh, strict=True):
        assert _message(op.check, *v) == want
    assert sum(m is not None for m in fresh) == len(variants)


def test_unhashable_arguments_fall_back_to_the_full_validation():
    op = cute_kernels.kv_rope_insert
    args = list(CASES["kv_rope_insert"]())
    args[3] = {"not": "a tensor"}  # unhashable
    with pytest.raises(LayoutError, match="positions: expected a torch.Tensor"):
        op.check(*args)


def test_the_op_path_keeps_rejecting_cpu_tensors():
    args = CASES["kv_rope_insert"]()
    for _ in range(2):  # never remembered: the CUDA check is part of the op's rejection
        with pytest.raises(LayoutError, match="kv: expected a CUDA tensor"):
            cute_kernels.kv_rope_insert(*args)


def test_the_arch_override_is_part_of_the_signature(monkeypatch):
    op = cute_kernels.kv_rope_insert
    op.forget_layouts()
    args = tuple(a.to("meta") if isinstance(a, torch.Tensor) and a.is_contiguous() else a
                 for a in CASES["kv_rope_insert"]())
    monkeypatch.setenv("CUTE_KERNELS_ARCH", "sm_90a")
    assert op.check(*args) is None
    monkeypatch.setenv("CUTE_KERNELS_ARCH", "sm_80")
    with pytest.raises(LayoutError, match="arch: expected one of"):
        op.check(*args)


def test_signature_reads_alignment_dtype_shape_strides_and_device():
    t = torch.zeros(4, 8)
    base = ops.layout_signature((t,))
    assert ops.layout_signature((t.clone(),)) == base  # same layout, other storage
    assert ops.layout_signature((_offset(t),)) != base
    assert ops.layout_signature((t.double(),)) != base
    assert ops.layout_signature((t.t(),)) != base
    assert ops.layout_signature((t[:2],)) != base
    assert ops.layout_signature((t.to("meta"),)) != ops.layout_signature((_offset(t),))
    assert ops.layout_signature((1,)) != ops.layout_signature((1.0,))
    assert ops.layout_signature((True,)) != ops.layout_signature((1,))
