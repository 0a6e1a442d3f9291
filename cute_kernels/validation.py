"""Pure-Python layout checks over tensor metadata.

Everything here reads only dtype, shape, strides, device and the data pointer, so it runs
before any compile or launch, costs no GPU work, and accepts ``meta`` tensors: a model loader
can check a layout at load time without a GPU and without allocating.

Every failure is a :class:`LayoutError` whose message names the argument, what was expected
and what was given, whatever the type of the value.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NoReturn

import torch


class LayoutError(ValueError):
    """An argument's type, dtype, shape, stride, alignment or device is not one a kernel
    supports. The message names the argument, what was expected and what was given."""


def fail(arg: str, expected: str, got: object) -> NoReturn:
    raise LayoutError(f"{arg}: expected {expected}, got {got}")


def describe(value: object) -> str:
    """A short description of any value for a message (never the repr of a huge object)."""
    if isinstance(value, torch.Tensor):
        if value.is_nested:  # its components' shapes differ: it has no one shape to name
            return f"a nested {value.dtype} tensor on {value.device}"
        return f"a {value.dtype} tensor of shape {tuple(value.shape)} on {value.device}"
    text = repr(value)
    return text if len(text) <= 60 else f"a {type(value).__name__}"


def expect_tensor(t: object, arg: str) -> torch.Tensor:
    """A dense torch.Tensor: the kernels address every argument by its strides (a sparse or
    otherwise unstrided tensor has none, nor a data pointer to pass; a nested tensor of the
    strided layout has neither one shape nor strides)."""
    if not isinstance(t, torch.Tensor):
        fail(arg, "a torch.Tensor", describe(t))
    if t.layout is not torch.strided:
        fail(arg, "a dense (torch.strided) tensor", f"layout {t.layout}")
    if t.is_nested:
        fail(arg, "a dense (torch.strided) tensor", describe(t))
    return t


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
    """The data pointer is ``align_bytes``-aligned (meta tensors have no address: skipped).

    ``align_bytes`` is the alignment the kernel was compiled to assume for this argument:
    TVM-FFI refuses a misaligned pointer at the call, without naming the argument."""
    if t.device.type == "meta" or t.numel() == 0:
        return
    if t.data_ptr() % align_bytes:
        fail(arg, f"a data pointer aligned to {align_bytes} bytes", hex(t.data_ptr()))


def expect_arg(
    t: object,
    arg: str,
    dtypes: Sequence[torch.dtype],
    rank: int,
    align_bytes: int,
    device: torch.device | None = None,
    ref_arg: str = "",
    sizes: dict[int, int] | None = None,
    contiguous: bool = False,
) -> torch.Tensor:
    """The checks every tensor argument gets, in the order a message is most useful: a tensor,
    on ``ref_arg``'s device (when given), of one of ``dtypes``, of ``rank`` dims, of the given
    ``sizes`` (dim -> size), contiguous (when asked), with a base aligned as the kernel was
    compiled to assume."""
    expect_tensor(t, arg)
    if device is not None:
        expect_same_device(t, arg, device, ref_arg)
    expect_dtype(t, arg, *dtypes)
    expect_rank(t, arg, rank)
    for dim, size in (sizes or {}).items():
        expect_size(t, arg, dim, size)
    if contiguous:
        expect_contiguous(t, arg)
    expect_base_aligned(t, arg, align_bytes)
    return t


def expect_index(
    t: object, arg: str, dtype: torch.dtype, device: torch.device, ref_arg: str,
    length: int | None = None, length_rule: str = "",
) -> torch.Tensor:
    """A contiguous 1-D index tensor of ``dtype`` (``length`` entries when given)."""
    expect_arg(t, arg, (dtype,), 1, dtype.itemsize, device, ref_arg, contiguous=True)
    if length is not None and t.shape[0] != length:
        fail(arg, f"{length} entries ({length_rule})", t.shape[0])
    return t


def expect_positive_int(value: object, arg: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        fail(arg, "a positive int", describe(value))
    return value  # type: ignore[return-value]


def expect_bool(value: object, arg: str) -> bool:
    """A Python bool (or the int 0 or 1): no truthiness of strings, tensors or None."""
    if value is True or value is False or (type(value) is int and value in (0, 1)):
        return bool(value)
    fail(arg, "a bool", describe(value))


def expect_eps(value: object, arg: str = "eps") -> float:
    """A finite, non-negative real number that fits an fp32 kernel argument."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        fail(arg, "a finite non-negative float", describe(value))
    try:
        eps = float(value)
    except OverflowError:
        eps = math.inf
    if not (0.0 <= eps <= 3.4e38):
        fail(arg, "a finite non-negative float (at most the fp32 maximum)", describe(value))
    return eps


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


def expect_fp8_scale(fp8_scale: object, device: torch.device, ref_arg: str,
                     align_bytes: int, read: bool) -> None:
    """The per-tensor scale of a float8_e4m3fn cache (``read``): one fp32 element, read on the
    device. For any other cache it is not read: None or a tensor (a caller may pass its layer's
    scale whatever the cache), nothing else."""
    if not read:
        if fp8_scale is not None and not isinstance(fp8_scale, torch.Tensor):
            fail("fp8_scale", "None or a torch.Tensor (not read for this cache)",
                 describe(fp8_scale))
        return
    if fp8_scale is None:
        fail("fp8_scale", "a float32 tensor of one element for a float8_e4m3fn cache", None)
    expect_tensor(fp8_scale, "fp8_scale")
    expect_same_device(fp8_scale, "fp8_scale", device, ref_arg)
    expect_dtype(fp8_scale, "fp8_scale", torch.float32)
    if fp8_scale.numel() != 1:
        fail("fp8_scale", "one element", f"shape {tuple(fp8_scale.shape)}")
    expect_base_aligned(fp8_scale, "fp8_scale", align_bytes)
