"""KV-insert benchmark: cute_kernels vs the PyTorch reference (eager and torch.compile)."""

from __future__ import annotations

from collections.abc import Callable

import torch

import cute_kernels
from cute_kernels import reference
from cute_kernels.layouts import HEAD_DIM, ROPE_DIM, CacheFormat
from cute_kernels.testing import kv_rope_insert_case

from .timing import Timer, host_us

TOKENS = (1, 16, 512, 2048, 16384, 65536, 262144)
BLOCK_SIZE = 64
POSITIONS_BASE = 1000


DECODE_TOKENS = (1, 16, 64, 256)  # a decode step: one new slot per request, each in its page


def op_bytes(fmt: CacheFormat, tokens: int) -> int:
    """kv row + position + slot + cos/sin row read, record (+ scales) written, per token."""
    return tokens * (HEAD_DIM * 2 + 8 + 8 + ROPE_DIM * 4 + fmt.row_bytes)


def _case(fmt: CacheFormat, tokens: int, pattern: str):
    return kv_rope_insert_case(fmt, tokens, BLOCK_SIZE, "cuda", extra_rows=0,
                               positions_base=POSITIONS_BASE, seed=tokens, skip_every=0,
                               slot_pattern=pattern)


def _label(fmt: CacheFormat, pattern: str, slot_pattern: str) -> str:
    return fmt.value if pattern == slot_pattern else f"{fmt.value} {pattern}"


def host_calls(slot_pattern: str = "paged") -> dict[tuple, Callable[[], None]]:
    """The T = 1 call of every format and slot pattern, keyed like its row."""
    calls = {}
    for fmt in CacheFormat:
        for pattern in (slot_pattern, "decode"):
            args = _case(fmt, 1, pattern).args()
            calls[("kv_rope_insert", _label(fmt, pattern, slot_pattern), 1)] = (
                lambda a=args: cute_kernels.kv_rope_insert(*a))
    return calls


def run(timer: Timer, ceiling: float, tokens=TOKENS, baselines: bool = True,
        slot_pattern: str = "paged") -> list[dict]:
    """Every format at ``tokens`` prefill-shaped slots (``slot_pattern``), and at the decode
    sizes with decode-shaped slots (random single slots across as many pages)."""
    rows = []
    compiled_ref = torch.compile(reference.kv_rope_insert, dynamic=True)
    runs = [(slot_pattern, t) for t in tokens] + [("decode", t) for t in DECODE_TOKENS]
    for fmt in CacheFormat:
        for pattern, t in runs:
            case = _case(fmt, t, pattern)
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
            label = _label(fmt, pattern, slot_pattern)
            row = {
                "kernel": "kv_rope_insert", "format": label, "tokens": t,
                "block_size": BLOCK_SIZE, "slots": pattern, "bytes": nbytes, "exact": exact,
                "cold_us": cold, "hot_us": timer.hot_us(call), "host_us": host_us(call),
                "pct_of_copy_cold": 100 * nbytes / (cold * 1e-6) / ceiling,
            }
            if baselines:
                ref_args = case.args(ref_cache)
                row["ref_eager_us"] = timer.eager_cold_us(
                    lambda a=ref_args: reference.kv_rope_insert(*a))
                row["ref_compile_us"] = timer.eager_cold_us(lambda a=ref_args: compiled_ref(*a))
            rows.append(row)
            print(f"  {label:<16} T={t:<7} cold {cold:8.1f} us  hot {row['hot_us']:8.2f} us  "
                  f"{row['pct_of_copy_cold']:5.1f}% copy  exact={exact}", flush=True)
            del case, ref_backing, ref_cache
    return rows
