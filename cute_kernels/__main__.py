"""``python -m cute_kernels compile --arch sm_90a|sm_100a [--kernel NAME]``

Compiles every kernel variant for the given arch without a GPU, one line per variant with its
compile seconds; exit status 1 if any variant fails.
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback

from . import families
from .arch import SUPPORTED_ARCHS


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cute_kernels")
    sub = parser.add_subparsers(dest="command", required=True)
    comp = sub.add_parser("compile", help="compile every kernel variant (no GPU needed)")
    comp.add_argument("--arch", required=True, choices=SUPPORTED_ARCHS)
    comp.add_argument("--kernel", default=None, help="one kernel family (default: all)")
    args = parser.parse_args(argv)
    return compile_all(args.arch, args.kernel)


if __name__ == "__main__":
    sys.exit(main())
