"""Compile cache: each kernel is built once per layout key, never once per token count.

L1 is an in-process dict guarded by one lock per key, so concurrent first calls compile once.
L2 is an on-disk ``.o`` cache (``export_to_c`` / ``load_module``) under a fingerprint of this
package's sources, the CuTe DSL / TVM-FFI / Python versions and the host platform; the arch is
part of every key. Writers take an exclusive ``flock`` per key and publish with ``os.replace``;
each object has a SHA-256 sidecar written last, so a corrupt or truncated object is detected,
removed and rebuilt.

The disk is an optimisation, never a reason for a call to fail: a full disk, an unwritable
folder, a lock held too long or an untrusted folder make that key compile in memory instead,
with one warning per folder and kind of failure and a counter in :func:`cache_stats`.

Trust: loading an object runs its code. The cache folder and its fingerprint sub-folder are
created ``0700`` and used only while they are owned by the effective user and not writable by
group or others (a symlink must be owned by that user too, and its target passes the same
test); otherwise the process warns once and stays memory-only for that folder. Objects that
are not private to the user are rebuilt, never loaded.

Environment:
  ``CUTE_KERNELS_CACHE_DIR``           disk cache directory (default
                                       ``$XDG_CACHE_HOME/cute_kernels``)
  ``CUTE_KERNELS_DISK_CACHE``          ``0`` turns the disk layer off
  ``CUTE_KERNELS_CACHE_LOCK_TIMEOUT``  seconds to wait for another process's per-key lock
                                       (default 30) before compiling in memory
  ``CUTE_KERNELS_STRICT``              ``1`` starts the process in strict mode
                                       (see :func:`set_strict`)
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import hashlib
import importlib.metadata
import os
import platform
import re
import stat
import sys
import threading
import time
import warnings
from collections.abc import Callable, Hashable, Iterable, Iterator
from pathlib import Path
from typing import Any, Protocol

from .validation import expect_bool

CACHE_DIR_ENV = "CUTE_KERNELS_CACHE_DIR"
DISK_CACHE_ENV = "CUTE_KERNELS_DISK_CACHE"
LOCK_TIMEOUT_ENV = "CUTE_KERNELS_CACHE_LOCK_TIMEOUT"
STRICT_ENV = "CUTE_KERNELS_STRICT"

# Long enough for another process to finish a cold compile of one key (seconds), short enough
# that a stuck holder delays start-up by one bounded wait instead of forever.
DEFAULT_LOCK_TIMEOUT = 30.0
# A released lock is noticed within this; a disk hit costs milliseconds, a compile about a second.
_LOCK_POLL_SECONDS = 0.05
# A publisher's temp file lives for the milliseconds of one export: one untouched for this long
# belongs to no publisher at work, even if its pid now names an unrelated live process.
_STALE_TEMP_SECONDS = 600.0
# "<symbol>.o.tmp.<pid>" and "<symbol>.sha256.tmp.<pid>", as _publish names them.
_TEMP_NAME = re.compile(r"(?P<symbol>.+)\.(?:o|sha256)\.tmp\.(?P<pid>[0-9]+)")


class StrictModeError(RuntimeError):
    """A kernel had to be compiled while strict mode was on (after warm-up)."""


class CompileKey(Protocol):
    """A frozen dataclass holding every fact that changes generated code, and its arch."""

    arch: str


@dataclasses.dataclass
class _Counters:
    compiles: int = 0
    memory_hits: int = 0
    disk_hits: int = 0
    compile_seconds: float = 0.0
    disk_load_seconds: float = 0.0
    disk_write_errors: int = 0  # keys kept in memory only: the cache could not be written
    disk_lock_timeouts: int = 0  # keys kept in memory only: another process held the lock
    disk_untrusted: int = 0  # keys kept in memory only: the cache folder was refused


_counters = _Counters()
_counters_lock = threading.Lock()
# cute.compile keeps MLIR state per thread and is documented as not thread-safe: one compile at
# a time in the process. Per-key locks (below) make concurrent first calls of one key wait for
# that single compile instead of compiling again.
_compile_lock = threading.Lock()
_strict = os.environ.get(STRICT_ENV, "0") == "1"

# Process-wide disk state, guarded by one lock: warnings already given, cache roots refused as
# untrusted (refused for the rest of the process, so no object from them is ever loaded) and
# folders already swept for stale temp files.
_disk_state_lock = threading.Lock()
_warned: set[tuple[Hashable, ...]] = set()
_refused_roots: set[str] = set()
_swept_folders: set[str] = set()


def set_strict(strict: bool = True) -> None:
    """In strict mode any compile raises :class:`StrictModeError` (loads from disk still work).

    Serving engines call :func:`cute_kernels.precompile` at start-up, then turn this on so that
    a layout they did not warm up fails loudly instead of stalling a step for seconds.
    """
    global _strict
    _strict = expect_bool(strict, "strict")  # not truthiness: set_strict("false") stays off


def cache_stats() -> dict[str, float]:
    """Counters of the process: compiles, memory hits, disk hits and seconds spent, and the keys
    compiled in memory only because the disk cache could not be written
    (``disk_write_errors``), its lock was held too long (``disk_lock_timeouts``) or its folder
    is not trusted (``disk_untrusted``)."""
    with _counters_lock:
        return dataclasses.asdict(_counters)


def reset_cache_stats() -> None:
    with _counters_lock:
        for field in dataclasses.fields(_Counters):
            setattr(_counters, field.name, field.default)


def _count(**deltas: float) -> None:
    with _counters_lock:
        for name, delta in deltas.items():
            setattr(_counters, name, getattr(_counters, name) + delta)


def _warn_once(reason: tuple[Hashable, ...], message: str) -> None:
    """Warn the first time for each reason (folder, kind of failure): a full disk fails every key
    the same way, and one warning says all there is to say."""
    with _disk_state_lock:
        if reason in _warned:
            return
        _warned.add(reason)
    # stacklevel 2 attributes it to this module, so `-W ignore:::cute_kernels.compile_cache`
    # silences it without hiding anyone else's RuntimeWarning.
    warnings.warn(message, RuntimeWarning, stacklevel=2)


def disk_cache_dir() -> Path | None:
    if os.environ.get(DISK_CACHE_ENV, "1") == "0":
        return None
    root = os.environ.get(CACHE_DIR_ENV)
    if root is None:
        xdg = os.environ.get("XDG_CACHE_HOME", os.path.join(os.path.expanduser("~"), ".cache"))
        root = os.path.join(xdg, "cute_kernels")
    return Path(root)


def lock_timeout() -> float:
    """Seconds to wait for another process's lock on a key (``CUTE_KERNELS_CACHE_LOCK_TIMEOUT``).

    A value that is not a number of seconds >= 0 falls back to the default with a warning: a
    typo in the environment must not stop a serving process. ``inf`` waits forever.
    """
    raw = os.environ.get(LOCK_TIMEOUT_ENV)
    if raw is None:
        return DEFAULT_LOCK_TIMEOUT
    try:
        seconds = float(raw)
    except ValueError:
        seconds = float("nan")
    if not seconds >= 0:  # also false for nan
        _warn_once(
            ("lock timeout value", raw),
            f"cute_kernels: {LOCK_TIMEOUT_ENV}={raw!r} is not a number of seconds >= 0; "
            f"using {DEFAULT_LOCK_TIMEOUT:g}",
        )
        return DEFAULT_LOCK_TIMEOUT
    return seconds


_fingerprint: str | None = None


def fingerprint() -> str:
    """Hash of everything besides the key that changes a compiled object."""
    global _fingerprint
    if _fingerprint is None:
        h = hashlib.sha256()
        package = Path(__file__).resolve().parent
        for source in sorted(package.rglob("*.py")):
            h.update(source.relative_to(package).as_posix().encode())
            h.update(source.read_bytes())
        dists = sorted(
            f"{d.metadata['Name']}=={d.version}"
            for d in importlib.metadata.distributions()
            if (d.metadata["Name"] or "").lower().startswith(("nvidia-cutlass-dsl", "apache-tvm"))
        )
        import cutlass
        import tvm_ffi

        for part in (
            *dists,
            cutlass.__version__,
            tvm_ffi.__version__,
            f"py{sys.version_info[0]}.{sys.version_info[1]}",
            platform.machine(),
            platform.system(),
        ):
            h.update(part.encode())
        _fingerprint = h.hexdigest()[:20]
    return _fingerprint


_families: dict[str, KernelCache] = {}


def families() -> dict[str, KernelCache]:
    """Every kernel family's cache, by family name (filled as kernel modules are imported)."""
    return dict(_families)


