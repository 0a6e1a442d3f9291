"""Same-run A/B of two versions of the package on the GPU: cold µs of each cell, the versions
run in alternating processes, and whether their outputs are byte-identical.

    git archive REV cute_kernels | tar -x -C OLD     # the other version (carry OLD to the GPU)
    python -m perf.ab --old OLD --cells stacked:tp8:1024:m128:streamk,kv:bf16:262144,c128:all:32

``--new DIR`` takes the new version from another folder too (a branch: ``git archive BRANCH
cute_kernels``), instead of this repository's package; ``perf`` itself always comes from here.

Cells (the make perf inputs of each op):

- ``stacked:<layout>[:<T>[:<tile>[:<schedule>[:<CTA cap>[:<splits>]]]]]``, a layout of
  ``perf.sweep_stacked.LAYOUTS`` (tp1, tp2, tp4, tp8, 1layer, small, large, d64, d256, 4b-tp2,
  d64-l6) and the ``CUTE_KERNELS_STACKED_{TILE,SCHEDULE,CTAS,SPLITS}`` overrides (``auto``:
  the plan); every other plan override of the environment is cleared for each cell;
- ``kv:<format>:<T>[:decode]``, a ``CacheFormat`` value (v4_packed, v41_mxfp8, bf16, fp8);
- ``c128:<all|mix|none>:<T>``.

Every version compiles into a cache folder of its own (the disk cache is keyed by the package's
sources anyway) in ``--jobs`` parallel processes first; then ``--rounds`` rounds, old then new.
``--hot`` also times every cell hot (20 calls in one graph, L2 warm: a line of its own).
The table gives each version's best and worst over its rounds and SAME / DIFF for the outputs
(a SHA-1 of the cache bytes after one call on poisoned caches).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from cute_kernels.stacked_kv_proj.plan import (
    CTAS_ENV,
    OVERRIDE_ENVS,
    SCHEDULE_ENV,
    SPLITS_ENV,
    TILE_ENV,
)

ROOT = Path(__file__).resolve().parent.parent
#: the overrides a stacked cell's options set, in option order
STACKED_ENV = (TILE_ENV, SCHEDULE_ENV, CTAS_ENV, SPLITS_ENV)


@dataclasses.dataclass(frozen=True)
class Cell:
    op: str  # stacked | kv | c128
    case: str  # layout, format or window pattern
    tokens: int
    options: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        return ":".join((self.op, self.case, str(self.tokens), *self.options))

    @property
    def compile_group(self) -> tuple:
        """Cells that may share compiled variants (one warm-up each): T picks the stacked plan."""
        return (self.op, self.case, self.tokens, self.options) if self.op == "stacked" else (
            self.op, self.case)


def parse_cells(text: str) -> list[Cell]:
    """``op:case:T[:option...]`` items, comma-separated."""
    cells = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        op, case, *rest = item.split(":")
        if op not in ("stacked", "kv", "c128") or not rest or not rest[0].isdigit():
            raise ValueError(f"cell {item!r}: expected stacked|kv|c128:<case>:<T>[:...]")
        limit = {"stacked": len(STACKED_ENV), "kv": 1, "c128": 0}[op]
        if len(rest) - 1 > limit:
            raise ValueError(f"cell {item!r}: at most {limit} options for {op}")
        cells.append(Cell(op, case, int(rest[0]), tuple(rest[1:])))
    return cells


def _stacked_env(cell: Cell) -> dict[str, str]:
    return {name: value for name, value in zip(STACKED_ENV, cell.options, strict=False)
            if value != "auto"}


def set_plan_overrides(values: dict[str, str]) -> None:
    """Every plan override cleared, then ``values`` set: none leaks in from the caller's
    environment or from the previous cell (``perf.sweep_stacked.forced`` too)."""
    for name in OVERRIDE_ENVS:
        os.environ.pop(name, None)
    os.environ.update(values)


def _apply_stacked_env(cell: Cell) -> None:
    set_plan_overrides(_stacked_env(cell))


def _measure(cell: Cell, timer, hot: bool = False) -> dict:
    """Time one cell in this process (cold; with ``hot`` also 20 calls in one graph, L2 warm)
    and hash its outputs (GPU)."""
    import torch

    import cute_kernels
    from cute_kernels.testing import POISON

    _apply_stacked_env(cell)
    plan = ""
    if cell.op == "stacked":
        from cute_kernels.stacked_kv_proj.interface import plan_for_call

        from . import bench_stacked_kv_proj
        from .sweep_stacked import LAYOUTS

        (layout,) = [lay for lay in LAYOUTS if lay.name == cell.case]
        case = bench_stacked_kv_proj._case(layout, cell.tokens)
        backings, op = (*case.k_backings, *case.v_backings), cute_kernels.stacked_kv_proj
        plan = bench_stacked_kv_proj.plan_label(plan_for_call(case.args()))
    elif cell.op == "kv":
        from cute_kernels.layouts import CacheFormat

        from . import bench_kv_rope_insert

        pattern = cell.options[0] if cell.options else "paged"
        case = bench_kv_rope_insert._case(CacheFormat(cell.case), cell.tokens, pattern)
        backings, op = (case.backing,), cute_kernels.kv_rope_insert
    else:
        from . import bench_compress_c128

        every = {"all": None, "mix": 128, "none": 0}[cell.case]
        case = bench_compress_c128._case(cell.tokens, every)
        backings, op = (case.backing,), cute_kernels.compress_c128
    args = case.args()
    us = timer.cold_us(lambda: op(*args))
    hot_us = timer.hot_us(lambda: op(*args)) if hot else None
    for backing in backings:  # then one call on poisoned caches: skipped bytes stay poison
        backing.view(torch.uint8).fill_(POISON)
    op(*args)
    torch.cuda.synchronize()
    digest = hashlib.sha1()
    for backing in backings:
        digest.update(backing.view(torch.uint8).cpu().numpy().tobytes())
    row = {"cell": cell.name, "us": us, "plan": plan, "sha": digest.hexdigest()[:16]}
    if hot_us is not None:
        row["hot_us"] = hot_us
    return row


def worker(cells: list[Cell], replays: int, hot: bool) -> None:
    import cute_kernels

    from .timing import Timer

    print(json.dumps({"package": str(Path(cute_kernels.__file__).resolve().parent)}),
          flush=True)
    if not cells:
        return
    timer = Timer(replays=replays)
    for cell in cells:
        print(json.dumps(_measure(cell, timer, hot)), flush=True)


def _run(version: str, folder: Path, cache: Path, cells: list[Cell], replays: int,
         hot: bool = False) -> list[dict]:
    """The cells in a worker process of ``version``, importing the package in ``folder`` (this
    repository's, or another's ahead of it on the path). The worker runs in the cache folder,
    since ``python -m`` puts its working directory ahead of PYTHONPATH (from the repository it
    would import the repository's package)."""
    package = folder.resolve() / "cute_kernels"
    path = list(dict.fromkeys((str(folder.resolve()), str(ROOT))))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        path + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]),
        CUTE_KERNELS_CACHE_DIR=str(cache / version))
    out = subprocess.run(
        [sys.executable, "-m", "perf.ab", "--worker", "--replays", str(replays), "--cells",
         ",".join(c.name for c in cells), *(["--hot"] if hot else [])],
        env=env, cwd=cache, capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"{version} worker failed:\n{out.stderr[-3000:]}")
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    if not rows or rows[0].get("package") != str(package):
        raise RuntimeError(f"{version} worker imported {rows[0] if rows else '?'}, not {package}")
    return rows[1:]


