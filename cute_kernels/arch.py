"""Target architecture: taken from the tensor's device, or overridden for GPU-less compiles.

CuTe DSL silently targets sm_100a when it cannot see a GPU, so every compile in this package
names its architecture explicitly (``--gpu-arch``); this module decides which one.
"""

from __future__ import annotations

import os

import torch

from .validation import LayoutError

#: Architectures every kernel compiles for; sm_90a is run-tested (H200), sm_100a compile-tested.
SUPPORTED_ARCHS: tuple[str, ...] = ("sm_90a", "sm_100a")

#: Environment override, e.g. ``CUTE_KERNELS_ARCH=sm_90a`` on a build box without a GPU.
ARCH_ENV = "CUTE_KERNELS_ARCH"

_capability_cache: dict[int, tuple[int, int]] = {}


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
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index not in _capability_cache:  # the query costs ~10 us; a serving step must not
            _capability_cache[index] = torch.cuda.get_device_capability(index)
        arch = _arch_of_capability(*_capability_cache[index])
    return check_arch(arch)
