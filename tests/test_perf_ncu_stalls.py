"""perf/ncu_stalls.py on a synthetic Nsight Compute source-page export (CPU)."""

from __future__ import annotations

import pytest

from perf import ncu_stalls

HEADER = ('"Address","Source","Warp Stall Sampling (All Samples)",'
          '"Warp Stall Sampling (Not-issued Samples)","stall_barrier","stall_long_sb",'
          '"stall_wait","stall_barrier (Not Issued)","stall_long_sb (Not Issued)"')
EXPORT = "\n".join([
    '"Kernel Name","kernel_cutlass_demo",',
    HEADER,
    '"0x10","      HGMMA.64x128x16.F32.BF16 R24, gdesc[UR16], R24","10","8","0","0","10","0","0"',
    '"0x20","@!P3  BRA 0x90","60","60","0","58","2","0","58"',
    '"0x30","      LDS R101, [UR6+0x480]","1,930","29","1,930","0","0","29","0"',
])


def test_instructions_by_share_of_samples() -> None:
    text = ncu_stalls.report(EXPORT, top=2)
    lines = text.splitlines()
    assert lines[0] == "kernel_cutlass_demo: 2000 warp stall samples over 3 instructions"
    # per reason over the kernel, the "(Not Issued)" columns not counted twice
    assert lines[1] == "by reason: barrier 96.5 %, long_sb 2.9 %, wait 0.6 %"
    assert lines[2].split()[:3] == ["96.5", "%", "0x30"] and lines[2].endswith("barrier=1930")
    assert lines[3].split()[:3] == ["3.0", "%", "0x20"]
    assert lines[3].endswith("long_sb=58 wait=2")
    assert len(lines) == 4  # top=2


def test_an_export_without_the_source_table_is_refused() -> None:
    with pytest.raises(ValueError, match="no source-page table"):
        ncu_stalls.report('"Kernel Name","k",\n"ID","Metric"\n', top=5)
