"""Every kernel variant compiles for sm_90a and sm_100a without a GPU, for the arch asked."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from cute_kernels import compile_cache
from cute_kernels.arch import SUPPORTED_ARCHS

ROOT = Path(__file__).resolve().parent.parent


def _variants():
    return [(name, key) for arch in SUPPORTED_ARCHS
            for name, cache in sorted(compile_cache.families().items())
            for key in cache.variants(arch)]


@pytest.mark.parametrize(("family", "key"), _variants(), ids=str)
def test_variant_compiles(family, key):
    compiled = compile_cache.families()[family].build(key)
    assert callable(compiled)


@pytest.mark.parametrize("arch", SUPPORTED_ARCHS)
def test_compiled_code_targets_the_requested_arch(arch, tmp_path):
    """The DSL silently defaults to sm_100a without a GPU: the PTX must name the arch asked for."""
    code = f"""
import sys; sys.path.insert(0, {str(ROOT)!r})
import cutlass.cute as cute
from cute_kernels import dsl_utils
from cute_kernels.kv_rope_insert import KERNELS, KvRopeInsertKey
from cute_kernels.layouts import CacheFormat
original = cute.compile
def keep_ptx(fn, *args, options=""):
    return original(fn, *args, options=options + " --keep-ptx")
cute.compile = keep_ptx
KERNELS.build(KvRopeInsertKey(CacheFormat.BF16, {arch!r}))
"""
    # the DSL's own default points elsewhere: only --gpu-arch can make the PTX right
    env = {**os.environ, "CUTE_DSL_ARCH": "sm_100a" if arch == "sm_90a" else "sm_90a"}
    env.pop("CUTE_KERNELS_ARCH", None)
    subprocess.run([sys.executable, "-c", code], cwd=tmp_path, check=True, env=env)
    ptx = list(tmp_path.glob("*.ptx"))
    assert ptx and all(f".target {arch}" in p.read_text() for p in ptx)


def test_cli_compiles_every_variant():
    out = subprocess.run([sys.executable, "-m", "cute_kernels", "compile", "--arch", "sm_90a",
                          "--kernel", "kv_rope_insert"], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout
    lines = [line for line in out.splitlines() if line.startswith("kv_rope_insert")]
    assert len(lines) == 4 and all(line.endswith("ok") for line in lines), out


def test_cli_fails_on_unknown_kernel():
    proc = subprocess.run([sys.executable, "-m", "cute_kernels", "compile", "--arch", "sm_90a",
                           "--kernel", "nope"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 1 and "unknown kernel" in proc.stderr
