"""``make perf``: benchmarks on a GPU; without one, compile every variant and say so.

Writes ``perf/results/<kernel>.json`` and ``perf/results/summary.md`` (git-ignored) and prints
the table last.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"


def compile_only() -> int:
    from cute_kernels.__main__ import compile_all

    print("No CUDA device: compiling every kernel variant for sm_90a and sm_100a instead.")
    status = 0
    for arch in ("sm_90a", "sm_100a"):
        print(f"--- {arch}")
        status |= compile_all(arch, None)
    print("Timings need a GPU: run `make perf` on a Hopper/Blackwell machine.")
    return status


BASELINES = (("ref_eager_us", "ref eager"), ("ref_compile_us", "ref torch.compile"),
             ("per_layer_us", "per-layer torch"),
             ("stacked_cublas_us", "stacked cuBLAS + torch"), ("cublas_only_us", "cuBLAS alone"),
             ("floor_us", "floor"), ("target_us", "target"))


#: The host time per eager call at T = 1 that the serving-integration issue asks for.
HOST_TARGET_US = {"kv_rope_insert": 8.0, "compress_c128": 10.0, "stacked_kv_proj": 12.0}


def markdown(rows: list[dict], env: dict, ceiling: float) -> str:
    lines = [
        f"# cute-kernels perf — {env['gpu']}, {env['date']}",
        f"driver {env['driver']}, torch {env['torch']}, CuTe DSL {env['cutlass_dsl']}; "
        f"copy ceiling {ceiling / 1e12:.2f} TB/s (read + write)",
        "",
        "| kernel | case | T | cold µs | hot µs | host µs | % of copy (cold) | baselines, µs "
        "| check |",
        "|---|---|---:|---:|---:|---:|---:|---|---|",
    ]
    for r in rows:
        base = ", ".join(
            f"{label} {r[key]:.1f}" if key in r else f"{label} failed ({r[error]})"
            for key, label in BASELINES
            for error in [key.removesuffix("_us") + "_error"]
            if key in r or error in r
        )
        if "vs_cublas" in r:
            base += f"; ours / cuBLAS {r['vs_cublas']:.2f}; {r['weight_tbps']:.2f} TB/s weight"
        if "tflops" in r:
            base += f"; {r['tflops']:.0f} TFLOP/s"
        if "plan" in r:
            base += f"; plan {r['plan']}"
        if "windows" in r:
            base += f"; {r['windows']} windows"
        lines.append(
            f"| {r['kernel']} | {r['format']} | {r['tokens']} | {r['cold_us']:.1f} | "
            f"{r['hot_us']:.2f} | {r['host_us']:.1f} | {r['pct_of_copy_cold']:.1f} | "
            f"{base} | {r['exact']} |"
        )
    timed = [r for r in rows if "host_rounds_us" in r]
    if timed:
        lines += ["", "Host µs per eager call at T = 1: the cell's own measurement and rounds "
                  "before, between and after the benchmarks (best of 5 bursts of 200 calls "
                  "each); the host column above is the best of them.", "",
                  "| kernel | case | best | rounds | target |", "|---|---|---:|---|---:|"]
        lines += [f"| {r['kernel']} | {r['format']} | {r['host_us']:.1f} | "
                  f"{' / '.join(f'{s:.1f}' for s in r['host_rounds_us'])} | "
                  f"{HOST_TARGET_US[r['kernel']]:.0f} |" for r in timed]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--kernel", default=None)
    parser.add_argument("--no-baselines", action="store_true")
    parser.add_argument("--out", default=str(RESULTS))
    parser.add_argument("--slots", default="paged", choices=("paged", "random"))
    parser.add_argument("--tokens", default=None, help="comma-separated sizes (default: all)")
    parser.add_argument("--compare", default=None, type=Path,
                        help="an earlier results.json: print the change of every cell")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        return compile_only()
    # read now: the run overwrites results.json, which may be the file compared against
    old = None if args.compare is None else json.loads(args.compare.read_text())

    from . import bench_compress_c128, bench_kv_rope_insert, bench_stacked_kv_proj, report
    from .timing import HostRounds, Timer, copy_ceiling_bytes_per_s, environment

    env = environment()
    ceiling = copy_ceiling_bytes_per_s()
    print(f"{env['gpu']} {env['date']}: copy ceiling {ceiling / 1e12:.3f} TB/s", flush=True)
    timer = Timer()
    rows: list[dict] = []
    benches = {name: bench for name, bench in (
        ("kv_rope_insert", bench_kv_rope_insert), ("compress_c128", bench_compress_c128),
        ("stacked_kv_proj", bench_stacked_kv_proj)) if args.kernel in (None, name)}
    # the T = 1 host times, measured again before, between and after the benchmarks
    host = HostRounds({key: call for bench in benches.values()
                       for key, call in bench.host_calls(slot_pattern=args.slots).items()})
    host.round()
    for name, bench in benches.items():
        print(f"--- {name}", flush=True)
        sizes = {} if args.tokens is None else {
            "tokens": tuple(int(t) for t in args.tokens.split(","))
        }
        rows += bench.run(timer, ceiling, baselines=not args.no_baselines,
                          slot_pattern=args.slots, **sizes)
        host.round()
        write_results(Path(args.out), rows, env, ceiling)  # kept even if a later one dies
    host.round()
    host.apply(rows)
    write_results(Path(args.out), rows, env, ceiling)
    print(markdown(rows, env, ceiling))
    results = {"env": env, "copy_ceiling_Bps": ceiling, "rows": rows}
    report.write_report(results, Path(args.out), old)
    return 0


def write_results(out: Path, rows: list[dict], env: dict, ceiling: float) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(
        json.dumps({"env": env, "copy_ceiling_Bps": ceiling, "rows": rows}, indent=1)
    )
    (out / "summary.md").write_text(markdown(rows, env, ceiling))


if __name__ == "__main__":
    sys.exit(main())
