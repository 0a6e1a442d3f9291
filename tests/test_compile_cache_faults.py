"""Compile cache under faults: a full disk, an unwritable or odd cache folder, a stuck lock
holder or an untrusted folder never fails a call; the kernel is compiled in memory instead.

Most tests use a fake build (no compile) and a fake ``load_module``, so they run in
milliseconds; a few run the real subprocess worker where the real export or a second process
matters (a file-size limit, a lock held by another process, planted objects).
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import resource
import signal
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import pytest

from cute_kernels import compile_cache
from cute_kernels.compile_cache import KernelCache
from cute_kernels.kv_rope_insert import KvRopeInsertKey
from cute_kernels.layouts import CacheFormat

WORKER = Path(__file__).resolve().parent / "cache_worker.py"
IS_ROOT = os.geteuid() == 0
NOT_ROOT_REASON = "runs as root, and permission bits do not stop root (the injected variant runs)"
FAMILY = "faults_test"
KEY = ("k", "sm_90a")
OTHER_KEY = ("other", "sm_90a")


class FakeCompiled:
    """Stands in for a compiled kernel: calling it gives its key; it exports a small object."""

    def __init__(self, key: tuple[str, str]) -> None:
        self.key = key

    def __call__(self) -> tuple[str, str]:
        return self.key

    def export_to_c(self, path: str, function_name: str, export_only_tvm_ffi_symbols: bool):
        Path(path).write_bytes(f"object of {function_name}".encode())


class FakeModule:
    """What the fake ``load_module`` returns: every symbol gives the bytes of the loaded file."""

    def __init__(self, content: bytes) -> None:
        self.content = content

    def __getattr__(self, symbol: str):
        return lambda: self.content


@pytest.fixture
def root(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("CUTE_KERNELS_CACHE_DIR", str(root))
    monkeypatch.delenv("CUTE_KERNELS_DISK_CACHE", raising=False)
    monkeypatch.delenv("CUTE_KERNELS_CACHE_LOCK_TIMEOUT", raising=False)
    compile_cache.reset_cache_stats()
    return root


@pytest.fixture
def loaded(monkeypatch) -> list[Path]:
    """Paths handed to ``load_module`` (faked: the bytes are not a real object)."""
    import cutlass.cute as cute

    paths: list[Path] = []

    def load_module(path: str, enable_tvm_ffi: bool) -> FakeModule:
        paths.append(Path(path))
        return FakeModule(Path(path).read_bytes())

    monkeypatch.setattr(cute.runtime, "load_module", load_module)
    return paths


def new_cache() -> KernelCache:
    return KernelCache(FAMILY, FakeCompiled, lambda arch: [])


def folder_of(root: Path) -> Path:
    return root / compile_cache.fingerprint()


def object_path(root: Path, key=KEY) -> Path:
    return folder_of(root) / f"{compile_cache.symbol_name(FAMILY, key)}.o"


def make_folder(root: Path) -> Path:
    folder = folder_of(root)
    for directory in (root, folder):
        directory.mkdir()
        directory.chmod(0o700)
    return folder


def temp_files(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if ".tmp." in p.name)


def get_recording_warnings(cache: KernelCache, key=KEY):
    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")
        fn = cache.get(key)
    return fn, [str(r.message) for r in records if issubclass(r.category, RuntimeWarning)]


def stats() -> dict[str, float]:
    return compile_cache.cache_stats()


def run_worker(cache_dir: Path, timeout: float = 120, preexec_fn=None, **env) -> tuple[dict, str]:
    """One subprocess that gets the bf16 KV-insert kernel for sm_90a: its counters and stderr."""
    proc = subprocess.run(
        [sys.executable, str(WORKER), "bf16", "sm_90a"],
        env={**os.environ, "CUTE_KERNELS_CACHE_DIR": str(cache_dir), **env},
        capture_output=True, text=True, timeout=timeout, preexec_fn=preexec_fn,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


def worker_object(cache_dir: Path) -> Path:
    symbol = compile_cache.symbol_name("kv_rope_insert", KvRopeInsertKey(CacheFormat.BF16,
                                                                          "sm_90a"))
    return folder_of(cache_dir) / f"{symbol}.o"


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", ""])
    proc.wait()
    return proc.pid


# -- a cache that cannot be written ----------------------------------------------------------


def test_full_disk_compiles_in_memory_warns_once_and_removes_the_partial_file(root, monkeypatch):
    def export_until_the_disk_is_full(self, path, function_name, export_only_tvm_ffi_symbols):
        Path(path).write_bytes(b"\x7fELF half an object")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)

    monkeypatch.setattr(FakeCompiled, "export_to_c", export_until_the_disk_is_full)
    cache = new_cache()
    fn, messages = get_recording_warnings(cache)
    assert fn() == KEY
    folder = folder_of(root)
    assert temp_files(folder) == [] and not object_path(root).exists()
    assert len(messages) == 1
    assert str(folder) in messages[0] and os.strerror(errno.ENOSPC) in messages[0]
    assert stats()["compiles"] == 1 and stats()["disk_write_errors"] == 1

    fn, messages = get_recording_warnings(cache, OTHER_KEY)  # the same failure: no new warning
    assert fn() == OTHER_KEY and messages == []
    assert cache.get(KEY) is cache.get(KEY)  # kept in memory: no compile, no disk
    assert stats()["compiles"] == 2 and stats()["disk_write_errors"] == 2
    assert stats()["memory_hits"] == 2

    compile_cache.reset_cache_stats()
    assert set(stats().values()) == {0}


# os.<function> -> (errno it fails with, whether this call is the one to fail)
INJECTED = {
    "mkdir": ("mkdir", errno.EROFS, lambda path, *rest: Path(path).name == "cache"),
    "folder_stat": ("lstat", errno.EIO,
                    lambda path, *rest: Path(path).name == compile_cache.fingerprint()),
    "lock_open": ("open", errno.EACCES, lambda path, *rest: str(path).endswith(".lock")),
    "object_replace": ("replace", errno.EROFS, lambda src, dst, *rest: str(dst).endswith(".o")),
    "sidecar_replace": ("replace", errno.ENOSPC,
                        lambda src, dst, *rest: str(dst).endswith(".sha256")),
}


@pytest.mark.parametrize("step", list(INJECTED))
def test_an_oserror_at_any_disk_step_degrades_to_memory(root, monkeypatch, step):
    name, code, fails = INJECTED[step]
    real = getattr(os, name)

    def failing(*args, **kwargs):
        if fails(*args):
            raise OSError(code, os.strerror(code), str(args[0]))
        return real(*args, **kwargs)

    cache = new_cache()
    compile_cache.fingerprint()  # computed (it stats files) before lstat fails, in any order
    with monkeypatch.context() as patch:
        patch.setattr(os, name, failing)
        fn, messages = get_recording_warnings(cache)
    assert fn() == KEY
    assert stats()["compiles"] == 1 and stats()["disk_write_errors"] == 1
    assert len(messages) == 1 and os.strerror(code) in messages[0]
    if folder_of(root).exists():
        assert temp_files(folder_of(root)) == []


def test_file_size_limit_in_a_real_export_fails_no_call(root):
    def limit_file_size() -> None:
        # Ignored SIGXFSZ makes a write past the limit fail with EFBIG instead of killing us.
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))  # the object is ~27 KB

    counters, err = run_worker(root, preexec_fn=limit_file_size)
    assert counters["compiles"] == 1 and counters["disk_write_errors"] == 1
    assert os.strerror(errno.EFBIG) in err and str(folder_of(root)) in err
    assert temp_files(folder_of(root)) == [] and not worker_object(root).exists()


def test_read_only_folder_still_serves_its_objects(root, loaded):
    new_cache().get(KEY)  # publishes
    folder_of(root).chmod(0o500)
    fn, messages = get_recording_warnings(new_cache())
    assert loaded == [object_path(root)] and fn() == object_path(root).read_bytes()
    assert messages == [] and stats()["disk_hits"] == 1


@pytest.mark.skipif(IS_ROOT, reason=NOT_ROOT_REASON)
def test_read_only_folder_without_the_object_compiles_in_memory(root, loaded):
    make_folder(root).chmod(0o500)
    fn, messages = get_recording_warnings(new_cache())
    assert fn() == KEY and loaded == []
    assert len(messages) == 1 and str(folder_of(root)) in messages[0]
    assert stats()["disk_write_errors"] == 1 and list(folder_of(root).iterdir()) == []


# -- precompile writes what memory holds ----------------------------------------------------


def fill_the_disk(self, path, function_name, export_only_tvm_ffi_symbols):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)


@pytest.mark.parametrize("first_compile", ["disk full", "disk cache off"])
def test_precompile_writes_a_key_this_process_holds_but_the_disk_lacks(root, loaded, monkeypatch,
                                                                       first_compile):
    """An image baked by a process that compiled a key while its disk could not take it: the
    process's own compiled object is written, no second compile, and a fresh process loads
    it."""
    cache = new_cache()
    with monkeypatch.context() as patch, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if first_compile == "disk full":
            patch.setattr(FakeCompiled, "export_to_c", fill_the_disk)
        else:
            patch.setenv("CUTE_KERNELS_DISK_CACHE", "0")
        assert cache.get(KEY)() == KEY
    assert not object_path(root).exists() and stats()["compiles"] == 1

    cache.precompile([KEY])
    assert object_path(root).read_bytes() == f"object of {object_path(root).stem}".encode()
    assert stats()["compiles"] == 1 and stats()["memory_hits"] == 1 and loaded == []
    fresh = new_cache()  # another process
    assert fresh.get(KEY)() == object_path(root).read_bytes()
    assert loaded == [object_path(root)] and stats()["compiles"] == 1


def test_precompile_leaves_a_key_on_the_disk_as_it_is(root, loaded):
    cache = new_cache()
    cache.get(KEY)  # compiles and publishes
    before = os.lstat(object_path(root))
    cache.precompile([KEY])
    after = os.lstat(object_path(root))
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    assert stats()["compiles"] == 1 and loaded == []  # the file checked, not loaded


def test_precompile_rebuilds_a_held_key_whose_file_was_removed(root, loaded):
    """A key loaded from the disk has no compiled object in the process: with its file gone,
    precompile compiles it again, except in strict mode (no compile; the key still served)."""
    new_cache().get(KEY)  # publishes
    cache = new_cache()
    cache.get(KEY)  # loaded
    assert stats()["compiles"] == 1 and stats()["disk_hits"] == 1
    for path in (object_path(root), object_path(root).with_suffix(".sha256")):
        path.unlink()
    compile_cache.set_strict(True)
    try:
        cache.precompile([KEY])
        assert cache.get(KEY)() == f"object of {object_path(root).stem}".encode()
    finally:
        compile_cache.set_strict(False)
    assert not object_path(root).exists() and stats()["compiles"] == 1
    cache.precompile([KEY])
    assert stats()["compiles"] == 2 and object_path(root).exists()
    assert new_cache().get(KEY)() == object_path(root).read_bytes()


# -- a lock holder that never lets go -------------------------------------------------------


def test_a_held_lock_times_out_and_compiles_in_memory(root, loaded, monkeypatch):
    folder = make_folder(root)
    lock_path = object_path(root).with_suffix(".lock")
    holder = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)  # its own open file: a rival
    fcntl.flock(holder, fcntl.LOCK_EX)
    monkeypatch.setenv("CUTE_KERNELS_CACHE_LOCK_TIMEOUT", "0.3")
    # In a thread, so that a wait without a timeout fails the test instead of hanging it.
    results = []
    getter = threading.Thread(target=lambda: results.append(get_recording_warnings(new_cache())))
    start = time.monotonic()
    getter.start()
    try:
        getter.join(timeout=10)
        waited = time.monotonic() - start
        assert not getter.is_alive(), "the call waits for a held lock without a timeout"
    finally:
        os.close(holder)
        getter.join()
    ((fn, messages),) = results
    assert fn() == KEY and 0.3 <= waited < 5
    assert stats()["disk_lock_timeouts"] == 1 and stats()["compiles"] == 1
    assert not object_path(root).exists()  # a timed-out process does not publish
    assert len(messages) == 1 and str(lock_path) in messages[0]
    assert "CUTE_KERNELS_CACHE_LOCK_TIMEOUT" in messages[0]

    new_cache().get(KEY)  # the lock is free again: this one publishes
    assert object_path(root).exists() and temp_files(folder) == []


HOLD_LOCK = """
import fcntl, sys, time
lock = open(sys.argv[1], "a+")
fcntl.flock(lock, fcntl.LOCK_EX)
print("held", flush=True)
time.sleep(600)
"""


def test_a_stuck_lock_holder_process_does_not_block_start_up(root):
    make_folder(root)
    lock_path = worker_object(root).with_suffix(".lock")
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(lock_path)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        start = time.monotonic()
        counters, err = run_worker(root, timeout=60, CUTE_KERNELS_CACHE_LOCK_TIMEOUT="1")
        elapsed = time.monotonic() - start
    finally:
        holder.kill()
        holder.wait()
    assert counters["disk_lock_timeouts"] == 1 and counters["compiles"] == 1
    assert 1 <= elapsed < 30 and str(lock_path) in err
    assert not worker_object(root).exists()


@pytest.mark.parametrize("raw", ["abc", "-1", "nan", ""])
def test_an_invalid_lock_timeout_falls_back_to_the_default_with_a_warning(monkeypatch, raw):
    monkeypatch.setenv("CUTE_KERNELS_CACHE_LOCK_TIMEOUT", raw)
    with pytest.warns(RuntimeWarning, match="CUTE_KERNELS_CACHE_LOCK_TIMEOUT"):
        assert compile_cache.lock_timeout() == compile_cache.DEFAULT_LOCK_TIMEOUT


@pytest.mark.parametrize("raw, seconds", [(None, 30.0), ("2.5", 2.5), ("0", 0.0)])
def test_a_valid_lock_timeout_is_used(monkeypatch, raw, seconds):
    if raw is None:
        monkeypatch.delenv("CUTE_KERNELS_CACHE_LOCK_TIMEOUT", raising=False)
    else:
        monkeypatch.setenv("CUTE_KERNELS_CACHE_LOCK_TIMEOUT", raw)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert compile_cache.lock_timeout() == seconds


# -- debris of killed publishers and squatters ------------------------------------------------


def test_publisher_removes_temp_files_of_dead_publishers_but_not_live_ones(root):
    folder = make_folder(root)
    obj = object_path(root)
    dead, live = dead_pid(), os.getppid()
    stale = [folder / f"{obj.name}.tmp.{dead}", folder / f"{obj.stem}.sha256.tmp.{dead}",
             folder / f"{obj.name}.tmp.{os.getpid()}"]  # this process's, from a failed publish
    old_but_live = folder / f"{obj.stem}.sha256.tmp.{live}"  # its pid was reused since
    young_and_live = folder / f"{obj.name}.tmp.{live}"
    for path in (*stale, old_but_live, young_and_live):
        path.write_bytes(b"partial")
    an_hour_ago = time.time() - 3600
    os.utime(old_but_live, (an_hour_ago, an_hour_ago))

    assert new_cache().get(KEY)() == KEY
    assert temp_files(folder) == [young_and_live.name]
    assert obj.read_bytes() == f"object of {obj.stem}".encode()


def test_first_use_of_a_folder_sweeps_temp_files_of_keys_nobody_requests(root):
    folder = make_folder(root)
    abandoned = folder / f"cute_kernels_gone_{'0' * 24}.o.tmp.{dead_pid()}"
    busy_symbol = f"cute_kernels_busy_{'1' * 24}"
    busy = folder / f"{busy_symbol}.o.tmp.{dead_pid()}"
    for path in (abandoned, busy):
        path.write_bytes(b"partial")
    busy_lock = os.open(folder / f"{busy_symbol}.lock", os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(busy_lock, fcntl.LOCK_EX)  # a publisher at work on that key: leave it alone
    try:
        new_cache().get(KEY)
    finally:
        os.close(busy_lock)
    assert temp_files(folder) == [busy.name]


def _plant(path: Path, kind: str, tmp_path: Path) -> None:
    if kind == "symlink":
        path.symlink_to(tmp_path / "elsewhere")
    else:
        path.mkdir()
        if kind == "full_directory":
            (path / "someone's file").write_text("keep me")


@pytest.mark.parametrize("where", [".o", ".sha256", ".lock"])
@pytest.mark.parametrize("kind", ["empty_directory", "symlink"])
def test_a_removable_squatter_is_cleared_and_the_key_published(root, tmp_path, loaded, where,
                                                              kind):
    folder = make_folder(root)
    obj = object_path(root)
    for suffix in (".o", ".sha256"):  # the other file of the pair exists: a load is attempted
        if suffix != where:
            obj.with_suffix(suffix).write_text("x")
    _plant(obj.with_suffix(where), kind, tmp_path)
    fn, messages = get_recording_warnings(new_cache())
    assert fn() == KEY and messages == [] and stats()["disk_write_errors"] == 0
    assert not (tmp_path / "elsewhere").exists()  # nothing was written through a link
    assert all(obj.with_suffix(s).is_file() for s in (".o", ".sha256", ".lock"))
    assert new_cache().get(KEY)() == obj.read_bytes()  # a fresh cache loads it from disk
    assert temp_files(folder) == []


@pytest.mark.parametrize("where", [".o", ".sha256", ".lock"])
def test_a_directory_with_content_on_a_cache_path_is_kept_and_the_key_compiled_in_memory(
        root, tmp_path, where):
    make_folder(root)
    squatter = object_path(root).with_suffix(where)
    _plant(squatter, "full_directory", tmp_path)
    fn, messages = get_recording_warnings(new_cache())
    assert fn() == KEY and stats()["disk_write_errors"] == 1
    assert len(messages) == 1 and str(squatter) in messages[0]
    assert (squatter / "someone's file").read_text() == "keep me"
    assert temp_files(folder_of(root)) == []


# -- trust -----------------------------------------------------------------------------------


def _mode(path: Path) -> int:
    return path.stat().st_mode & 0o777


@pytest.mark.parametrize("umask", [0o000, 0o277])  # all bits to others / owner bits dropped
def test_cache_is_created_private_whatever_the_umask(root, umask):
    old_umask = os.umask(umask)
    try:
        new_cache().get(KEY)
    finally:
        os.umask(old_umask)
    obj = object_path(root)
    assert (_mode(root), _mode(folder_of(root))) == (0o700, 0o700)
    assert (_mode(obj), _mode(obj.with_suffix(".sha256"))) == (0o600, 0o600)
    assert _mode(obj.with_suffix(".lock")) & 0o077 == 0


@pytest.mark.parametrize("which", ["root", "fingerprint_folder"])
@pytest.mark.parametrize("mode", [0o777, 0o770])
def test_planted_object_in_a_writable_folder_is_never_loaded(root, loaded, which, mode):
    new_cache().get(KEY)  # a valid object and sidecar: what an attacker would plant
    obj = object_path(root)
    planted = obj.read_bytes()
    listing = sorted(folder_of(root).iterdir())
    directory = root if which == "root" else folder_of(root)
    directory.chmod(mode)
    compile_cache.reset_cache_stats()

    fn, messages = get_recording_warnings(new_cache())
    assert fn() == KEY and loaded == []
    assert stats()["disk_hits"] == 0 and stats()["disk_untrusted"] == 1
    assert len(messages) == 1 and str(directory) in messages[0] and f"{mode:04o}" in messages[0]
    assert sorted(folder_of(root).iterdir()) == listing and obj.read_bytes() == planted

    directory.chmod(0o700)  # refused for the rest of the process, even once repaired
    assert new_cache().get(KEY)() == KEY and loaded == []
    assert stats()["disk_untrusted"] == 2


def _owned_by_another_user(monkeypatch, root: Path) -> None:
    if IS_ROOT:
        os.chown(root, 65534, 65534)
    else:  # only root can give a file away: pretend to be someone else instead
        euid = os.geteuid()
        monkeypatch.setattr(os, "geteuid", lambda: euid + 1)


def test_a_folder_owned_by_another_user_is_refused(root, loaded, monkeypatch):
    new_cache().get(KEY)
    _owned_by_another_user(monkeypatch, root)
    fn, messages = get_recording_warnings(new_cache())
    assert fn() == KEY and loaded == [] and stats()["disk_untrusted"] == 1
    assert len(messages) == 1 and "owned by uid" in messages[0] and str(root) in messages[0]


def test_a_symlink_to_a_private_folder_is_used(tmp_path, root, loaded):
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    root.symlink_to(real)
    new_cache().get(KEY)
    assert new_cache().get(KEY)() == object_path(root).read_bytes() and len(loaded) == 1


def test_a_symlink_to_a_writable_folder_is_refused(tmp_path, root, loaded):
    real = tmp_path / "real"
    real.mkdir()
    real.chmod(0o777)
    root.symlink_to(real)
    fn, messages = get_recording_warnings(new_cache())
    assert fn() == KEY and stats()["disk_untrusted"] == 1 and list(real.iterdir()) == []
    assert len(messages) == 1 and "writable by group or others" in messages[0]


@pytest.mark.skipif(not IS_ROOT, reason="only root can create a symlink owned by another user")
def test_a_symlink_owned_by_another_user_is_refused(tmp_path, root, loaded):
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    root.symlink_to(real)
    os.lchown(root, 65534, 65534)
    fn, messages = get_recording_warnings(new_cache())
    assert fn() == KEY and stats()["disk_untrusted"] == 1 and list(real.iterdir()) == []
    assert len(messages) == 1 and "symlink owned by uid 65534" in messages[0]


def test_an_object_writable_by_others_is_rebuilt_not_loaded(root, loaded):
    new_cache().get(KEY)
    obj = object_path(root)
    obj.chmod(0o666)
    assert new_cache().get(KEY)() == KEY and loaded == []
    assert stats()["compiles"] == 2 and _mode(obj) == 0o600
    assert new_cache().get(KEY)() == obj.read_bytes() and loaded == [obj]


def test_planted_objects_in_a_world_writable_cache_are_not_loaded_by_a_real_process(root):
    first, _ = run_worker(root)
    assert first["compiles"] == 1
    obj = worker_object(root)
    planted = obj.read_bytes()
    root.chmod(0o777)
    counters, err = run_worker(root)
    assert counters["disk_hits"] == 0 and counters["compiles"] == 1
    assert counters["disk_untrusted"] == 1
    assert str(root) in err and "writable by group or others" in err
    assert obj.read_bytes() == planted
