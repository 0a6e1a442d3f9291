"""Sweep of the stacked projection's plans (tile x schedule, each forced) over layouts and token
counts, next to the bare cuBLAS GEMM: the measurements behind the planner's cost model
(specs/stacked_kv_proj.md). GPU only.

    python -m perf.sweep_stacked [--tokens 1,16,64,256] [--layouts tp1,tp8]
        [--configs m64/dp,sw80/dp,m64/streamk@66,sw32/dp:8] [--json OUT] [--jobs 12]

A config is ``tile/schedule[@ctas][:splits]``: the splits of a swapped wgmma tile run as one
cluster (the split variant).

The variant of every timed cell (the plan's, and each config's as the planner picks it under
the config's overrides) is compiled first, in parallel worker processes, into the disk cache;
the timed process then loads them.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import time
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch
import torch.nn.functional as F

from cute_kernels.stacked_kv_proj.plan import StackedLayout, choose_plan

from . import bench_stacked_kv_proj as bench
from .ab import STACKED_ENV, set_plan_overrides
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
    Layout("1layer-tp4", 4096, 1, 2, 128),  # 4 weight tiles: swap16 split 8 on 64 CTAs at T <= 32
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


@contextlib.contextmanager
def forced(config: tuple[str, str, int | None, int | None] | None) -> Iterator[None]:
    """The ``CUTE_KERNELS_STACKED_*`` overrides of ``config`` (None: none, the plan) while
    inside, and none after: every other plan override is cleared too."""
    # a config names the overrides of an ab cell's options, in their order
    values = zip(STACKED_ENV, config or (None,) * len(STACKED_ENV), strict=True)
    set_plan_overrides({name: str(value) for name, value in values if value is not None})
    try:
        yield
    finally:
        set_plan_overrides({})


def planned_keys(layouts, configs, tokens, sms: int) -> list:
    """The compile key of every timed cell: the plan's and each config's, as ``choose_plan``
    picks the variant under that config's overrides (with the formula's cluster residency:
    a variant the timed call plans otherwise is compiled when it is timed)."""
    from cute_kernels.stacked_kv_proj.interface import StackedKvProjKey

    keys = set()
    for layout in layouts:
        stacked = StackedLayout(layout.layers, layout.n_kv, layout.head_dim, False, False,
                                "float32", "sm_90a")
        for config in (None, *configs):
            with forced(config):
                keys.update(StackedKvProjKey(stacked, choose_plan(stacked, t, layout.hidden,
                                                                  sms).variant)
                            for t in tokens)
    return sorted(keys, key=repr)


def _compile(key) -> None:
    from cute_kernels.stacked_kv_proj.interface import KERNELS

    KERNELS.get(key)


def precompile(keys: list, jobs: int) -> None:
    """Compile ``keys`` into the disk cache in ``jobs`` processes."""
    start = time.perf_counter()
    import multiprocessing

    with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        list(pool.map(_compile, keys))
    print(f"compiled {len(keys)} variants in {time.perf_counter() - start:.0f} s", flush=True)


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
    tokens = TOKENS if cli.tokens is None else tuple(int(t) for t in cli.tokens.split(","))
    os.environ.setdefault("CUTE_KERNELS_ARCH", "sm_90a")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    precompile(planned_keys(layouts, configs, tokens, sms), cli.jobs)

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
            with forced(None):
                plan = plan_for_call(args)
                row["auto_us"] = timer.cold_us(lambda a=args: stacked_kv_proj(*a))
            row["auto"] = (f"{plan.variant.tile} {'sk' if plan.stream_k else 'dp'}"
                           f" {plan.grid}/{plan.dp_tiles}"
                           + (f" split {plan.splits}" if plan.splits > 1 else ""))
            for config in configs:
                with forced(config):
                    row[_name(*config)] = timer.cold_us(lambda a=args: stacked_kv_proj(*a))
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
