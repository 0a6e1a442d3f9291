"""Compile cache: one compile per layout key, thread- and process-safe, persistent on disk."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

import cute_kernels
from cute_kernels import compile_cache
from cute_kernels.compile_cache import KernelCache, StrictModeError
from cute_kernels.kv_rope_insert import KERNELS, KvRopeInsertKey, kv_rope_insert
from cute_kernels.layouts import CacheFormat

WORKER = Path(__file__).resolve().parent / "cache_worker.py"


def _meta_args(tokens: int):
    kv = torch.empty(tokens + 2, 512, dtype=torch.bfloat16, device="meta")
    cache = torch.empty(max(1, tokens // 64 + 1), 64, 584, dtype=torch.uint8, device="meta")
    slots = torch.empty(tokens, dtype=torch.int64, device="meta")
    positions = torch.empty(tokens + 2, dtype=torch.int64, device="meta")
    cos_sin = torch.empty(4096, 64, dtype=torch.float32, device="meta")
    return kv, cache, slots, positions, cos_sin, 64, None, False


def test_one_compile_serves_every_token_count(monkeypatch):
    monkeypatch.setenv("CUTE_KERNELS_ARCH", "sm_90a")
    monkeypatch.setenv("CUTE_KERNELS_DISK_CACHE", "0")
    keys = {kv_rope_insert.validate(*_meta_args(t)) for t in (1, 17, 1024, 262144)}
    assert keys == {KvRopeInsertKey(CacheFormat.V4_PACKED, "sm_90a")}
    cache = KernelCache("kv_rope_insert_test_tokens", KERNELS._build, KERNELS.variants)
    before = cute_kernels.cache_stats()
    for t in (1, 17, 1024, 262144):
        cache.get(kv_rope_insert.validate(*_meta_args(t)))
    after = cute_kernels.cache_stats()
    assert after["compiles"] - before["compiles"] == 1
    assert after["memory_hits"] - before["memory_hits"] == 3


def test_concurrent_first_calls_compile_once(monkeypatch):
    monkeypatch.setenv("CUTE_KERNELS_DISK_CACHE", "0")
    builds = []

    def slow_build(key):
        builds.append(key)
        time.sleep(0.2)
        return lambda *args: key

    cache = KernelCache("threads_test", slow_build, lambda arch: [])
    results = []
    threads = [threading.Thread(target=lambda: results.append(cache.get(("k", "sm_90a"))))
               for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(builds) == 1 and len({id(r) for r in results}) == 1


def _worker(cache_dir: Path, fmt: str = "bf16", arch: str = "sm_90a", **env) -> subprocess.Popen:
    full_env = {**os.environ, "CUTE_KERNELS_CACHE_DIR": str(cache_dir), **env}
    return subprocess.Popen([sys.executable, str(WORKER), fmt, arch], env=full_env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _stats(proc: subprocess.Popen) -> dict:
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    return json.loads(out.strip().splitlines()[-1])


def _objects(cache_dir: Path) -> list[Path]:
    return sorted(cache_dir.rglob("*.o"))


def test_disk_cache_reload_in_a_fresh_process_compiles_nothing(tmp_path):
    first = _stats(_worker(tmp_path))
    assert first["compiles"] == 1 and first["disk_hits"] == 0
    assert len(_objects(tmp_path)) == 1
    second = _stats(_worker(tmp_path))
    assert second["compiles"] == 0 and second["disk_hits"] == 1


def test_two_racing_processes_compile_once(tmp_path):
    procs = [_worker(tmp_path), _worker(tmp_path)]
    stats = [_stats(p) for p in procs]
    assert sum(s["compiles"] for s in stats) == 1
    assert sum(s["disk_hits"] for s in stats) == 1


@pytest.mark.parametrize("damage", ["garbage", "truncated", "missing_checksum"])
def test_corrupt_object_is_detected_removed_and_rebuilt(tmp_path, damage):
    _stats(_worker(tmp_path))
    (obj,) = _objects(tmp_path)
    if damage == "garbage":
        obj.write_bytes(b"\x7fELF not really" * 100)
    elif damage == "truncated":
        obj.write_bytes(obj.read_bytes()[: obj.stat().st_size // 2])
    else:
        obj.with_suffix(".sha256").unlink()
    rebuilt = _stats(_worker(tmp_path))
    assert rebuilt["compiles"] == 1 and rebuilt["disk_hits"] == 0
    again = _stats(_worker(tmp_path))  # the rebuilt object is whole again
    assert again["compiles"] == 0 and again["disk_hits"] == 1


def test_keys_of_other_archs_get_other_objects(tmp_path):
    _stats(_worker(tmp_path, arch="sm_90a"))
    _stats(_worker(tmp_path, arch="sm_100a"))
    assert len(_objects(tmp_path)) == 2


def test_disk_layer_can_be_turned_off(tmp_path):
    stats = _stats(_worker(tmp_path, CUTE_KERNELS_DISK_CACHE="0"))
    assert stats["compiles"] == 1 and _objects(tmp_path) == []


def test_strict_mode_env_makes_a_compile_raise(tmp_path):
    proc = _worker(tmp_path, CUTE_KERNELS_STRICT="1")
    _, err = proc.communicate(timeout=300)
    assert proc.returncode != 0 and "StrictModeError" in err


def test_strict_mode_allows_warm_keys_and_raises_for_new_ones(monkeypatch):
    monkeypatch.setenv("CUTE_KERNELS_DISK_CACHE", "0")
    cache = KernelCache("strict_test", lambda key: (lambda: key), lambda arch: [("a", arch)])
    cache.precompile(cache.variants("sm_90a"))
    compile_cache.set_strict(True)
    try:
        assert cache.get(("a", "sm_90a"))() == ("a", "sm_90a")
        with pytest.raises(StrictModeError, match="precompile"):
            cache.get(("b", "sm_90a"))
    finally:
        compile_cache.set_strict(False)


def test_symbols_are_unique_per_key():
    names = {compile_cache.symbol_name("kv_rope_insert", key)
             for arch in ("sm_90a", "sm_100a") for key in KERNELS.variants(arch)}
    assert len(names) == 8


class _KwargsCompiled:
    """Stands in for the DSL's compiled object with a keyword-argument wrapper: it hands out
    its bare TVM-FFI function through ``__tvm_ffi_object__``."""

    def __init__(self, key):
        self.key = key

    def __call__(self, *args):
        raise AssertionError("a fresh compile must be called through its bare function")

    def __tvm_ffi_object__(self):
        return lambda: ("bare", self.key)


def test_a_fresh_compile_is_called_through_its_bare_function(monkeypatch):
    """As a function loaded from disk is: the wrapper's Python frame is skipped, and the
    compiled object (which owns the code) stays alive with the cache."""
    monkeypatch.setenv("CUTE_KERNELS_DISK_CACHE", "0")
    cache = KernelCache("bare_test", _KwargsCompiled, lambda arch: [])
    fn = cache.get(("a", "sm_90a"))
    assert fn() == ("bare", ("a", "sm_90a"))
    assert isinstance(cache._objects[("a", "sm_90a")], _KwargsCompiled)
