"""The public surface: names, custom ops, error type, precompile + strict mode."""

from __future__ import annotations

import inspect

import pytest
import torch

import cute_kernels
from cute_kernels import compile_cache


def test_layout_error_is_a_value_error():
    assert issubclass(cute_kernels.LayoutError, ValueError)


MUTATED = {"kv_rope_insert": ["k_cache"], "compress_c128": ["k_cache"],
           "stacked_kv_proj": ["k_caches", "v_caches"]}


@pytest.mark.parametrize("name", list(MUTATED))
def test_public_function_reference_check_and_op_share_one_signature(name):
    fn = getattr(cute_kernels, name)
    ref = getattr(cute_kernels.reference, name)
    check = getattr(cute_kernels, f"check_{name}")
    params = list(inspect.signature(fn).parameters)
    assert list(inspect.signature(check).parameters) == params
    assert list(inspect.signature(ref).parameters)[: len(params)] == params
    op = getattr(torch.ops.cute_kernels, name)
    assert [a.name for a in op.default._schema.arguments] == params
    for arg in MUTATED[name]:
        assert op.default._schema.arguments[params.index(arg)].alias_info.is_write


def test_kv_rope_insert_argument_order_matches_vllm():
    assert list(inspect.signature(cute_kernels.kv_rope_insert).parameters) == [
        "kv", "k_cache", "slot_mapping", "positions", "cos_sin_cache", "block_size",
        "fp8_scale", "kv_mxfp8"]


def test_precompile_then_strict(monkeypatch, tmp_path, empty_memory):
    """A process that starts from a precompiled disk cache (its memory empty) gets every
    precompiled key from the disk in strict mode, and a key nobody precompiled raises."""
    monkeypatch.setenv("CUTE_KERNELS_CACHE_DIR", str(tmp_path))
    cache = compile_cache.families()["kv_rope_insert"]
    # (keys this process already holds from other tests are written to the disk too)
    cute_kernels.precompile(arch="sm_100a", kernels=["kv_rope_insert"])
    empty_memory(cache)  # a fresh process: nothing in memory
    stats = cute_kernels.cache_stats()
    cute_kernels.set_strict(True)
    try:
        keys = cache.variants("sm_100a")
        for key in keys:  # from the disk: no compile, no error
            cache.get(key)
        after = cute_kernels.cache_stats()
        assert after["compiles"] == stats["compiles"]
        assert after["disk_hits"] == stats["disk_hits"] + len(keys)
        with pytest.raises(cute_kernels.StrictModeError):
            cache.get(cache.variants("sm_90a")[0])  # not precompiled
    finally:
        cute_kernels.set_strict(False)


def test_precompile_bakes_a_kernel_compiled_while_the_disk_cache_was_off(monkeypatch, tmp_path,
                                                                         empty_memory):
    """A real compiled object held in memory only is exported by precompile, not compiled
    again, and a process started after it loads every key from the disk."""
    monkeypatch.setenv("CUTE_KERNELS_CACHE_DIR", str(tmp_path))
    cache = compile_cache.families()["kv_rope_insert"]
    keys = cache.variants("sm_90a")
    empty_memory(cache)
    monkeypatch.setenv("CUTE_KERNELS_DISK_CACHE", "0")
    cache.get(keys[0])
    monkeypatch.delenv("CUTE_KERNELS_DISK_CACHE")
    assert not any(tmp_path.rglob("*.o"))
    before = cute_kernels.cache_stats()
    cute_kernels.precompile(arch="sm_90a", kernels=["kv_rope_insert"])
    baked = cute_kernels.cache_stats()
    assert baked["compiles"] - before["compiles"] == len(keys) - 1  # the held one exported
    assert len(list(tmp_path.rglob("*.o"))) == len(keys)
    empty_memory(cache)  # a fresh process
    for key in keys:
        cache.get(key)
    after = cute_kernels.cache_stats()
    assert after["compiles"] == baked["compiles"]
    assert after["disk_hits"] - baked["disk_hits"] == len(keys)


def test_precompile_rejects_unknown_arch():
    with pytest.raises(cute_kernels.LayoutError, match="arch"):
        cute_kernels.precompile(arch="sm_75")


@pytest.mark.parametrize("kernels", [["kv_rope_insrt"], "kv_rope_insert", 5,
                                     ["kv_rope_insert", 3], [["kv_rope_insert"]], []])
def test_precompile_rejects_kernels_that_name_no_family(kernels, monkeypatch):
    """A misspelt or non-list ``kernels`` built nothing (strict mode then failed at the first
    call), or raised a TypeError: a LayoutError naming the argument, before anything is built."""
    built = []
    monkeypatch.setattr(cute_kernels, "build", built.append)
    with pytest.raises(cute_kernels.LayoutError,
                       match=r"^kernels: expected a list of kernel family names \(compress_c128, "
                             r"kv_rope_insert, stacked_kv_proj\) or None, got "):
        cute_kernels.precompile(arch="sm_90a", kernels=kernels)
    assert built == []
    cute_kernels.precompile(arch="sm_90a", kernels=("kv_rope_insert",))  # any sequence
    assert {family for family, _ in built[0]} == {"kv_rope_insert"}


@pytest.mark.parametrize("value", ["false", "yes", None, 2])
def test_set_strict_takes_a_bool_only(value):
    """Truthiness would turn strict mode on for set_strict("false")."""
    with pytest.raises(cute_kernels.LayoutError, match=r"^strict: expected a bool, got "):
        cute_kernels.set_strict(value)
    assert compile_cache._strict is False
