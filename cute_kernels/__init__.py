"""cute-kernels: layout-specialised CuTe DSL kernels for LLM serving engines.

Public API::

    kv_rope_insert(...)          DeepSeek V4/V4.1 KV-only RoPE + quantise + paged insert
    compress_c128(...)           DeepSeek V4 C128 compressor + RMSNorm + RoPE + fp8 store
    stacked_kv_proj(...)         DSpark stacked K/V projection, norm + RoPE + KV scatter epilogue
    check_kv_rope_insert(...), check_compress_c128(...), check_stacked_kv_proj(...)
                                 their layout checks (meta tensors welcome)
    LayoutError                  raised for unsupported layouts, before any compile or launch
    precompile(arch=None)        build (or load from disk) every kernel variant up front
    set_strict(True)             any later compile raises StrictModeError
    cache_stats()                compile-cache counters
    reference                    pure-PyTorch references (the executable specs)
"""

from __future__ import annotations

from . import reference
from .arch import SUPPORTED_ARCHS, arch_for
from .compile_cache import (
    StrictModeError,
    cache_stats,
    families,
    reset_cache_stats,
    set_strict,
)
from .compress_c128 import check_compress_c128, compress_c128
from .kv_rope_insert import check_kv_rope_insert, kv_rope_insert
from .stacked_kv_proj import check_stacked_kv_proj, stacked_kv_proj
from .validation import LayoutError

__version__ = "0.1.0"


def precompile(arch: str | None = None, kernels: list[str] | None = None) -> None:
    """Compile (or load from the disk cache) every variant of the named kernel families (all by
    default) for ``arch`` (default: the current CUDA device). Call once at start-up."""
    import torch

    target = arch_for(torch.device("cuda"), arch) if arch is None else arch_for(
        torch.device("meta"), arch
    )
    for name, cache in families().items():
        if kernels is None or name in kernels:
            cache.precompile(cache.variants(target))


__all__ = [
    "SUPPORTED_ARCHS",
    "LayoutError",
    "StrictModeError",
    "cache_stats",
    "check_compress_c128",
    "check_kv_rope_insert",
    "check_stacked_kv_proj",
    "compress_c128",
    "kv_rope_insert",
    "precompile",
    "reference",
    "reset_cache_stats",
    "set_strict",
    "stacked_kv_proj",
]
