"""vLLM: the DSpark context-KV insert (vLLM's DeepSeek V4.1 DSpark ``_insert_context_kv``).

Swapping it in is one line, in the drafter module (``dspark.py``) or where it is imported::

    from cute_kernels.integrations.vllm import insert_context_kv as _insert_context_kv
"""

from __future__ import annotations

import torch

from ..kv_rope_insert import kv_rope_insert
from . import require_attr

#: Where vLLM's DSpark attention layer keeps the per-tensor fp8 KV scale (a one-element fp32
#: device tensor); it is read only when the cache is float8_e4m3fn, as vLLM does.
FP8_SCALE_ATTR = "_flashinfer_fp8_kv_scale"


def insert_context_kv(
    attn: torch.nn.Module,
    kv: torch.Tensor,
    positions: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """RoPE + quantise + insert the context KV rows ``kv[:N]`` into ``attn``'s SWA cache.

    The contract of vLLM's DSpark ``_insert_context_kv(attn, kv, positions, slot_mapping)``:
    one call per draft layer, ``kv`` bf16 ``[T, 512]`` (already kv-normed), ``positions``
    int64 ``[T]``, ``slot_mapping`` int64 ``[N <= T]`` (negative = skip). It reads

    - ``attn.swa_cache_layer.kv_cache`` (the paged cache; its dtype and width pick the format)
      and ``attn.swa_cache_layer.block_size``,
    - ``attn.rotary_emb.cos_sin_cache`` (fp32 ``[max_pos, 64]``),
    - ``attn.kv_mxfp8`` (V4.1 record for a uint8 cache),
    - ``attn._flashinfer_fp8_kv_scale``, only when the cache is float8_e4m3fn (None otherwise),

    and calls :func:`cute_kernels.kv_rope_insert` with them, in vLLM's op order. A missing
    attribute raises :class:`~cute_kernels.LayoutError` naming it; every layout rule, CPU
    tensors included, is the kernel's (specs/kv_rope_insert.md). CUDA-graph safe like the op:
    attribute reads only, no host sync, no allocation.
    """
    cache_layer = require_attr(attn, "swa_cache_layer", "attn")
    k_cache = require_attr(cache_layer, "kv_cache", "attn.swa_cache_layer")
    block_size = require_attr(cache_layer, "block_size", "attn.swa_cache_layer")
    rotary = require_attr(attn, "rotary_emb", "attn")
    cos_sin_cache = require_attr(rotary, "cos_sin_cache", "attn.rotary_emb")
    kv_mxfp8 = require_attr(attn, "kv_mxfp8", "attn")
    fp8_scale = None
    if isinstance(k_cache, torch.Tensor) and k_cache.dtype == torch.float8_e4m3fn:
        # vLLM's layers carry the attribute only where an fp8 cache needs it
        fp8_scale = require_attr(attn, FP8_SCALE_ATTR, "attn")
    kv_rope_insert(kv, k_cache, slot_mapping, positions, cos_sin_cache, block_size, fp8_scale,
                   kv_mxfp8)


__all__ = ["FP8_SCALE_ATTR", "insert_context_kv"]
