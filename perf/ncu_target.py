"""A few calls of one kernel at one size, for Nsight Compute:

    ncu --clock-control none -k regex:kernel --launch-skip 2 --launch-count 1 \\
        python3 -m perf.ncu_target kv_rope_insert v4_packed 262144
        python3 -m perf.ncu_target stacked_kv_proj drafter 64
"""

from __future__ import annotations

import sys

import torch

import cute_kernels


def main() -> None:
    kernel, fmt, tokens = sys.argv[1], sys.argv[2], int(sys.argv[3])
    if kernel == "kv_rope_insert":
        from cute_kernels.testing import kv_rope_insert_case

        case = kv_rope_insert_case(fmt, tokens, 64, "cuda", extra_rows=0, positions_base=1000,
                         skip_every=0)
        for _ in range(4):
            cute_kernels.kv_rope_insert(*case.args())
    elif kernel == "stacked_kv_proj":  # fmt is ignored: the benchmark's drafter layout
        from cute_kernels.testing import stacked_kv_proj_case

        from .bench_stacked_kv_proj import HEAD_DIM, HIDDEN, LAYERS, N_KV

        case = stacked_kv_proj_case(tokens, HIDDEN, LAYERS, N_KV, HEAD_DIM, "cuda", skip_every=0,
                         max_pos=max(4096, tokens + 1))
        for _ in range(4):
            cute_kernels.stacked_kv_proj(*case.args())
    else:
        raise SystemExit(f"unknown kernel {kernel}")
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
