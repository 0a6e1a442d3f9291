"""How much of a cold time is the L2 flush's own write-back (GPU only).

``make perf``'s cold replay follows a 512 MB ``fill_`` (perf/timing.py), which leaves the whole
L2 holding dirty lines of the flush buffer. The timed kernel's first tens of MB of new lines
evict them, and each eviction is a DRAM write inside the timed window that the kernel did not
ask for. This probe times the same graphs after that flush and after a *clean* one (the same
fill, then a read of the whole buffer: the L2 then holds clean lines, which are dropped for
free), for each kernel at the sizes where its targets are missed, and for a bare ``copy_`` and
the bare cuBLAS GEMM next to them.

    python -m perf.l2_flush_probe [--replays 50]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
import torch.nn.functional as F

import cute_kernels
from cute_kernels.layouts import CacheFormat

from . import bench_compress_c128, bench_kv_rope_insert, bench_stacked_kv_proj
from .timing import Timer


class CleanFlushTimer(Timer):
    """:class:`Timer` whose flush leaves the L2 full of clean lines."""

    def flush_l2(self) -> None:
        super().flush_l2()
        self._flush.max()  # reads every line back: the dirty ones are written out here


def cases() -> list[tuple[str, Callable[[], None]]]:
    calls = []
    for fmt in (CacheFormat.V4_PACKED, CacheFormat.BF16):
        for tokens in (2048, 16384, 65536, 262144):
            case = bench_kv_rope_insert._case(fmt, tokens, "paged")
            args = case.args()
            calls.append((f"kv_rope_insert {fmt.value} T={tokens}",
                          lambda a=args: cute_kernels.kv_rope_insert(*a)))
            nbytes = bench_kv_rope_insert.op_bytes(fmt, tokens) // 2
            src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
            dst = torch.empty_like(src)
            calls.append((f"copy_ of the same bytes ({nbytes * 2 / 1e6:.0f} MB r+w)",
                          lambda s=src, d=dst: d.copy_(s)))
    for label, tokens, every in bench_compress_c128.CASES:
        if label == "all" and tokens in (1, 128, 512):
            args = bench_compress_c128._case(tokens, every).args()
            calls.append((f"compress_c128 all-{tokens}",
                          lambda a=args: cute_kernels.compress_c128(*a)))
    for layout in bench_stacked_kv_proj.LAYOUTS:
        if layout.name in ("tp1", "tp8"):
            for tokens in (1, 64):
                case = bench_stacked_kv_proj._case(layout, tokens)
                args = case.args()
                calls.append((f"stacked_kv_proj {layout.name} T={tokens}",
                              lambda a=args: cute_kernels.stacked_kv_proj(*a)))
                calls.append((f"cuBLAS F.linear {layout.name} T={tokens}",
                              lambda c=case: F.linear(c.ctx_hidden, c.weight)))
    return calls


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--replays", type=int, default=50)
    cli = parser.parse_args()
    dirty, clean = Timer(cli.replays), CleanFlushTimer(cli.replays)
    empty = [t.cold_us(lambda: torch.cuda._sleep(0)) for t in (dirty, clean)]
    print(f"{'case':<44} {'write flush':>12} {'clean flush':>12} {'difference':>11}")
    print(f"{'empty kernel':<44} {empty[0]:12.2f} {empty[1]:12.2f} {empty[0] - empty[1]:11.2f}")
    for name, fn in cases():
        us = [t.cold_us(fn) for t in (dirty, clean)]
        print(f"{name:<44} {us[0]:12.2f} {us[1]:12.2f} {us[0] - us[1]:11.2f}", flush=True)


if __name__ == "__main__":
    main()
