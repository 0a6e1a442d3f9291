"""Sweep of the stacked projection's plans (tile x schedule, each forced) over layouts and token
counts, next to the bare cuBLAS GEMM: the measurements behind the planner's cost model
(specs/stacked_kv_proj.md). GPU only.

    python -m perf.sweep_stacked [--tokens 1,16,64,256] [--layouts tp1,tp8]
        [--configs m64/dp,sw80/dp,m64/streamk@66,sw32/dp:8] [--json OUT] [--jobs 12]

A config is ``tile/schedule[@ctas][:splits]``: the splits of a swapped wgmma tile run as one
cluster (the split variant).

Every variant is compiled first, in parallel worker processes, into the disk cache; the timed
process then loads them.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch
import torch.nn.functional as F

from . import bench_stacked_kv_proj as bench
from .bench_stacked_kv_proj import FLOOR_BYTES_PER_S, Layout

# make perf's layouts, and the corners of the target space (H 2048..8192, L 1..6, D 64..256)
LAYOUTS = (
    *bench.LAYOUTS,
    Layout("small", 2048, 1, 1, 128),
    Layout("large", 8192, 6, 8, 128),
    Layout("d64", 4096, 3, 4, 64),
    Layout("d256", 5120, 2, 1, 256),
    Layout("4b-tp2", 2560, 5, 4, 128),
    Layout("d64-l6", 2048, 6, 4, 64),
    Layout("1layer-tp4", 4096, 1, 2, 128),  # 4 weight tiles: sw32 split 8 on 32 CTAs at T <= 32
)
TOKENS = (1, 16, 64, 128, 256, 1024)
# (tile, schedule, CTA cap, splits): each tile both ways, and stream-K on fewer CTAs (fewer
# partials per tile for small weights)
CONFIGS = (*((tile, schedule, None, None) for tile in ("m64", "m128", "m128w")
             for schedule in ("dp", "streamk")),
           ("m64", "streamk", 66, None), ("m64", "streamk", 33, None))


def _name(tile: str, schedule: str, ctas: int | None, splits: int | None) -> str:
    return (f"{tile}/{schedule}" + ("" if ctas is None else f"@{ctas}")
            + ("" if splits is None else f":{splits}"))


def _parse_config(name: str) -> tuple[str, str, int | None, int | None]:
    """``tile/schedule[@ctas][:splits]`` -> (tile, schedule, CTA cap, splits)."""
    tile, _, rest = name.partition("/")
    rest, _, splits = rest.partition(":")
    schedule, _, ctas = rest.partition("@")
    return tile, schedule, int(ctas) if ctas else None, int(splits) if splits else None


def _compile(layout: Layout, tile: str, cluster: bool) -> str:
    from cute_kernels.stacked_kv_proj.interface import KERNELS, StackedKvProjKey
    from cute_kernels.stacked_kv_proj.plan import SWAP_TILES, StackedLayout, StackedVariant

    # the mma core's swapped tile (`swap16`) is the one tile the wgmma core does not have
    impl = "mma" if tile in SWAP_TILES else "wgmma"
    key = StackedKvProjKey(StackedLayout(layout.layers, layout.n_kv, layout.head_dim, False,
                                         False, "float32", "sm_90a"),
                           StackedVariant(impl, tile, cluster))
    KERNELS.get(key)
    return f"{layout.name} {tile}"


def precompile(layouts, jobs: int, variants=(("m64", False), ("m128", False),
                                             ("m128w", False))) -> None:
    """Compile every (layout, (tile, split)) into the disk cache in ``jobs`` processes."""
    start = time.perf_counter()
    os.environ.setdefault("CUTE_KERNELS_ARCH", "sm_90a")
    import multiprocessing

    with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        jobs_args = [(lay, tile, cluster) for lay in layouts for tile, cluster in variants]
        done = list(pool.map(_compile, *zip(*jobs_args, strict=True)))
    print(f"compiled {len(done)} variants in {time.perf_counter() - start:.0f} s", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", default=None)
    parser.add_argument("--layouts", default=None)
    parser.add_argument("--json", default=None)
    parser.add_argument("--jobs", type=int, default=12)
    parser.add_argument("--replays", type=int, default=30)
    parser.add_argument("--configs", default=None)
    cli = parser.parse_args()
    configs = CONFIGS if cli.configs is None else tuple(
        _parse_config(name) for name in cli.configs.split(","))
    layouts = LAYOUTS if cli.layouts is None else tuple(
        lay for lay in LAYOUTS if lay.name in cli.layouts.split(","))
    variants = sorted({(tile, (splits or 1) > 1) for tile, _, _, splits in configs})
    tokens = TOKENS if cli.tokens is None else tuple(int(t) for t in cli.tokens.split(","))
    precompile(layouts, cli.jobs, variants)

    from cute_kernels import stacked_kv_proj
    from cute_kernels.stacked_kv_proj.interface import plan_for_call
    from cute_kernels.testing import stacked_kv_proj_case

    from .timing import Timer, environment

    timer = Timer(replays=cli.replays)
    empty_us = timer.cold_us(lambda: torch.cuda._sleep(0))
    rows = []
    for layout in layouts:
        for t in tokens:
            case = stacked_kv_proj_case(t, layout.hidden, layout.layers, layout.n_kv,
                                        layout.head_dim, "cuda", skip_every=0, seed=t)
            args = case.args()
            cublas = timer.cold_us(lambda c=case: F.linear(c.ctx_hidden, c.weight))
            floor = empty_us + layout.weight_bytes / FLOOR_BYTES_PER_S * 1e6
            row = {"layout": layout.label, "tokens": t, "cublas_us": cublas, "floor_us": floor}
            os.environ.pop("CUTE_KERNELS_STACKED_TILE", None)
            os.environ.pop("CUTE_KERNELS_STACKED_SCHEDULE", None)
            plan = plan_for_call(args)
            row["auto"] = (f"{plan.variant.tile} {'sk' if plan.stream_k else 'dp'}"
                           f" {plan.grid}/{plan.dp_tiles}"
                           + (f" split {plan.splits}" if plan.splits > 1 else ""))
            row["auto_us"] = timer.cold_us(lambda a=args: stacked_kv_proj(*a))
            for tile, schedule, ctas, splits in configs:
                os.environ["CUTE_KERNELS_STACKED_TILE"] = tile
                os.environ["CUTE_KERNELS_STACKED_SCHEDULE"] = schedule
                if ctas is not None:
                    os.environ["CUTE_KERNELS_STACKED_CTAS"] = str(ctas)
                if splits is not None:
                    os.environ["CUTE_KERNELS_STACKED_SPLITS"] = str(splits)
                row[_name(tile, schedule, ctas, splits)] = timer.cold_us(
                    lambda a=args: stacked_kv_proj(*a))
                os.environ.pop("CUTE_KERNELS_STACKED_CTAS", None)
                os.environ.pop("CUTE_KERNELS_STACKED_SPLITS", None)
            os.environ.pop("CUTE_KERNELS_STACKED_TILE")
            os.environ.pop("CUTE_KERNELS_STACKED_SCHEDULE")
            rows.append(row)
            cells = "  ".join(f"{_name(*c)}={row[_name(*c)]:.1f}" for c in configs)
            print(f"{layout.label:<28} T={t:<5} cuBLAS {cublas:6.1f} floor {floor:5.1f} "
                  f"auto {row['auto_us']:6.1f} [{row['auto']}]  {cells}", flush=True)
            del case, args
    if cli.json:
        Path(cli.json).write_text(json.dumps({"env": environment(), "empty_us": empty_us,
                                              "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
