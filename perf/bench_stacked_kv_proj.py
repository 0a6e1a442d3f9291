"""Stacked KV projection benchmark: cute_kernels vs the per-layer PyTorch path (what SGLang runs
without the stacked path), one stacked cuBLAS GEMM + PyTorch norm/RoPE/scatter, and the bare
cuBLAS GEMM (the floor of any unfused design)."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from cute_kernels import reference, stacked_kv_proj
from cute_kernels.testing import compare_stacked, stacked_kv_proj_case

from .timing import Timer

TOKENS = (1, 16, 64, 256, 1024, 8192)
HIDDEN, LAYERS, N_KV, HEAD_DIM = 4096, 5, 8, 128


def op_bytes(tokens: int) -> int:
    """Weight + hidden rows + positions/slots + one cos/sin row per token + norm weights read;
    K and V rows of every layer written."""
    kv = N_KV * HEAD_DIM
    n = LAYERS * 2 * kv
    return (n * HIDDEN * 2 + tokens * HIDDEN * 2 + tokens * (8 + 8 + HEAD_DIM * 4)
            + LAYERS * HEAD_DIM * 4 + tokens * n * 2)


def _norm_rope(k: torch.Tensor, w: torch.Tensor, eps: float, cos: torch.Tensor,
               sin: torch.Tensor) -> torch.Tensor:
    return reference.k_norm_rope(k, w, eps, cos, sin)


def per_layer_torch(case) -> None:
    """SGLang's per-layer path: bf16 F.linear per layer (cuBLAS), k-norm, RoPE, scatter."""
    kv = N_KV * HEAD_DIM
    half = HEAD_DIM // 2
    table = case.cos_sin_cache[case.positions]
    cos, sin = table[:, None, :half], table[:, None, half:]
    for layer in range(LAYERS):
        lo = layer * 2 * kv
        b = None if case.bias is None else case.bias[lo:lo + 2 * kv]
        y = F.linear(case.ctx_hidden, case.weight[lo:lo + 2 * kv], b)
        k = _norm_rope(y[:, :kv].reshape(-1, N_KV, HEAD_DIM), case.k_norm_weight[layer],
                       case.eps, cos, sin)
        case.k_caches[layer][case.cache_loc] = k
        case.v_caches[layer][case.cache_loc] = y[:, kv:].reshape(-1, N_KV, HEAD_DIM)


def stacked_torch(case) -> None:
    """One stacked F.linear, then norm/RoPE over all layers at once, then the scatters."""
    half = HEAD_DIM // 2
    t = case.ctx_hidden.shape[0]
    y = F.linear(case.ctx_hidden, case.weight, case.bias).view(t, LAYERS, 2, N_KV, HEAD_DIM)
    table = case.cos_sin_cache[case.positions]
    cos, sin = table[:, None, None, :half], table[:, None, None, half:]
    k = _norm_rope(y[:, :, 0], case.k_norm_weight[None, :, None, :], case.eps, cos, sin)
    for layer in range(LAYERS):
        case.k_caches[layer][case.cache_loc] = k[:, layer]
        case.v_caches[layer][case.cache_loc] = y[:, layer, 1]


def run(timer: Timer, ceiling: float, tokens=TOKENS, baselines: bool = True, **_) -> list[dict]:
    rows = []
    fmt = f"L{LAYERS}_nkv{N_KV}_D{HEAD_DIM}"
    for t in tokens:
        case = stacked_kv_proj_case(t, HIDDEN, LAYERS, N_KV, HEAD_DIM, "cuda", skip_every=0, seed=t,
                         max_pos=max(4096, t + 1))
        args = case.args()
        # correctness of the timed call, once (reference: fp32 GEMM, explicit roundings)
        _, _, ref_k, ref_v = case.twin()
        reference.stacked_kv_proj(*case.args(ref_k, ref_v))
        stacked_kv_proj(*args)
        torch.cuda.synchronize()
        result = compare_stacked(case, ref_k, ref_v, assert_close=False)
        exact = result.exact_enough
        del ref_k, ref_v

        def call(args=args):
            stacked_kv_proj(*args)

        nbytes = op_bytes(t)
        flops = 2 * t * LAYERS * 2 * N_KV * HEAD_DIM * HIDDEN
        cold = timer.cold_us(call)
        row = {
            "kernel": "stacked_kv_proj", "format": fmt, "tokens": t, "bytes": nbytes,
            "exact": exact, "within_1ulp": result.within_one_ulp, "max_ulp": result.max_ulp,
            "cold_us": cold, "hot_us": timer.hot_us(call), "host_us": timer.host_us(call),
            "pct_of_copy_cold": 100 * nbytes / (cold * 1e-6) / ceiling,
            "tflops": flops / (cold * 1e-6) / 1e12,
        }
        if baselines:
            # Both PyTorch paths are graph-capturable (no host sync): cold, like the kernel.
            row["per_layer_us"] = timer.cold_us(lambda c=case: per_layer_torch(c))
            row["stacked_cublas_us"] = timer.cold_us(lambda c=case: stacked_torch(c))
            row["cublas_only_us"] = timer.cold_us(
                lambda c=case: F.linear(c.ctx_hidden, c.weight, c.bias))
        rows.append(row)
        extra = ""
        if baselines:
            extra = (f"  per-layer {row['per_layer_us']:8.1f}"
                     f"  stacked {row['stacked_cublas_us']:8.1f}"
                     f"  cuBLAS {row['cublas_only_us']:8.1f} us")
        print(f"  {fmt} T={t:<6} cold {cold:8.1f} us  hot {row['hot_us']:8.2f} us  "
              f"{row['pct_of_copy_cold']:5.1f}% copy  {row['tflops']:6.1f} TFLOP/s  "
              f"exact={exact} ({100 * result.within_one_ulp:.3f}% <=1ulp){extra}", flush=True)
        del case, args
    return rows


def main() -> None:
    """``python -m perf.bench_stacked_kv_proj [--tokens 1,64] [--no-baselines]``"""
    import argparse
    import json

    from .timing import copy_ceiling_bytes_per_s, environment

    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", default=None)
    parser.add_argument("--no-baselines", action="store_true")
    parser.add_argument("--json", default=None, help="write the rows here")
    cli = parser.parse_args()
    env = environment()
    ceiling = copy_ceiling_bytes_per_s()
    print(f"{env['gpu']} {env['date']}: copy ceiling {ceiling / 1e12:.3f} TB/s", flush=True)
    sizes = TOKENS if cli.tokens is None else tuple(int(t) for t in cli.tokens.split(","))
    rows = run(Timer(), ceiling, tokens=sizes, baselines=not cli.no_baselines)
    if cli.json:
        Path(cli.json).write_text(json.dumps({"env": env, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
