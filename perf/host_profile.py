"""Where an eager call's host time goes, at T = 1 (GPU): the wall time per call of each op, of
its layout check alone, and a cProfile of the op's Python by own time.

    python3 -m perf.host_profile [--calls 2000] [--top 12]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats

import torch

import cute_kernels
from cute_kernels.testing import compress_c128_case, kv_rope_insert_case, stacked_kv_proj_case

from .timing import host_us

#: calls per timed burst from an idle GPU (far below the driver's launch queue depth)
BURST = 200


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--top", type=int, default=12)
    cli = parser.parse_args()
    cases = {
        "kv_rope_insert": kv_rope_insert_case("v4_packed", 1, 64, "cuda", skip_every=0).args(),
        "compress_c128": compress_c128_case("v4_packed", 1, 2, "cuda").args(),
        "stacked_kv_proj": stacked_kv_proj_case(1, 4096, 5, 8, 128, "cuda",
                                                skip_every=0).args(),
    }
    for name, args in cases.items():
        op = getattr(cute_kernels, name)
        call_us = host_us(lambda a=args, op=op: op(*a), BURST, max(1, cli.calls // BURST))
        check_us = host_us(lambda a=args, op=op: op.check(*a), BURST, max(1, cli.calls // BURST))
        print(f"{name}: {call_us:.1f} us per call, {check_us:.1f} us per check", flush=True)
        profile = cProfile.Profile()
        for _ in range(max(1, cli.calls // BURST)):
            torch.cuda.synchronize()
            profile.enable()
            for _ in range(BURST):
                op(*args)
            profile.disable()
        torch.cuda.synchronize()
        pstats.Stats(profile).sort_stats("tottime").print_stats(cli.top)


if __name__ == "__main__":
    main()
