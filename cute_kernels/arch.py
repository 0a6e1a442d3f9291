"""Target architecture: taken from the tensor's device, or overridden for GPU-less compiles.

CuTe DSL silently targets sm_100a when it cannot see a GPU, so every compile in this package
names its architecture explicitly (``--gpu-arch``); this module decides which one.
"""

from __future__ import annotations

import os

import cuda.bindings.driver as driver
import torch

from .validation import LayoutError

#: Architectures every kernel compiles for; sm_90a is run-tested (H200), sm_100a compile-tested.
SUPPORTED_ARCHS: tuple[str, ...] = ("sm_90a", "sm_100a")

#: Environment override, e.g. ``CUTE_KERNELS_ARCH=sm_90a`` on a build box without a GPU.
ARCH_ENV = "CUTE_KERNELS_ARCH"

_capability_cache: dict[int, tuple[int, int]] = {}
_sm_counts: dict[int, int] = {}


def device_index(device: torch.device) -> int:
    """The CUDA device index of ``device`` (the current device for a bare ``cuda``)."""
    return device.index if device.index is not None else torch.cuda.current_device()


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of CUDA ``device``, queried once per device (a serving step
    must not pay the ~10 us query)."""
    index = device_index(device)
    if index not in _sm_counts:
        _sm_counts[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _sm_counts[index]


def _arch_of_capability(major: int, minor: int) -> str:
    return f"sm_{major}{minor}a"


def check_arch(arch: str) -> str:
    if arch not in SUPPORTED_ARCHS:
        raise LayoutError(
            f"arch: expected one of {', '.join(SUPPORTED_ARCHS)}, got {arch} "
            "(the kernels are built and tested for Hopper sm_90a and Blackwell sm_100a only)"
        )
    return arch


def arch_for(device: torch.device, override: str | None = None) -> str | None:
    """The arch to compile for on ``device``; None for meta/CPU tensors without an override."""
    arch = override or os.environ.get(ARCH_ENV)
    if arch is None:
        if device.type != "cuda":
            return None
        index = device_index(device)
        if index not in _capability_cache:  # the query costs ~10 us; a serving step must not
            _capability_cache[index] = torch.cuda.get_device_capability(index)
        arch = _arch_of_capability(*_capability_cache[index])
    return check_arch(arch)


# An empty kernel for the driver's occupancy calculator (PTX, JIT-compiled by the driver).
_PROBE_PTX = b""".version 7.8
.target sm_90
.address_size 64
.visible .entry cluster_probe() { ret; }
\0"""
_cluster_cache: dict[tuple[int, int, int, int], int] = {}


def max_active_clusters(index: int, cluster: int, ctas_per_sm: int, threads: int) -> int:
    """How many clusters of ``cluster`` CTAs (``threads`` each, at most ``ctas_per_sm`` per SM)
    device ``index`` runs at once. A cluster cannot span GPCs, so this can be less than
    ``ctas_per_sm * SMs / cluster``: on the H200, 30 clusters of 8 at 2 CTAs per SM, not 33. A
    persistent grid sized by the formula would leave the extra clusters waiting for a whole
    first wave. The driver's occupancy calculator answers for an empty probe kernel whose shared
    memory admits exactly ``ctas_per_sm`` CTAs per SM; if it cannot (no driver context, or a
    CUDA graph is being captured, where loading a module is not allowed), the formula is used
    and the query is retried on a later call."""
    key = (index, cluster, ctas_per_sm, threads)
    if key in _cluster_cache:
        return _cluster_cache[key]
    sms = sm_count(torch.device("cuda", index))
    fallback = max(1, ctas_per_sm * sms // cluster)
    if torch.cuda.is_current_stream_capturing():
        return fallback
    try:
        value = _query_max_active_clusters(index, cluster, ctas_per_sm, threads, sms)
    except RuntimeError:
        return fallback
    _cluster_cache[key] = max(1, min(value, fallback))
    return _cluster_cache[key]


def queried_max_active_clusters(index: int, cluster: int, ctas_per_sm: int, threads: int) -> bool:
    """Whether :func:`max_active_clusters` has the driver's answer for these arguments (it
    never changes), rather than the formula it falls back on until the query succeeds."""
    return (index, cluster, ctas_per_sm, threads) in _cluster_cache


def _checked(result: tuple):
    if result[0] != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"CUDA driver call failed: {result[0]}")
    return result[1] if len(result) == 2 else None


def _query_max_active_clusters(
    index: int, cluster: int, ctas_per_sm: int, threads: int, sms: int
) -> int:
    attr = driver.CUdevice_attribute
    device = _checked(driver.cuDeviceGet(index))
    context = _checked(driver.cuDevicePrimaryCtxRetain(device))
    _checked(driver.cuCtxPushCurrent(context))
    module = None
    try:
        per_sm = _checked(driver.cuDeviceGetAttribute(
            attr.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR, device))
        reserved = _checked(driver.cuDeviceGetAttribute(
            attr.CU_DEVICE_ATTRIBUTE_RESERVED_SHARED_MEMORY_PER_BLOCK, device))
        smem = per_sm // ctas_per_sm - reserved
        module = _checked(driver.cuModuleLoadData(_PROBE_PTX))
        probe = _checked(driver.cuModuleGetFunction(module, b"cluster_probe"))
        _checked(driver.cuFuncSetAttribute(
            probe, driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            smem))
        config = driver.CUlaunchConfig()
        config.gridDimX, config.gridDimY, config.gridDimZ = cluster * sms, 1, 1
        config.blockDimX, config.blockDimY, config.blockDimZ = threads, 1, 1
        config.sharedMemBytes = smem
        value = driver.CUlaunchAttributeValue()
        value.clusterDim.x, value.clusterDim.y, value.clusterDim.z = cluster, 1, 1
        dims = driver.CUlaunchAttribute()
        dims.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
        dims.value = value
        config.numAttrs = 1
        config.attrs = [dims]
        return int(_checked(driver.cuOccupancyMaxActiveClusters(probe, config)))
    finally:
        if module is not None:
            driver.cuModuleUnload(module)
        driver.cuCtxPopCurrent()
        driver.cuDevicePrimaryCtxRelease(device)
