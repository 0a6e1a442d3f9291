"""A few calls of one kernel at one size, for Nsight Compute:

    ncu --clock-control none -k regex:kernel_cutlass --launch-skip 2 --launch-count 1 \\
        python3 -m perf.ncu_target kv_rope_insert v4_packed 262144
        python3 -m perf.ncu_target stacked_kv_proj tp8 64     # a layout of perf.sweep_stacked
        python3 -m perf.ncu_target compress_c128 all 4096

(``kernel_cutlass`` is the prefix of the CuTe DSL kernels' names; a bare ``kernel`` also
matches torch's kernels that build the inputs, and the skip count then lands on one of them.)
"""

from __future__ import annotations

import sys

import torch

import cute_kernels


def main() -> None:
    kernel, fmt, tokens = sys.argv[1], sys.argv[2], int(sys.argv[3])
    if kernel == "kv_rope_insert":
        from cute_kernels.testing import kv_rope_insert_case

        case = kv_rope_insert_case(fmt, tokens, 64, "cuda", extra_rows=0,
                                   positions_base=1000, skip_every=0)
        for _ in range(4):
            cute_kernels.kv_rope_insert(*case.args())
    elif kernel == "stacked_kv_proj":
        from cute_kernels.testing import stacked_kv_proj_case

        from .sweep_stacked import LAYOUTS

        (layout,) = [lay for lay in LAYOUTS if lay.name == fmt]
        case = stacked_kv_proj_case(tokens, layout.hidden, layout.layers, layout.n_kv,
                                    layout.head_dim, "cuda", skip_every=0,
                                    max_pos=max(4096, tokens + 1))
        for _ in range(4):
            cute_kernels.stacked_kv_proj(*case.args())
    elif kernel == "compress_c128":  # fmt: "all" (every token a window) or "mix" (1 in 128)
        from cute_kernels.testing import compress_c128_case

        case = compress_c128_case("v4_packed", tokens, 2, "cuda", negative_slots=False,
                                  boundary_every=None if fmt == "all" else 128,
                                  distinct_windows=True)
        for _ in range(4):
            cute_kernels.compress_c128(*case.args())
    else:
        raise SystemExit(f"unknown kernel {kernel}")
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
