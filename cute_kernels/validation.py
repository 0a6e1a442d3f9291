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
