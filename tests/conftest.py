import sys
from pathlib import Path

import pytest
import torch

# the checkout's package first, also where an older copy is installed
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

HAS_CUDA = torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _forget_test_families():
    """A ``KernelCache`` registers its family for the process's lifetime: those a test makes
    are forgotten after it, so that later tests see only the package's families (the list
    ``precompile`` names in its rejections)."""
    from cute_kernels import compile_cache

    families = dict(compile_cache._families)
    yield
    compile_cache._families.clear()
    compile_cache._families.update(families)


@pytest.fixture
def empty_memory(monkeypatch):
    """A function that empties a ``KernelCache``'s memory for the rest of the test, as a fresh
    process has it: its entry functions and the compiled objects that own their code, always
    together (a compile with only the functions emptied would replace, and free, the object
    whose function the memory restored after the test points at)."""

    def empty(cache) -> None:
        monkeypatch.setattr(cache, "_compiled", {})
        monkeypatch.setattr(cache, "_objects", {})

    return empty