def symbol_name(family: str, key: Hashable) -> str:
    """A unique exported symbol per key, so no two loaded objects can shadow each other."""
    digest = hashlib.sha256(repr(key).encode()).hexdigest()[:24]
    return f"cute_kernels_{family}_{digest}"


def _sha256_file(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# -- the cache folder: creation and trust ----------------------------------------------------


_WRITABLE_BY_OTHERS = stat.S_IWGRP | stat.S_IWOTH


def _private_to_user(st: os.stat_result) -> bool:
    """Owned by the effective user and writable by nobody else, so nobody else can plant code."""
    return st.st_uid == os.geteuid() and not st.st_mode & _WRITABLE_BY_OTHERS


def _untrusted_reason(directory: Path) -> str | None:
    """Why ``directory`` must not be used as a cache folder, or None when it may."""
    st = os.lstat(directory)
    if stat.S_ISLNK(st.st_mode):
        # Whoever owns the link can point it somewhere else at any time.
        if st.st_uid != os.geteuid():
            return f"is a symlink owned by uid {st.st_uid}, not by this user (uid {os.geteuid()})"
        st = os.stat(directory)
    if not stat.S_ISDIR(st.st_mode):
        return "is not a directory"
    if st.st_uid != os.geteuid():
        return f"is owned by uid {st.st_uid}, not by this user (uid {os.geteuid()})"
    if st.st_mode & _WRITABLE_BY_OTHERS:
        return f"is writable by group or others (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


def _make_private_dir(directory: Path) -> None:
    """Create ``directory`` with mode 0700 unless it exists (an existing one is checked, never
    changed: its owner chose its mode)."""
    try:
        os.mkdir(directory, 0o700)
    except FileExistsError:
        return
    # mkdir's mode passes through the umask, which may also drop the owner's own bits.
    os.chmod(directory, 0o700)


def _cache_folder(root: Path) -> Path | None:
    """The fingerprint folder under ``root``, created and checked; None: use no disk for this key
    (already warned and counted)."""
    with _disk_state_lock:
        refused = str(root) in _refused_roots
    if refused:
        _count(disk_untrusted=1)
        return None
    folder = root / fingerprint()
    try:
        root.parent.mkdir(parents=True, exist_ok=True)
        for directory in (root, folder):  # the root is checked before anything is made in it
            _make_private_dir(directory)
            reason = _untrusted_reason(directory)
            if reason is not None:
                _refuse_root(root, directory, reason)
                return None
    except OSError as error:
        _disk_failure(root, "create the cache folder", error)
        return None
    _sweep_stale_temps_once(folder)
    return folder


def _refuse_root(root: Path, directory: Path, reason: str) -> None:
    with _disk_state_lock:
        _refused_roots.add(str(root))
    _count(disk_untrusted=1)
    _warn_once(
        (str(root), "untrusted"),
        f"cute_kernels: not using the compile cache {root}: {directory} {reason}. Loading a "
        "cached object runs its code, so the cache folder must be owned by this user and not "
        "writable by group or others (`chmod go-w` it, or set CUTE_KERNELS_CACHE_DIR); this "
        "process compiles every kernel in memory only.",
    )


def _disk_failure(directory: Path, action: str, error: OSError) -> None:
    _count(disk_write_errors=1)
    _warn_once(
        (str(directory), action, error.errno),
        f"cute_kernels: could not {action} in the compile cache {directory}: {error}. Kernels "
        "that need it are compiled in memory only (calls still work; other processes compile "
        "them again).",
    )


# -- lock files, squatters and stale temp files ----------------------------------------------


def _unlink_quietly(path: Path) -> None:
    """Best-effort removal: a file that cannot be removed now is removed by a later publisher."""
    try:
        path.unlink(missing_ok=True)
    except OSError:
        pass


def _remove_squatter(path: Path) -> None:
    """Make ``path`` free or a regular file. Nothing but regular files is ever put at an object,
    sidecar or lock path, so an empty directory or a link, fifo or socket there is debris to
    remove (unlinking a name never touches a link's target); a non-empty directory may hold
    someone's data, so it is left alone and the OSError from ``rmdir`` goes to the caller."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        os.rmdir(path)
    elif not stat.S_ISREG(st.st_mode):
        path.unlink()


def _open_lock(path: Path) -> int:
    # O_NOFOLLOW: a symlink planted at the lock path must not make us create files elsewhere.
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        return os.open(path, flags, 0o600)
    except OSError as error:
        if error.errno not in (errno.EISDIR, errno.ELOOP):
            raise
    _remove_squatter(path)
    return os.open(path, flags, 0o600)


def _try_flock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _flock_within(fd: int, timeout: float) -> bool:
    """Take the exclusive lock, polling until ``timeout`` seconds have passed (a blocking
    ``flock`` has no timeout, and a stuck holder would block start-up forever)."""
    deadline = time.monotonic() + timeout
    while not _try_flock(fd):
        if time.monotonic() >= deadline:
            return False
        time.sleep(_LOCK_POLL_SECONDS)
    return True


def _pid_alive(pid: int) -> bool:
    if pid <= 0:  # kill(0 or negative) would address process groups, not one pid
        return False
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def _remove_stale_temps(folder: Path, symbol: str) -> None:
    """Remove the temp files of ``symbol`` left by publishers that died mid-publish. The caller
    holds the key's ``flock``, so no publisher of the key is at work in any process; still, a
    recent file of another live process is kept, because it would be that process's to lose."""
    try:
        names = os.listdir(folder)
    except OSError:  # a folder that cannot be listed is reported by the step that writes it
        return
    for name in names:
        match = _TEMP_NAME.fullmatch(name)
        if match is None or match["symbol"] != symbol:
            continue
        path = folder / name
        pid = int(match["pid"])
        try:
            age = time.time() - path.lstat().st_mtime
        except OSError:
            continue
        if pid != os.getpid() and _pid_alive(pid) and age < _STALE_TEMP_SECONDS:
            continue
        _unlink_quietly(path)


def _sweep_stale_temps_once(folder: Path) -> None:
    """On a process's first use of a folder, clean up temp files of every key whose lock is
    free: a key no one requests again would otherwise keep its debris forever. Best effort: a
    folder that cannot be listed or written is reported by the steps that need it."""
    with _disk_state_lock:
        if str(folder) in _swept_folders:
            return
        _swept_folders.add(str(folder))
    try:
        names = os.listdir(folder)
    except OSError:
        return
    for symbol in sorted({m["symbol"] for m in map(_TEMP_NAME.fullmatch, names) if m}):
        try:
            fd = _open_lock(folder / f"{symbol}.lock")
        except OSError:
            continue
        try:
            if _try_flock(fd):  # a busy key is cleaned by the publisher holding its lock
                _remove_stale_temps(folder, symbol)
        except OSError:
            pass
        finally:
            os.close(fd)


def _drop(obj: Path) -> None:
    """Remove a compiled object and its checksum sidecar (it is rebuilt)."""
    for path in (obj, obj.with_suffix(".sha256")):
        _unlink_quietly(path)


def _verified(obj: Path) -> bool:
    """Whether ``obj`` and its checksum sidecar are regular files private to this user whose
    checksum holds. A pair that is not private (never run it) or does not match is removed;
    missing files and squatters (not regular files) answer False and stay: the publisher
    clears those under the key's lock."""
    checksum = obj.with_suffix(".sha256")
    try:
        obj_stat = os.lstat(obj)
        sum_stat = os.lstat(checksum)
    except OSError:  # missing (an unreadable folder is reported by the lock step)
        return False
    if not (stat.S_ISREG(obj_stat.st_mode) and stat.S_ISREG(sum_stat.st_mode)):
        return False
    try:
        if _private_to_user(obj_stat) and _sha256_file(obj) == checksum.read_text().strip():
            return True
    except (OSError, ValueError):  # unreadable, or a sidecar that is not text
        pass
    _drop(obj)
    return False


@contextlib.contextmanager
def _key_flock(folder: Path, symbol: str) -> Iterator[bool]:
    """Hold ``symbol``'s lock file in ``folder`` (an ``flock``: one publisher of a key across
    processes). Yields False where it cannot be had, the reason reported (a lock that cannot
    be opened or taken, a holder past the timeout): the caller then keeps to memory."""
    lock_path = folder / f"{symbol}.lock"
    try:
        lock_fd = _open_lock(lock_path)
    except OSError as error:
        _disk_failure(folder, "open a lock file", error)
        yield False
        return
    try:
        timeout = lock_timeout()
        try:
            locked = _flock_within(lock_fd, timeout)  # another process may be writing this key
        except OSError as error:  # e.g. ENOLCK: a filesystem without flock
            _disk_failure(folder, "lock a key", error)
            yield False
            return
        if not locked:
            _count(disk_lock_timeouts=1)
            _warn_once(
                (str(folder), "lock timeout"),
                f"cute_kernels: another process held {lock_path} for more than {timeout:g} s "
                f"(stuck, or compiling slowly); keeping its kernels in memory only. Set "
                f"{LOCK_TIMEOUT_ENV} to wait longer.",
            )
        yield locked
    finally:
        os.close(lock_fd)  # releases the flock


class KernelCache:
    """Compiled kernels of one family, keyed by the family's frozen ``CompileKey``."""

    def __init__(
        self,
        family: str,
        build: Callable[[Any], Any],
        variants: Callable[[str], list[Any]],
    ) -> None:
        self.family = family
        self._build = build
        self.variants = variants  # arch -> every key the family compiles for that arch
        self._compiled: dict[Hashable, Callable[..., Any]] = {}
        self._key_locks: dict[Hashable, threading.Lock] = {}
        self._key_locks_guard = threading.Lock()
        self._modules: list[Any] = []  # loaded modules outlive their functions
        # this process's compiled objects by key: they own their functions' code, and precompile
        # writes one to the disk for a key held in memory but missing there
        self._objects: dict[Hashable, Any] = {}
        _families[family] = self

    def get(self, key: CompileKey) -> Callable[..., Any]:
        fn = self._compiled.get(key)
        if fn is not None:
            _count(memory_hits=1)
            return fn
        with self._key_lock(key):
            fn = self._compiled.get(key)
            if fn is not None:
                _count(memory_hits=1)
                return fn
            fn = self._load_or_compile(key)
            self._compiled[key] = fn
            return fn

    def precompile(self, keys: Iterable[CompileKey]) -> None:
        """Each key in memory and, where the disk cache is on, on the disk: a key this process
        already holds (compiled while the disk cache was off, full or elsewhere, or its file
        removed since) is written there too, so that a process started after it loads every key
        precompiled (an image baked after the process's own calls holds them all). In strict
        mode a key whose file was removed stays off the disk (writing it needs a compile)."""
        for key in keys:
            if key not in self._compiled:
                self.get(key)
                continue
            _count(memory_hits=1)
            with self._key_lock(key):
                self._persist(key)

    def _key_lock(self, key: CompileKey) -> threading.Lock:
        """The lock of ``key`` among this process's threads (one compile of a key at a time)."""
        with self._key_locks_guard:
            return self._key_locks.setdefault(key, threading.Lock())

    def build(self, key: CompileKey) -> Callable[..., Any]:
        """A fresh compile that bypasses both levels (the CLI times compiles with it)."""
        with _compile_lock:
            return self._build(key)

    # -- levels below L1 -------------------------------------------------------------------

    def _object_path(self, key: CompileKey) -> Path | None:
        """Where ``key``'s compiled object lives (None: no usable disk cache)."""
        root = disk_cache_dir()
        folder = None if root is None else _cache_folder(root)
        return None if folder is None else folder / f"{symbol_name(self.family, key)}.o"

    def _load_or_compile(self, key: CompileKey) -> Callable[..., Any]:
        obj = self._object_path(key)
        if obj is None:
            return self._compile(key)
        folder, symbol = obj.parent, obj.stem
        fn = self._load(obj, symbol)
        if fn is not None:
            return fn
        with _key_flock(folder, symbol) as locked:
            if not locked:
                return self._compile(key)
            fn = self._load(obj, symbol)  # another process may have written it meanwhile
            if fn is not None:
                return fn
            _remove_stale_temps(folder, symbol)
            compiled = self._compile_object(key)
            self._write(compiled, obj, symbol)
            return self._entry(compiled)

    def _persist(self, key: CompileKey) -> None:
        """Write ``key``, held in memory, to the disk cache if it is not there (see
        :meth:`precompile`): this process's own compile of it, or a fresh one where it came
        from a file since removed; strict mode forbids that compile, and the key, served from
        memory, is then left off the disk."""
        obj = self._object_path(key)
        if obj is None or _verified(obj):
            return
        folder, symbol = obj.parent, obj.stem
        with _key_flock(folder, symbol) as locked:
            if not locked or _verified(obj):
                return
            _remove_stale_temps(folder, symbol)
            compiled = self._objects.get(key)
            if compiled is None:
                if _strict:
                    return
                compiled = self._compile_object(key)
            self._write(compiled, obj, symbol)

    def _write(self, compiled: Any, obj: Path, symbol: str) -> None:
        """Publish ``compiled`` as ``obj``; a disk that refuses it is reported, not raised (the
        kernel is served from memory)."""
        try:
            self._publish(compiled, obj, symbol)
        except OSError as error:
            _disk_failure(obj.parent, "write a compiled object", error)

    def _entry(self, compiled: Any) -> Callable[..., Any]:
        """What a call of a fresh compile runs: its bare TVM-FFI function, as a function
        loaded from the disk cache is (the compiled object's own ``__call__`` goes through the
        DSL's Python keyword-argument wrapper first, ~1 µs a call); the object, which owns
        the code, stays alive in ``_objects``."""
        unwrap = getattr(compiled, "__tvm_ffi_object__", None)  # the DSL's kwargs class has it
        bare = unwrap() if callable(unwrap) else None
        return compiled if bare is None else bare

    def _compile(self, key: CompileKey) -> Callable[..., Any]:
        return self._entry(self._compile_object(key))

    def _compile_object(self, key: CompileKey) -> Any:
        if _strict:
            raise StrictModeError(
                f"cute_kernels: {self.family} kernel for {key} is not compiled and strict mode "
                "is on; call cute_kernels.precompile(...) for this layout at start-up"
            )
        start = time.perf_counter()
        with _compile_lock:
            compiled = self._build(key)
        _count(compiles=1, compile_seconds=time.perf_counter() - start)
        self._objects[key] = compiled
        return compiled

    def _load(self, obj: Path, symbol: str) -> Callable[..., Any] | None:
        start = time.perf_counter()
        if not _verified(obj):
            return None
        try:
            import cutlass.cute as cute

            module = cute.runtime.load_module(str(obj), enable_tvm_ffi=True)
            fn = getattr(module, symbol)
        except Exception:  # corrupt, truncated or stale: drop it and rebuild
            _drop(obj)
            return None
        self._modules.append(module)
        _count(disk_hits=1, disk_load_seconds=time.perf_counter() - start)
        return fn

    @staticmethod
    def _publish(compiled: Any, obj: Path, symbol: str) -> None:
        """Write the object, then its sidecar, each through a temp file and ``os.replace``.

        Raises OSError when the cache cannot be written; the temp files are removed first.
        """
        checksum = obj.with_suffix(".sha256")
        tmp = obj.with_name(f"{obj.name}.tmp.{os.getpid()}")
        tmp_sum = obj.with_name(f"{checksum.name}.tmp.{os.getpid()}")
        try:
            for path in (obj, checksum):
                _remove_squatter(path)
            compiled.export_to_c(str(tmp), function_name=symbol, export_only_tvm_ffi_symbols=True)
            # export_to_c creates the file through the umask; only the owner may change code.
            os.chmod(tmp, 0o600)
            digest = _sha256_file(tmp)
            os.replace(tmp, obj)
            tmp_sum.write_text(digest)
            os.chmod(tmp_sum, 0o600)
            os.replace(tmp_sum, checksum)
        except BaseException:
            for path in (tmp, tmp_sum):
                _unlink_quietly(path)
            raise
