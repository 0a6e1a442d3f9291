"""KV-insert benchmark: cute_kernels vs the PyTorch reference (eager and torch.compile)."""

from __future__ import annotations

import torch

import cute_kernels
from cute_kernels import reference
from cute_kernels.layouts import CacheFormat
from cute_kernels.testing import kv_rope_insert_case

from .timing import Timer

TOKENS = (1, 16, 512, 2048, 16384, 65536, 262144)
BLOCK_SIZE = 64
POSITIONS_BASE = 1000


def op_bytes(fmt: str, tokens: int) -> int:
    """kv row + position + slot + cos/sin row read, record (+ scales) written, per token."""
    record = {"v4_packed": 584, "v41_mxfp8": 528, "bf16": 1024, "fp8": 512}[fmt]
    return tokens * (512 * 2 + 8 + 8 + 64 * 4 + record)


def run(timer: Timer, ceiling: float, tokens=TOKENS, baselines: bool = True,
        slot_pattern: str = "paged") -> list[dict]:
    rows = []
    compiled_ref = torch.compile(reference.kv_rope_insert, dynamic=True)
    for fmt in (f.value for f in CacheFormat):
        for t in tokens:
            case = kv_rope_insert_case(fmt, t, BLOCK_SIZE, "cuda", extra_rows=0,
                             positions_base=POSITIONS_BASE, seed=t, skip_every=0,
                             slot_pattern=slot_pattern)
            args = case.args()
            # correctness of the timed call, once
            ref_backing, ref_cache = case.twin()
            reference.kv_rope_insert(*case.args(ref_cache))
            cute_kernels.kv_rope_insert(*args)
            torch.cuda.synchronize()
            exact = torch.equal(case.backing.view(torch.uint8), ref_backing.view(torch.uint8))

            def call(args=args):
                cute_kernels.kv_rope_insert(*args)

            nbytes = op_bytes(fmt, t)
            cold = timer.cold_us(call)
            row = {
                "kernel": "kv_rope_insert", "format": fmt, "tokens": t,
                "block_size": BLOCK_SIZE, "slots": slot_pattern, "bytes": nbytes, "exact": exact,
                "cold_us": cold, "hot_us": timer.hot_us(call), "host_us": timer.host_us(call),
                "pct_of_copy_cold": 100 * nbytes / (cold * 1e-6) / ceiling,
            }
            if baselines:
                ref_args = case.args(ref_cache)
                row["ref_eager_us"] = timer.eager_cold_us(
                    lambda a=ref_args: reference.kv_rope_insert(*a))
                row["ref_compile_us"] = timer.eager_cold_us(lambda a=ref_args: compiled_ref(*a))
            rows.append(row)
            print(f"  {fmt:<10} T={t:<7} cold {cold:8.1f} us  hot {row['hot_us']:8.2f} us  "
                  f"{row['pct_of_copy_cold']:5.1f}% copy  exact={exact}", flush=True)
            del case, ref_backing, ref_cache
    return rows
