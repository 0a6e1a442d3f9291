"""DSpark stacked context-KV projection: one GEMM for every layer's K and V, with a fused
per-head RMSNorm + NeoX RoPE epilogue that scatters rows straight into per-layer KV caches.

``ctx_hidden [T, H] @ weight[L*2*kv, H]^T (+ bias)``; for stacked column ``n`` of layer ``l``:
``y = bf16(acc + b)`` (R1); K heads ``bf16((y * rsqrt(sum y^2 / D + eps)) * w_l)`` (R2) then NeoX
RoPE in fp32 and bf16 (R3); V heads ``y``. Row ``t`` lands in slot ``cache_loc[t]`` (or
``cache_loc_2d.flatten()[t]``) of ``k_caches[l]`` / ``v_caches[l]``. Contract:
specs/stacked_kv_proj.md.

A CTA tile is ``BM`` tokens x ``BN`` stacked columns with ``D | BN | kv``, so it lies in one
layer's K or V block and owns whole heads. The modules:

- :mod:`.plan` — core, tile and grid for a validated layout and a token count (no DSL);
- :mod:`.base` — configuration, tile raster, row destinations and the epilogue arithmetic;
- :mod:`.staged` — the SMEM-staged norm/RoPE/scatter epilogue of the two cores below it;
- :mod:`.mma` — the portable ``cp.async`` + ``mma.sync`` core (every arch);
- :mod:`.wgmma` — the sm_90a persistent, warp-specialised TMA + ``wgmma`` core;
- :mod:`.wgmma_swap` — its swapped form (weight tile as the wgmma's M, tokens as its N);
- :mod:`.wgmma_swap_persistent` — the swapped form persistent, an epilogue warpgroup
  finishing one tile while the consumers multiply the next;
- :mod:`.interface` — validation, compile key, build, launch and the public op.
"""

from .interface import StackedKvProjKey, check_stacked_kv_proj, stacked_kv_proj
from .plan import StackedLayout, StackedPlan, StackedVariant

__all__ = ["StackedKvProjKey", "StackedLayout", "StackedPlan", "StackedVariant",
           "check_stacked_kv_proj", "stacked_kv_proj"]
