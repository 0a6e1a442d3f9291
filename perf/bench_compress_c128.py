"""C128 compressor benchmark: cute_kernels vs the PyTorch reference (eager, torch.compile)."""

from __future__ import annotations

from collections.abc import Callable

import torch

import cute_kernels
from cute_kernels import reference
from cute_kernels.testing import c128_mismatch, compress_c128_case

from .timing import Timer, baseline_error, host_us

KV_BLOCK_SIZE = 2
# (label, tokens, boundary_every): "all" = every token on a boundary, "mix" = one in 128
CASES = (("all", 1, None), ("all", 32, None), ("all", 128, None), ("all", 512, None),
         ("all", 4096, None), ("mix", 256, 128), ("mix", 512, 128), ("mix", 4096, 128),
         ("mix", 65536, 128),
         ("none", 512, 0))
STATE_BYTES_PER_WINDOW = 128 * 1024 * 4


def op_bytes(case) -> int:
    """Index reads of every token, 512 KiB of state + 16 page ids per boundary token, records."""
    tokens = case.positions.shape[0]
    windows = int(case.boundary.sum())
    return tokens * (4 + 8 + 8 + 8) + windows * (STATE_BYTES_PER_WINDOW + 16 * 4 + 256 + 584)


def _case(tokens: int, every: int | None):
    return compress_c128_case("v4_packed", tokens, KV_BLOCK_SIZE, "cuda", seed=tokens,
                              boundary_every=every, negative_slots=False, distinct_windows=True)


def host_calls(**_) -> dict[tuple, Callable[[], None]]:
    """The T = 1 call (one window), keyed like its row."""
    label, tokens, every = CASES[0]
    args = _case(tokens, every).args()
    return {("compress_c128", label, tokens): lambda: cute_kernels.compress_c128(*args)}


def run(timer: Timer, ceiling: float, baselines: bool = True, **_) -> list[dict]:
    rows = []
    compiled_ref = torch.compile(reference.compress_c128, dynamic=True)
    for label, tokens, every in CASES:
        case = _case(tokens, every)
        args = case.args()
        cute_kernels.compress_c128(*args)
        torch.cuda.synchronize()
        # the GPU tests' tolerance rules against the float64 reference, on every record
        mismatch = c128_mismatch(case, case.backing)

        def call(args=args):
            cute_kernels.compress_c128(*args)

        nbytes = op_bytes(case)
        cold = timer.cold_us(call)
        row = {
            "kernel": "compress_c128", "format": label, "windows": int(case.boundary.sum()),
            "tokens": tokens, "kv_block_size": KV_BLOCK_SIZE, "bytes": nbytes,
            "exact": "ok" if mismatch is None else mismatch, "cold_us": cold,
            "hot_us": timer.hot_us(call), "host_us": host_us(call),
            "pct_of_copy_cold": 100 * nbytes / (cold * 1e-6) / ceiling,
        }
        if baselines:
            ref_args = case.args(case.fresh_cache()[1])
            row["ref_eager_us"] = timer.eager_cold_us(
                lambda a=ref_args: reference.compress_c128(*a), reps=5)
            try:
                row["ref_compile_us"] = timer.eager_cold_us(lambda a=ref_args: compiled_ref(*a),
                                                            reps=5)
            except Exception as exc:  # Inductor cannot build every float64 reference kernel
                row["ref_compile_error"] = baseline_error(exc)
        rows.append(row)
        case_name = f"{label} ({row['windows']} windows)"
        print(f"  {case_name:<22} T={tokens:<6} cold {cold:8.1f} us  hot {row['hot_us']:8.2f}"
              f" us  {row['pct_of_copy_cold']:5.1f}% copy  check {row['exact']}", flush=True)
        del case
    return rows