def table(runs: dict[str, list[dict]]) -> str:
    """Per cell: each version's best (worst) µs over its rounds, new / old of the bests, plans,
    and whether every output hash of the cell agrees (where not, each version's hashes in
    round order, so that a run that differs is named)."""
    times: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    hot: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    hashes: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    plans: dict[str, dict[str, str]] = defaultdict(dict)
    for version, rows in runs.items():
        for r in rows:
            times[r["cell"]][version].append(r["us"])
            if "hot_us" in r:
                hot[r["cell"]][version].append(r["hot_us"])
            hashes[r["cell"]][version].append(r["sha"])
            plans[r["cell"]][version] = r["plan"]
    def columns(by: dict[str, list[float]]) -> str:
        old, new = by.get("old", []), by.get("new", [])
        ratio = f"{min(new) / min(old):9.3f}" if old and new else f"{'':>9}"
        return "".join(f"{min(v):8.2f} ({max(v):5.1f})" if v else f"{'-':>16}"
                       for v in (old, new)) + ratio

    lines = [f"{'cell':<34}{'old':>16}{'new':>16}{'new/old':>9}  outputs  plan (old -> new)"]
    for cell, by in times.items():
        plan = " -> ".join(dict.fromkeys(plans[cell].get(v, "") for v in ("old", "new")))
        by_version = hashes[cell]
        same = "SAME" if len({h for v in by_version.values() for h in v}) == 1 else "DIFF"
        lines.append(f"{cell:<34}{columns(by)}  {same:<7}  {plan}")
        if cell in hot:
            lines.append(f"{'    hot':<34}{columns(hot[cell])}")
        if same == "DIFF":
            lines.append("    hashes: " + "; ".join(
                f"{v} {' '.join(by_version[v])}" for v in ("old", "new") if v in by_version))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cells", required=True)
    parser.add_argument("--old", type=Path, help="a folder holding the other cute_kernels")
    parser.add_argument("--new", type=Path, default=ROOT,
                        help="a folder holding the new cute_kernels (default: this repository)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--replays", type=int, default=40)
    parser.add_argument("--hot", action="store_true",
                        help="also time each cell hot (20 calls in one graph, L2 warm)")
    parser.add_argument("--jobs", type=int, default=8, help="parallel compiles per version")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    cli = parser.parse_args(argv)
    cells = parse_cells(cli.cells)
    if cli.worker:
        worker(cells, cli.replays, cli.hot)
        return
    for name, folder in (("--old", cli.old), ("--new", cli.new)):
        if folder is None or not (folder / "cute_kernels").is_dir():
            parser.error(f"{name}: a folder with a cute_kernels package (git archive REV "
                         "cute_kernels)")
    folders = {"old": cli.old, "new": cli.new}
    cache = Path(tempfile.mkdtemp(prefix="cute_kernels_ab_"))
    groups = list({c.compile_group: c for c in cells}.values())
    with ThreadPoolExecutor(cli.jobs) as pool:  # each thread waits on its own worker process
        list(pool.map(lambda job: _run(job[0], folders[job[0]], cache, [job[1]], 2),
                      [(version, cell) for version in ("old", "new") for cell in groups]))
    runs: dict[str, list[dict]] = {"old": [], "new": []}
    for _ in range(cli.rounds):
        for version in ("old", "new"):
            runs[version] += _run(version, folders[version], cache, cells, cli.replays, cli.hot)
    if cli.json:
        cli.json.write_text(json.dumps(runs, indent=1))
    print(table(runs))


if __name__ == "__main__":
    main()
