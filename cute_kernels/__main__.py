"""``python -m cute_kernels compile --arch sm_90a|sm_100a [--kernel NAME]``

Compiles every kernel variant for the given arch without a GPU, one line per variant with its
compile seconds; exit status 1 if any variant fails.

``python -m cute_kernels plan PRESET_OR_JSON [--arch ARCH] [--tp N] [--json] [--precompile
[--strict]]`` (``--list-presets`` lists the presets)

The layout plan of a deployment (:func:`cute_kernels.plan`): per op and case, supported with
its compile keys or the LayoutError. A table, or with ``--json`` a JSON object on stdout.
``--precompile`` then builds exactly the plan's variants into the disk cache (to bake an image);
with ``--strict`` every one must already be there (a check of a baked image). Exit status 0
when the plan was made (rejected cases are information), 2 for a description that cannot be
planned, 1 when a precompile fails.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback

from . import cache_stats, families, precompile, set_strict
from .arch import SUPPORTED_ARCHS
from .compile_cache import StrictModeError
from .deployment import PRESETS, DeploymentError, plan
from .validation import LayoutError


def compile_all(arch: str, kernel: str | None) -> int:
    caches = families()
    if kernel is not None and kernel not in caches:
        print(f"unknown kernel {kernel!r}; known: {', '.join(sorted(caches))}", file=sys.stderr)
        return 1
    failures = 0
    for name, cache in sorted(caches.items()):
        if kernel is not None and name != kernel:
            continue
        for key in cache.variants(arch):
            start = time.perf_counter()
            try:
                cache.build(key)
                status = "ok"
            except Exception:  # report every variant, then fail
                failures += 1
                status = "FAILED\n" + traceback.format_exc()
            print(f"{name:<20} {key!s:<70} {time.perf_counter() - start:7.2f} s  {status}")
            sys.stdout.flush()
    return 1 if failures else 0


def plan_command(args: argparse.Namespace) -> int:
    if args.list_presets:
        width = max(len(name) for name in PRESETS)
        for name, preset in PRESETS.items():
            print(f"{name:<{width}}  {preset.summary}")
        return 0
    if args.deployment is None:
        print("cute_kernels plan: give a preset name or a JSON file (--list-presets lists the "
              "presets)", file=sys.stderr)
        return 2
    if args.strict and not args.precompile:
        print("cute_kernels plan: --strict checks a --precompile", file=sys.stderr)
        return 2
    try:
        result = plan(args.deployment, arch=args.arch, tp=args.tp)
    except (DeploymentError, LayoutError, RuntimeError) as e:  # bad description, or no arch
        print(f"cute_kernels plan: {e}", file=sys.stderr)
        return 2
    print(json.dumps(result.to_json(), indent=2) if args.json else result.table())
    if not args.precompile:
        return 0
    sys.stdout.flush()  # the table or JSON first, then the progress bar (stderr)
    before = cache_stats()
    if args.strict:  # from the start: every variant must load from the disk cache
        set_strict(True)
    try:
        precompile(result)
    except StrictModeError as e:
        print(f"cute_kernels plan: {e}", file=sys.stderr)
        return 1
    finally:
        if args.strict:  # main() may run in a longer-lived process
            set_strict(False)
    after = cache_stats()
    compiled = int(after["compiles"] - before["compiles"])
    loaded = int(after["disk_hits"] - before["disk_hits"])
    seconds = after["compile_seconds"] - before["compile_seconds"]
    variants = sum(len(keys) for keys in result.keys().values())
    # stderr, so that stdout stays one JSON document with --json
    print(f"precompile: variants {variants}, compiled {compiled} ({seconds:.1f} s), loaded from "
          f"the disk cache {loaded}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cute_kernels")
    sub = parser.add_subparsers(dest="command", required=True)
    comp = sub.add_parser("compile", help="compile every kernel variant (no GPU needed)")
    comp.add_argument("--arch", required=True, choices=SUPPORTED_ARCHS)
    comp.add_argument("--kernel", default=None, help="one kernel family (default: all)")
    pln = sub.add_parser("plan", help="the layout plan of a deployment (no GPU needed)")
    pln.add_argument("deployment", nargs="?", help="a preset name or a deployment JSON file")
    pln.add_argument("--arch", default=None,
                     help="target arch, e.g. sm_90a or sm_100a (default: the description's, "
                          "else CUTE_KERNELS_ARCH or the current GPU's)")
    pln.add_argument("--tp", type=int, default=None, help="TP size (default: the description's)")
    pln.add_argument("--json", action="store_true", help="print the plan as JSON")
    pln.add_argument("--precompile", action="store_true",
                     help="build the plan's variants into the disk cache")
    pln.add_argument("--strict", action="store_true",
                     help="with --precompile: fail if a variant is not in the disk cache yet")
    pln.add_argument("--list-presets", action="store_true", help="list the presets and exit")
    args = parser.parse_args(argv)
    if args.command == "plan":
        return plan_command(args)
    return compile_all(args.arch, args.kernel)


if __name__ == "__main__":
    sys.exit(main())
