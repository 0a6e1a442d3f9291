"""Where a kernel's warps stall, per SASS instruction, from Nsight Compute's source page:

    ncu --clock-control none -k regex:kernel_cutlass --launch-skip 2 --launch-count 1 \\
        --section SourceCounters --section WarpStateStats -o R python3 -m perf.ncu_target ...
    ncu -i R.ncu-rep --page source --csv --print-source sass > R.csv
    python3 -m perf.ncu_stalls R.csv [--top 25]

Prints the kernel's stall samples by reason, then the instructions holding the most samples
(share of all samples, address, SASS, and each reason with samples there). How the stream-K
schedule's operand waits were found (specs/stacked_kv_proj.md).
"""

from __future__ import annotations

import argparse
import csv
import io
from collections import Counter
from pathlib import Path

SAMPLES = "Warp Stall Sampling (All Samples)"


def _number(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def read_source_page(text: str) -> tuple[str, list[dict[str, str]]]:
    """(kernel name, one dict per SASS instruction) of a ``--page source --csv`` export: a
    ``"Kernel Name",...`` line, then a header line starting with ``"Address"``."""
    lines = text.splitlines()
    kernel = ""
    for i, line in enumerate(lines):
        if line.startswith('"Kernel Name"'):
            kernel = next(csv.reader([line]))[1]
        elif line.startswith('"Address"'):
            return kernel, list(csv.DictReader(io.StringIO("\n".join(lines[i:]))))
    raise ValueError("no source-page table (a header starting with \"Address\") in the export")


def stall_reasons(row: dict[str, str]) -> Counter:
    """Samples per stall reason of one instruction (issued and not, as the columns give)."""
    return Counter({name[len("stall_"):]: _number(value) for name, value in row.items()
                    if name.startswith("stall_") and "(" not in name and _number(value)})


def report(text: str, top: int) -> str:
    kernel, rows = read_source_page(text)
    total = sum(_number(r[SAMPLES]) for r in rows) or 1.0
    by_reason = sum((stall_reasons(r) for r in rows), Counter())
    out = [f"{kernel[:100]}: {total:.0f} warp stall samples over {len(rows)} instructions",
           "by reason: " + ", ".join(f"{name} {100 * n / total:.1f} %"
                                     for name, n in by_reason.most_common())]
    for r in sorted(rows, key=lambda r: -_number(r[SAMPLES]))[:top]:
        reasons = " ".join(f"{name}={n:.0f}" for name, n in stall_reasons(r).most_common())
        out.append(f"{100 * _number(r[SAMPLES]) / total:5.1f} %  {r['Address']}  "
                   f"{r['Source'].strip()[:70]:<70}  {reasons}")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("csv", type=Path)
    parser.add_argument("--top", type=int, default=25)
    cli = parser.parse_args(argv)
    print(report(cli.csv.read_text(errors="replace"), cli.top))


if __name__ == "__main__":
    main()
