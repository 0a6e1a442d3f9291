"""cute-kernels: layout-specialised CuTe DSL kernels for LLM serving engines.

Public API::

    kv_rope_insert(...)          DeepSeek V4/V4.1 KV-only RoPE + quantise + paged insert
    compress_c128(...)           DeepSeek V4 C128 compressor + RMSNorm + RoPE + fp8 store
    stacked_kv_proj(...)         DSpark stacked K/V projection, norm + RoPE + KV scatter epilogue
    check_kv_rope_insert(...), check_compress_c128(...), check_stacked_kv_proj(...)
                                 their layout checks (meta tensors welcome)
    LayoutError                  raised for unsupported layouts, before any compile or launch
    plan(deployment, arch=, tp=) which ops of a deployment (a Deployment, a PRESETS name or a
                                 JSON file) these kernels serve, with which compile keys, and
                                 the LayoutError of the others (meta tensors: no GPU)
    precompile(arch=None)        build (or load from disk) every kernel variant up front;
    precompile(plan)             or exactly the variants of a plan
    set_strict(True)             any later compile raises StrictModeError
    cache_stats()                compile-cache counters
    reference                    pure-PyTorch references (the executable specs)
"""

from __future__ import annotations

from collections.abc import Iterable

from . import reference
from .arch import SUPPORTED_ARCHS, check_arch
from .compile_cache import (
    StrictModeError,
    cache_stats,
    families,
    reset_cache_stats,
    set_strict,
)
from .compress_c128 import check_compress_c128, compress_c128
from .deployment import PRESETS, Deployment, DeploymentError, Plan, build, default_arch, plan
from .kv_rope_insert import check_kv_rope_insert, kv_rope_insert
from .stacked_kv_proj import check_stacked_kv_proj, stacked_kv_proj
from .validation import LayoutError, describe, fail

__version__ = "0.1.0"


def precompile(
    arch: str | Plan | None = None, kernels: list[str] | None = None, *, strict: bool = False
) -> None:
    """Compile (or load from the disk cache) kernel variants up front; call once at start-up.

    ``precompile(plan)`` builds exactly the compile keys of a :func:`plan` (its supported cases)
    — bake them into an image's disk cache, and a serving process that calls it again loads
    them with no compile. ``precompile(arch)`` builds every variant of the kernel families for
    ``arch`` (default: ``CUTE_KERNELS_ARCH`` or the current CUDA device). ``kernels`` limits
    either to the named families; ``strict`` turns strict mode on afterwards (any later compile
    raises :class:`StrictModeError`). A progress bar shows on a terminal."""
    known = families()
    if kernels is not None:
        # a misspelt name would build nothing, and strict mode would then fail at run time
        names = [] if isinstance(kernels, str) or not isinstance(kernels, Iterable) else [
            *kernels]
        if not names or not all(isinstance(n, str) and n in known for n in names):
            fail("kernels", f"a list of kernel family names ({', '.join(known)}) or None",
                 describe(kernels))
        kernels = names
    if isinstance(arch, Plan):
        keys = [(op, key) for op, op_keys in arch.keys().items() for key in op_keys]
    else:
        target = default_arch() if arch is None else check_arch(arch)
        keys = [(name, key) for name, cache in known.items() for key in cache.variants(target)]
    build([(name, key) for name, key in keys if kernels is None or name in kernels])
    if strict:
        set_strict(True)


__all__ = [
    "PRESETS",
    "SUPPORTED_ARCHS",
    "Deployment",
    "DeploymentError",
    "LayoutError",
    "Plan",
    "StrictModeError",
    "cache_stats",
    "check_compress_c128",
    "check_kv_rope_insert",
    "check_stacked_kv_proj",
    "compress_c128",
    "kv_rope_insert",
    "plan",
    "precompile",
    "reference",
    "reset_cache_stats",
    "set_strict",
    "stacked_kv_proj",
]
