"""Small calls of every variant of every kernel, for compute-sanitizer (``make sanitize``):

    compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 1 \\
        python3 -m perf.sanitize

(``--report-api-errors no``: the CUDA Python bindings probe the driver with calls that fail by
design.) Each call's result is checked against the reference too, so a variant that runs but
computes garbage also fails. Without a GPU it says so and exits 0.
"""

from __future__ import annotations

import os
import sys

import torch


def _kv_rope_insert() -> int:
    import cute_kernels
    from cute_kernels import reference
    from cute_kernels.arch import sm_count
    from cute_kernels.kv_rope_insert import KvRopeInsert
    from cute_kernels.layouts import CacheFormat
    from cute_kernels.testing import kv_rope_insert_case

    # 37 slots: one per warp; 33 slots a warp: every warp wraps its ring and crosses a chunk.
    # Some slots and positions out of range: they must neither write nor read outside.
    warps = sm_count(torch.device("cuda")) * KvRopeInsert.CTAS_PER_SM * KvRopeInsert.WARPS_PER_CTA
    sizes = (37, 33 * warps + 37)
    for fmt in CacheFormat:
        for slots in sizes:
            case = kv_rope_insert_case(fmt, slots, 16, "cuda", out_of_range=True)
            ref_backing, ref_cache = case.twin()
            reference.kv_rope_insert(*case.args(ref_cache))
            cute_kernels.kv_rope_insert(*case.args())
            torch.cuda.synchronize()
            assert torch.equal(case.backing.view(torch.uint8),
                               ref_backing.view(torch.uint8)), (fmt, slots)
    return len(CacheFormat) * len(sizes)


def _compress_c128() -> int:
    import cute_kernels
    from cute_kernels.compress_c128 import CORE_ENV, CORES
    from cute_kernels.layouts import C128_FORMATS
    from cute_kernels.testing import compress_c128_case

    calls = 0
    for core in CORES:  # each core forced
        os.environ[CORE_ENV] = core
        for fmt in C128_FORMATS:
            for norm in (torch.bfloat16, torch.float32):
                # with fp32 norm weights, indices out of range too (nothing read or written
                # outside)
                case = compress_c128_case(fmt, 40, 2, "cuda", norm_dtype=norm,
                                          out_of_range=norm is torch.float32)
                cute_kernels.compress_c128(*case.args())
                torch.cuda.synchronize()
                written = case.backing.view(torch.uint8) != 0xA5
                # the tolerance checks are the GPU tests'
                assert bool(written.any()), (core, fmt, norm)
                calls += 1
        # ten windows a cluster, two or three a stream CTA: past the evict-first ones
        case = compress_c128_case("v4_packed", 300, 2, "cuda", boundary_every=None)
        cute_kernels.compress_c128(*case.args())
        torch.cuda.synchronize()
        assert bool((case.backing.view(torch.uint8) != 0xA5).any())
        calls += 1
    del os.environ[CORE_ENV]
    return calls


def _stacked_kv_proj() -> int:
    from cute_kernels import reference, stacked_kv_proj
    from cute_kernels.stacked_kv_proj.plan import (
        CTAS_ENV,
        HANDOVER_ENV,
        IMPL_ENV,
        SCHEDULE_ENV,
        SPLIT_SWAPPED_WGMMA_TILES,
        SPLITS_ENV,
        TILE_ENV,
        TILES,
        impls_for,
        tiles_for,
    )
    from cute_kernels.testing import compare_stacked, stacked_kv_proj_case
    from perf.ab import set_plan_overrides

    arch = f"sm_{''.join(map(str, torch.cuda.get_device_capability()))}a"
    # every tile of each core, with each schedule: the wgmma core's data-parallel (the
    # persistent tile on one CTA) and stream-K, and the swapped wgmma tiles split (3 CTAs per
    # tile, one cluster), the mma core's one CTA per tile and split K with each hand-over of
    # the partials
    schedules = {"wgmma": ({SCHEDULE_ENV: "dp"}, {SCHEDULE_ENV: "streamk"},
                           {SCHEDULE_ENV: "dp", SPLITS_ENV: "3"}),
                 "mma": ({SPLITS_ENV: "1"}, {SPLITS_ENV: "3", HANDOVER_ENV: "workspace"},
                         {SPLITS_ENV: "3", HANDOVER_ENV: "cluster"})}
    calls = 0
    for impl in impls_for(arch):
        for tile in tiles_for(impl):
            for schedule in schedules[impl]:
                if (TILES[tile].split_head or TILES[tile].tokens_n) and schedule.get(
                        SCHEDULE_ENV) == "streamk":
                    continue  # a split-head plan is data-parallel only (check_overrides)
                if (impl == "wgmma" and SPLITS_ENV in schedule
                        and tile not in SPLIT_SWAPPED_WGMMA_TILES):
                    continue  # the other wgmma tiles have no split variant
                if TILES[tile].persistent:  # every tile on one CTA: the hand-over cycles
                    schedule = {**schedule, CTAS_ENV: "1"}
                env = {IMPL_ENV: impl, TILE_ENV: tile, **schedule}
                set_plan_overrides(env)  # and none left from the caller or the last variant
                # slots and positions out of range too: nothing read or written outside
                case = stacked_kv_proj_case(37, 256, 2, 2, 128, "cuda", bias=True,
                                            commit=True, row_pad=8, out_of_range=True)
                _, _, ref_k, ref_v = case.twin()
                reference.stacked_kv_proj(*case.args(ref_k, ref_v))
                stacked_kv_proj(*case.args())
                torch.cuda.synchronize()
                result = compare_stacked(case, ref_k, ref_v)
                assert result.untouched_equal, env
                calls += 1
    # the weight's evict-first loads (plan.EVICT_FIRST_WEIGHT_BYTES: 12 MiB here), as planned
    for impl in impls_for(arch):
        set_plan_overrides({IMPL_ENV: impl})
        for tokens in (1, 37):
            case = stacked_kv_proj_case(tokens, 6144, 2, 2, 128, "cuda")
            _, _, ref_k, ref_v = case.twin()
            reference.stacked_kv_proj(*case.args(ref_k, ref_v))
            stacked_kv_proj(*case.args())
            torch.cuda.synchronize()
            assert compare_stacked(case, ref_k, ref_v).untouched_equal, (impl, tokens)
            calls += 1
    set_plan_overrides({})
    return calls


def main() -> int:
    if not torch.cuda.is_available():
        print("perf.sanitize: no CUDA device; run `make sanitize` on a GPU machine")
        return 0
    for name, run in (("kv_rope_insert", _kv_rope_insert), ("compress_c128", _compress_c128),
                      ("stacked_kv_proj", _stacked_kv_proj)):
        print(f"perf.sanitize: {name}: {run()} variants ran", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
