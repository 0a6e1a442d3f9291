"""Compile cache: each kernel is built once per layout key, never once per token count.

L1 is an in-process dict guarded by one lock per key, so concurrent first calls compile once.
L2 is an on-disk ``.o`` cache (``export_to_c`` / ``load_module``) under a fingerprint of this
package's sources, the CuTe DSL / TVM-FFI / Python versions and the host platform; the arch is
part of every key. Writers take an exclusive ``flock`` per key and publish with ``os.replace``;
each object has a SHA-256 sidecar written last, so a corrupt or truncated object is detected,
removed and rebuilt.

Environment:
  ``CUTE_KERNELS_CACHE_DIR``   disk cache directory (default ``$XDG_CACHE_HOME/cute_kernels``)
  ``CUTE_KERNELS_DISK_CACHE``  ``0`` turns the disk layer off
  ``CUTE_KERNELS_STRICT``      ``1`` starts the process in strict mode (see :func:`set_strict`)

The directory must be trusted: loading an object runs its code.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import importlib.metadata
import os
import platform
import sys
import threading
import time
from collections.abc import Callable, Hashable, Iterable
from pathlib import Path
from typing import Any, Protocol

CACHE_DIR_ENV = "CUTE_KERNELS_CACHE_DIR"
DISK_CACHE_ENV = "CUTE_KERNELS_DISK_CACHE"
STRICT_ENV = "CUTE_KERNELS_STRICT"


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


_counters = _Counters()
_counters_lock = threading.Lock()
# cute.compile keeps MLIR state per thread and is documented as not thread-safe: one compile at
# a time in the process. Per-key locks (below) make concurrent first calls of one key wait for
# that single compile instead of compiling again.
_compile_lock = threading.Lock()
_strict = os.environ.get(STRICT_ENV, "0") == "1"


def set_strict(strict: bool = True) -> None:
    """In strict mode any compile raises :class:`StrictModeError` (loads from disk still work).

    Serving engines call :func:`cute_kernels.precompile` at start-up, then turn this on so that
    a layout they did not warm up fails loudly instead of stalling a step for seconds.
    """
    global _strict
    _strict = strict


def cache_stats() -> dict[str, float]:
    """Counters of the process: compiles, memory hits, disk hits and seconds spent."""
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


def disk_cache_dir() -> Path | None:
    if os.environ.get(DISK_CACHE_ENV, "1") == "0":
        return None
    root = os.environ.get(CACHE_DIR_ENV)
    if root is None:
        xdg = os.environ.get("XDG_CACHE_HOME", os.path.join(os.path.expanduser("~"), ".cache"))
        root = os.path.join(xdg, "cute_kernels")
    return Path(root)


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
        self._modules: list[Any] = []  # loaded modules must outlive their functions
        _families[family] = self

    def get(self, key: CompileKey) -> Callable[..., Any]:
        fn = self._compiled.get(key)
        if fn is not None:
            _count(memory_hits=1)
            return fn
        with self._key_locks_guard:
            lock = self._key_locks.setdefault(key, threading.Lock())
        with lock:
            fn = self._compiled.get(key)
            if fn is not None:
                _count(memory_hits=1)
                return fn
            fn = self._load_or_compile(key)
            self._compiled[key] = fn
            return fn

    def precompile(self, keys: Iterable[CompileKey]) -> None:
        for key in keys:
            self.get(key)

    def build(self, key: CompileKey) -> Callable[..., Any]:
        """A fresh compile that bypasses both levels (the CLI times compiles with it)."""
        with _compile_lock:
            return self._build(key)

    # -- levels below L1 -------------------------------------------------------------------

    def _load_or_compile(self, key: CompileKey) -> Callable[..., Any]:
        symbol = symbol_name(self.family, key)
        root = disk_cache_dir()
        if root is None:
            return self._compile(key)
        folder = root / fingerprint()
        folder.mkdir(parents=True, exist_ok=True)
        obj = folder / f"{symbol}.o"
        fn = self._load(obj, symbol)
        if fn is not None:
            return fn
        with open(folder / f"{symbol}.lock", "a+") as lock_file:
            fcntl.flock(lock_file, fcntl.LOCK_EX)  # another process may be writing this key
            fn = self._load(obj, symbol)
            if fn is not None:
                return fn
            compiled = self._compile(key)
            self._publish(compiled, obj, symbol)
            return compiled

    def _compile(self, key: CompileKey) -> Callable[..., Any]:
        if _strict:
            raise StrictModeError(
                f"cute_kernels: {self.family} kernel for {key} is not compiled and strict mode "
                "is on; call cute_kernels.precompile(...) for this layout at start-up"
            )
        start = time.perf_counter()
        with _compile_lock:
            compiled = self._build(key)
        _count(compiles=1, compile_seconds=time.perf_counter() - start)
        return compiled

    def _load(self, obj: Path, symbol: str) -> Callable[..., Any] | None:
        checksum = obj.with_suffix(".sha256")
        if not (obj.exists() and checksum.exists()):
            return None
        start = time.perf_counter()
        try:
            if _sha256_file(obj) != checksum.read_text().strip():
                raise ValueError("checksum mismatch")
            import cutlass.cute as cute

            module = cute.runtime.load_module(str(obj), enable_tvm_ffi=True)
            fn = getattr(module, symbol)
        except Exception:  # corrupt, truncated or stale: drop it and rebuild
            for path in (obj, checksum):
                path.unlink(missing_ok=True)
            return None
        self._modules.append(module)
        _count(disk_hits=1, disk_load_seconds=time.perf_counter() - start)
        return fn

    @staticmethod
    def _publish(compiled: Any, obj: Path, symbol: str) -> None:
        tmp = obj.with_name(f"{obj.name}.tmp.{os.getpid()}")
        compiled.export_to_c(str(tmp), function_name=symbol, export_only_tvm_ffi_symbols=True)
        digest = _sha256_file(tmp)
        os.replace(tmp, obj)
        tmp_sum = obj.with_name(f"{obj.stem}.sha256.tmp.{os.getpid()}")
        tmp_sum.write_text(digest)
        os.replace(tmp_sum, obj.with_suffix(".sha256"))
