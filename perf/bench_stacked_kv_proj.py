"""Stacked KV projection benchmark, in the layouts deployments run (TP ranks, a one-layer
drafter): cute_kernels against the bare cuBLAS GEMM of the same weight (the number to beat: a
fused op must not cost more than the GEMM it replaces), the physical floor (an empty kernel's
cold time + the weight at 4.2 TB/s), and on the TP-1 layout the per-layer PyTorch path (what
SGLang runs without the stacked path) and one stacked cuBLAS GEMM + PyTorch norm/RoPE/scatter
(the two-step path)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from cute_kernels import reference, stacked_kv_proj
from cute_kernels.stacked_kv_proj.interface import plan_for_call
from cute_kernels.testing import compare_stacked, stacked_kv_proj_case

from .timing import Timer, host_us

FLOOR_BYTES_PER_S = 4.2e12  # the weight-stream rate the targets assume


@dataclasses.dataclass(frozen=True)
class Layout:
    name: str
    hidden: int
    layers: int
    n_kv: int
    head_dim: int

    @property
    def kv(self) -> int:
        return self.n_kv * self.head_dim

    @property
    def weight_bytes(self) -> int:
        return self.layers * 2 * self.kv * self.hidden * 2

    @property
    def label(self) -> str:
        return f"{self.name} H{self.hidden} L{self.layers} nkv{self.n_kv} D{self.head_dim}"


# The Qwen3-8B DSpark/DFlash drafter (H 4096, 5 layers, 8 KV heads of 128) at TP 1..8 (a rank
# holds max(1, 8 / TP) heads), and a one-layer drafter.
LAYOUTS = (
    Layout("tp1", 4096, 5, 8, 128),
    Layout("tp2", 4096, 5, 4, 128),
    Layout("tp4", 4096, 5, 2, 128),
    Layout("tp8", 4096, 5, 1, 128),
    Layout("1layer", 4096, 1, 8, 128),
)
TOKENS = (1, 16, 32, 64, 256, 1024, 8192)
TOKENS_TP = (1, 16, 32, 64, 256, 1024)  # the other layouts: decode sizes and one large T


def op_bytes(layout: Layout, tokens: int) -> int:
    """Weight + hidden rows + positions/slots + one cos/sin row per token + norm weights read;
    K and V rows of every layer written."""
    n = layout.layers * 2 * layout.kv
    return (layout.weight_bytes + tokens * layout.hidden * 2
            + tokens * (8 + 8 + layout.head_dim * 4) + layout.layers * layout.head_dim * 4
            + tokens * n * 2)


def per_layer_torch(case, layout: Layout) -> None:
    """SGLang's per-layer path: bf16 F.linear per layer (cuBLAS), k-norm, RoPE, scatter."""
    kv, d = layout.kv, layout.head_dim
    table = case.cos_sin_cache[case.positions]
    cos, sin = table[:, None, : d // 2], table[:, None, d // 2:]
    for layer in range(layout.layers):
        lo = layer * 2 * kv
        b = None if case.bias is None else case.bias[lo:lo + 2 * kv]
        y = F.linear(case.ctx_hidden, case.weight[lo:lo + 2 * kv], b)
        k = reference.k_norm_rope(y[:, :kv].reshape(-1, layout.n_kv, d),
                                  case.k_norm_weight[layer], case.eps, cos, sin)
        case.k_caches[layer][case.cache_loc] = k
        case.v_caches[layer][case.cache_loc] = y[:, kv:].reshape(-1, layout.n_kv, d)


def stacked_torch(case, layout: Layout) -> None:
    """One stacked F.linear, then norm/RoPE over all layers at once, then the scatters."""
    d, t = layout.head_dim, case.ctx_hidden.shape[0]
    y = F.linear(case.ctx_hidden, case.weight, case.bias).view(t, layout.layers, 2,
                                                               layout.n_kv, d)
    table = case.cos_sin_cache[case.positions]
    cos, sin = table[:, None, None, : d // 2], table[:, None, None, d // 2:]
    k = reference.k_norm_rope(y[:, :, 0], case.k_norm_weight[None, :, None, :], case.eps, cos,
                              sin)
    for layer in range(layout.layers):
        case.k_caches[layer][case.cache_loc] = k[:, layer]
        case.v_caches[layer][case.cache_loc] = y[:, layer, 1]


def plan_label(plan) -> str:
    """How a report names a plan: the tile, then stream-K, split K (and its hand-over) or
    data-parallel."""
    if plan.stream_k:
        return f"{plan.variant.tile} streamk {plan.grid} CTAs, {plan.dp_tiles} DP tiles"
    if plan.splits > 1:
        handover = "cluster" if plan.variant.cluster else "workspace"
        return f"{plan.variant.tile} split {plan.splits} {handover}, {plan.grid} CTAs"
    return f"{plan.variant.tile} dp {plan.grid} CTAs"


def target_us(tokens: int, cublas_us: float, floor_us: float) -> float:
    """The issue's targets: at decode sizes (T <= 256) at most max(0.9 x the bare GEMM, 1.1 x
    the floor); at larger T no slower than the bare GEMM."""
    return max(0.9 * cublas_us, 1.1 * floor_us) if tokens <= 256 else cublas_us


def host_calls(layouts=LAYOUTS, **_) -> dict[tuple, Callable[[], None]]:
    """The T = 1 call of every layout, keyed like its row."""
    calls = {}
    for layout in layouts:
        args = _case(layout, 1).args()
        calls[("stacked_kv_proj", layout.label, 1)] = lambda a=args: stacked_kv_proj(*a)
    return calls


def _case(layout: Layout, tokens: int):
    return stacked_kv_proj_case(tokens, layout.hidden, layout.layers, layout.n_kv,
                                layout.head_dim, "cuda", skip_every=0, seed=tokens,
                                max_pos=max(4096, tokens + 1))


def run(timer: Timer, ceiling: float, tokens=None, baselines: bool = True,
        layouts=LAYOUTS, **_) -> list[dict]:
    rows = []
    empty_us = timer.cold_us(lambda: torch.cuda._sleep(0))
    print(f"  empty kernel, cold: {empty_us:.1f} us", flush=True)
    for layout in layouts:
        sizes = tokens or (TOKENS if layout.name == "tp1" else TOKENS_TP)
        for t in sizes:
            rows.append(_row(timer, ceiling, layout, t, empty_us, baselines))
    return rows


def _row(timer: Timer, ceiling: float, layout: Layout, t: int, empty_us: float,
         baselines: bool) -> dict:
    case = _case(layout, t)
    args = case.args()
    # correctness of the timed call, once (reference: fp32 GEMM, explicit roundings)
    _, _, ref_k, ref_v = case.twin()
    reference.stacked_kv_proj(*case.args(ref_k, ref_v))
    stacked_kv_proj(*args)
    torch.cuda.synchronize()
    result = compare_stacked(case, ref_k, ref_v, assert_close=False)
    del ref_k, ref_v
    plan = plan_for_call(args)

    def call(args=args):
        stacked_kv_proj(*args)

    nbytes = op_bytes(layout, t)
    flops = 2 * t * layout.layers * 2 * layout.kv * layout.hidden
    cold = timer.cold_us(call)
    cublas = timer.cold_us(lambda c=case: F.linear(c.ctx_hidden, c.weight, c.bias))
    floor = empty_us + layout.weight_bytes / FLOOR_BYTES_PER_S * 1e6
    row = {
        "kernel": "stacked_kv_proj", "format": layout.label, "tokens": t, "bytes": nbytes,
        "exact": result.exact_enough, "within_1ulp": result.within_one_ulp,
        "max_ulp": result.max_ulp, "plan": plan_label(plan),
        "cold_us": cold, "hot_us": timer.hot_us(call), "host_us": host_us(call),
        "pct_of_copy_cold": 100 * nbytes / (cold * 1e-6) / ceiling,
        "tflops": flops / (cold * 1e-6) / 1e12,
        "weight_tbps": layout.weight_bytes / (cold * 1e-6) / 1e12,
        "cublas_only_us": cublas, "vs_cublas": cold / cublas, "floor_us": floor,
        "target_us": target_us(t, cublas, floor),
    }
    if baselines and layout.name == "tp1":
        # Both PyTorch paths are graph-capturable (no host sync): cold, like the kernel.
        row["per_layer_us"] = timer.cold_us(lambda c=case: per_layer_torch(c, layout))
        row["stacked_cublas_us"] = timer.cold_us(lambda c=case: stacked_torch(c, layout))
    met = "met" if cold <= row["target_us"] else "MISSED"
    print(f"  {layout.label} T={t:<6} cold {cold:7.1f} us  cuBLAS {cublas:7.1f}  "
          f"ratio {row['vs_cublas']:.2f}  floor {floor:5.1f}  target {row['target_us']:6.1f} "
          f"{met}  {row['weight_tbps']:.2f} TB/s  {row['tflops']:5.0f} TFLOP/s  [{row['plan']}]"
          f"  {100 * result.within_one_ulp:.3f}% <=1ulp", flush=True)
    return row


def main() -> None:
    """``python -m perf.bench_stacked_kv_proj [--tokens 1,64] [--layouts tp1,tp8]
    [--no-baselines] [--json OUT]``"""
    import argparse
    import json

    from .timing import copy_ceiling_bytes_per_s, environment

    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", default=None)
    parser.add_argument("--layouts", default=None, help="names from LAYOUTS")
    parser.add_argument("--no-baselines", action="store_true")
    parser.add_argument("--json", default=None, help="write the rows here")
    cli = parser.parse_args()
    env = environment()
    ceiling = copy_ceiling_bytes_per_s()
    print(f"{env['gpu']} {env['date']}: copy ceiling {ceiling / 1e12:.3f} TB/s", flush=True)
    sizes = None if cli.tokens is None else tuple(int(t) for t in cli.tokens.split(","))
    chosen = LAYOUTS if cli.layouts is None else tuple(
        lay for lay in LAYOUTS if lay.name in cli.layouts.split(","))
    rows = run(Timer(), ceiling, tokens=sizes, baselines=not cli.no_baselines, layouts=chosen)
    if cli.json:
        Path(cli.json).write_text(json.dumps({"env": env, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
