"""Layout facts shared by the kernels and their references, with no CuTe DSL import.

Dimensions, cache record formats, group sizes and dtype names live here once: the kernels
compile against them, the validation checks against them, and :mod:`cute_kernels.reference`
computes with them, so the executable specs never depend on the implementation.
"""

from __future__ import annotations

import enum

import torch

#: Every kernel moves data in 16-byte vectors where it can; bases and strides must allow it.
VECTOR_BYTES = 16

# -- DeepSeek V4 attention head (KV insert and C128 compressor) ----------------------------

HEAD_DIM = 512
ROPE_DIM = 64  # GPT-J pairs on the last 64 dims
NOPE_DIM = HEAD_DIM - ROPE_DIM  # 448
FP8_MAX = 448.0  # largest finite e4m3fn
UE8M0_MIN_AMAX = 1e-4  # a group's absolute maximum is clamped to this before its exponent


class CacheFormat(enum.Enum):
    """A paged KV-cache record of one 512-dim head; the cache dtype (and ``kv_mxfp8`` for a
    uint8 cache) selects it.

    Packed formats hold a page as ``block_size`` data records followed by ``block_size`` scale
    rows (so ``k_cache.stride(1)`` is unused); plain formats hold one row per slot.
    """

    V4_PACKED = "v4_packed"  # uint8 [.., 584]: 448 e4m3 + 64 bf16 RoPE | 7 UE8M0 + pad byte
    V41_MXFP8 = "v41_mxfp8"  # uint8 [.., 528]: 512 e4m3 | 16 UE8M0 (groups of 32)
    BF16 = "bf16"  # bf16 [.., 512]
    FP8 = "fp8"  # float8_e4m3fn [.., 512] with a per-tensor scale

    @property
    def packed(self) -> bool:
        return self in (CacheFormat.V4_PACKED, CacheFormat.V41_MXFP8)

    @property
    def dtype(self) -> torch.dtype:
        return _FORMAT_DTYPES[self]

    @property
    def record_width(self) -> int:
        """``k_cache.shape[2]``, in cache elements: data bytes + scale bytes when packed."""
        return self.data_bytes + self.scale_bytes if self.packed else HEAD_DIM

    @property
    def row_bytes(self) -> int:
        """Bytes of one record (``record_width`` elements)."""
        return self.record_width * self.dtype.itemsize

    @property
    def data_bytes(self) -> int:
        """Packed: bytes of a record's data region (e4m3 codes, and bf16 RoPE dims for V4)."""
        return {CacheFormat.V4_PACKED: NOPE_DIM + 2 * ROPE_DIM,
                CacheFormat.V41_MXFP8: HEAD_DIM}.get(self, 0)

    @property
    def scale_bytes(self) -> int:
        """Packed: bytes of a record's scale row (V4: 7 group scales + a zero pad byte)."""
        return {CacheFormat.V4_PACKED: 8, CacheFormat.V41_MXFP8: 16}.get(self, 0)

    @property
    def group(self) -> int:
        """Packed: dims per UE8M0 scale (V4 quantises the 448 NoPE dims only)."""
        return {CacheFormat.V4_PACKED: 64, CacheFormat.V41_MXFP8: 32}.get(self, 0)


_FORMAT_DTYPES = {
    CacheFormat.V4_PACKED: torch.uint8,
    CacheFormat.V41_MXFP8: torch.uint8,
    CacheFormat.BF16: torch.bfloat16,
    CacheFormat.FP8: torch.float8_e4m3fn,
}
CACHE_DTYPES = (torch.uint8, torch.bfloat16, torch.float8_e4m3fn)


def cache_format(dtype: torch.dtype, kv_mxfp8: bool = False) -> CacheFormat:
    """The record format of a cache of ``dtype`` (one of :data:`CACHE_DTYPES`)."""
    if dtype == torch.uint8:
        return CacheFormat.V41_MXFP8 if kv_mxfp8 else CacheFormat.V4_PACKED
    if dtype == torch.bfloat16:
        return CacheFormat.BF16
    return CacheFormat.FP8


# -- C128 compressor -----------------------------------------------------------------------

C128_RATIO = 128  # positions per compressed record (one window)
C128_STATE_BLOCK = 8  # state-cache rows per page
C128_STATE_WIDTH = 2 * HEAD_DIM  # a state row: kv | score (the score holds the position bias)
#: Compressed-cache formats the compressor writes (V4.1's mxfp8 record is not one of them).
C128_FORMATS = (CacheFormat.V4_PACKED, CacheFormat.BF16, CacheFormat.FP8)

# -- stacked KV projection -----------------------------------------------------------------

STACKED_HEAD_DIMS = (64, 128, 256)
STACKED_MAX_LAYERS = 16  # the caches are kernel arguments: one pointer + stride each
STACKED_K_TILE = 64  # H must be a multiple of it (one 128-byte swizzle atom of bf16)

# -- norm weights ----------------------------------------------------------------------------

#: The one spelling of a norm weight's dtype in compile keys.
NORM_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def norm_dtype_name(dtype: torch.dtype) -> str:
    return "float32" if dtype == torch.float32 else "bfloat16"
