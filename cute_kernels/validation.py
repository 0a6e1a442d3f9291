"""Pure-Python layout checks over tensor metadata.

Everything here reads only dtype, shape, strides, device and the data pointer, so it runs
before any compile or launch, costs no GPU work, and accepts ``meta`` tensors: a model loader
can check a layout at load time without a GPU and without allocating.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class LayoutError(ValueError):
    """An argument's dtype, shape, stride, alignment or device is not one a kernel supports.

    The message names the argument, what was expected and what was given.
    """


def fail(arg: str, expected: str, got: object) -> None:
    raise LayoutError(f"{arg}: expected {expected}, got {got}")


def expect_tensor(t: object, arg: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        fail(arg, "a torch.Tensor", type(t).__name__)
    return t  # type: ignore[return-value]


def expect_dtype(t: torch.Tensor, arg: str, *dtypes: torch.dtype) -> None:
    if t.dtype not in dtypes:
        names = " or ".join(str(d) for d in dtypes)
        fail(arg, f"dtype {names}", t.dtype)


def expect_rank(t: torch.Tensor, arg: str, rank: int) -> None:
    if t.dim() != rank:
        fail(arg, f"a {rank}-D tensor", f"{t.dim()}-D shape {tuple(t.shape)}")


def expect_size(t: torch.Tensor, arg: str, dim: int, size: int) -> None:
    if t.shape[dim] != size:
        fail(arg, f"size {size} in dim {dim}", f"shape {tuple(t.shape)}")


def expect_contiguous(t: torch.Tensor, arg: str) -> None:
    if not t.is_contiguous():
        fail(arg, "a contiguous tensor", f"strides {t.stride()} for shape {tuple(t.shape)}")


def expect_inner_stride_one(t: torch.Tensor, arg: str) -> None:
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        fail(arg, "stride 1 in the last dim", f"strides {t.stride()}")


def expect_same_device(t: torch.Tensor, arg: str, device: torch.device, ref_arg: str) -> None:
    if t.device != device:
        fail(arg, f"a tensor on {ref_arg}'s device {device}", f"device {t.device}")


def expect_stride_multiple(
    t: torch.Tensor, arg: str, dims: Sequence[int], align_bytes: int
) -> None:
    """Every listed stride, in bytes, is a multiple of ``align_bytes`` (vector accesses)."""
    for d in dims:
        if t.shape[d] > 1 and (t.stride(d) * t.element_size()) % align_bytes:
            fail(
                arg,
                f"stride({d}) a multiple of {align_bytes} bytes",
                f"{t.stride(d)} elements = {t.stride(d) * t.element_size()} bytes",
            )


def expect_base_aligned(t: torch.Tensor, arg: str, align_bytes: int) -> None:
    """The data pointer is ``align_bytes``-aligned (meta tensors have no address: skipped)."""
    if t.device.type == "meta" or t.numel() == 0:
        return
    if t.data_ptr() % align_bytes:
        fail(arg, f"a data pointer aligned to {align_bytes} bytes", hex(t.data_ptr()))


def expect_paged_cache_strides(
    k_cache: torch.Tensor, arg: str, block_size: int, record_width: int, packed: bool,
    align_bytes: int,
) -> None:
    """A paged cache ``[pages, block_size, W]``: unit inner stride, strides in multiples of
    ``align_bytes``, and pages (and, for plain caches, rows) that do not overlap. Packed caches
    hold a page as ``block_size`` records followed by their scales, so ``stride(1)`` is unused."""
    if k_cache.stride(2) != 1:
        fail(arg, "stride 1 in dim 2", f"strides {k_cache.stride()}")
    elem = k_cache.element_size()
    if packed:
        page_bytes = block_size * record_width * elem
        expect_stride_multiple(k_cache, arg, [0], align_bytes)
    else:
        if k_cache.stride(1) < record_width:
            fail(arg, f"stride(1) >= {record_width} (rows must not overlap)", k_cache.stride())
        page_bytes = block_size * k_cache.stride(1) * elem
        expect_stride_multiple(k_cache, arg, [0, 1], align_bytes)
    if k_cache.shape[0] > 1 and k_cache.stride(0) * elem < page_bytes:
        fail(arg, f"page stride >= {page_bytes} bytes (pages must not overlap)",
             f"{k_cache.stride(0) * elem} bytes")
    expect_base_aligned(k_cache, arg, align_bytes)


def expect_fp8_scale(fp8_scale: object, device: torch.device, ref_arg: str) -> None:
    """The per-tensor scale of a float8_e4m3fn cache: one fp32 element, read on the device."""
    if fp8_scale is None:
        fail("fp8_scale", "a float32 tensor of one element for a float8_e4m3fn cache", None)
    expect_tensor(fp8_scale, "fp8_scale")
    expect_same_device(fp8_scale, "fp8_scale", device, ref_arg)
    expect_dtype(fp8_scale, "fp8_scale", torch.float32)
    if fp8_scale.numel() != 1:
        fail("fp8_scale", "one element", f"shape {tuple(fp8_scale.shape)}")
