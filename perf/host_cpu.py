"""The Python host time of an eager call, without a GPU: each op's path up to the TVM-FFI call
(the compiled function, the CUDA queries and the stream lookup stubbed out) and its ``check_*``
of a known layout, at T = 1 on CPU tensors (the shapes of ``perf/host_profile.py``), and on
meta tensors of the same layouts (a model loader's check).

    python3 -m perf.host_cpu [--calls 20000] [--repeats 7] [--profile]

The numbers are the best of ``--repeats`` runs of ``--calls`` calls: a development-CPU figure
for comparing changes to the host path, not a GPU-host time (``perf/host_profile.py`` measures
that on the GPU machine, the TVM-FFI call included).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time
from collections.abc import Callable

import torch

import cute_kernels
from cute_kernels.testing import (
    compress_c128_case,
    cpu_launches,
    kv_rope_insert_case,
    stacked_kv_proj_case,
)


def cases() -> dict[str, tuple]:
    return {
        "kv_rope_insert": kv_rope_insert_case("v4_packed", 1, 64, "cpu", skip_every=0).args(),
        "compress_c128": compress_c128_case("v4_packed", 1, 2, "cpu").args(),
        "stacked_kv_proj": stacked_kv_proj_case(1, 4096, 5, 8, 128, "cpu",
                                                skip_every=0).args(),
    }


def on_meta(value: object) -> object:
    """``value`` with every tensor replaced by a meta tensor of the same layout (what a model
    loader checks, before any memory exists)."""
    if isinstance(value, torch.Tensor):
        return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype,
                                   device="meta")
    if isinstance(value, (list, tuple)):
        return type(value)(map(on_meta, value))
    return value


def per_call_us(fn: Callable[[], object], calls: int, repeats: int) -> float:
    for _ in range(min(calls, 1000)):
        fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls)
    return best * 1e6


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--profile", action="store_true", help="cProfile each op's calls")
    cli = parser.parse_args()
    with cpu_launches(record=False):
        for name, args in cases().items():
            op = getattr(cute_kernels, name)
            call = per_call_us(lambda a=args, op=op: op(*a), cli.calls, cli.repeats)
            check = per_call_us(lambda a=args, op=op: op.check(*a), cli.calls, cli.repeats)
            meta = on_meta(args)
            check_meta = per_call_us(lambda a=meta, op=op: op.check(*a), cli.calls, cli.repeats)
            print(f"{name}: {call:.2f} us per call up to the FFI call, "
                  f"{check:.2f} us per check of a known layout ({check_meta:.2f} on meta "
                  "tensors)", flush=True)
            if cli.profile:
                profile = cProfile.Profile()
                profile.enable()
                for _ in range(cli.calls):
                    op(*args)
                profile.disable()
                pstats.Stats(profile).sort_stats("tottime").print_stats(12)


if __name__ == "__main__":
    main()
