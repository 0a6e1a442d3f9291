"""torch.library registration: each public kernel is also an opaque custom op.

The op mutates its cache argument and has a fake implementation that does nothing, so it works
under ``torch.compile(fullgraph=True)`` (Dynamo never traces into the DSL) and inside CUDA-graph
capture. Eager calls go straight to the implementation: the dispatcher adds tens of
microseconds per call, more than the kernels themselves take.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

import torch

NAMESPACE = "cute_kernels"

F = TypeVar("F", bound=Callable[..., None])


def mutating_op(name: str, mutates_args: Sequence[str]) -> Callable[[F], F]:
    """Register ``fn`` as ``torch.ops.cute_kernels.<name>``; return ``fn`` itself."""

    def register(fn: F) -> F:
        op = torch.library.custom_op(f"{NAMESPACE}::{name}", mutates_args=tuple(mutates_args))(fn)

        @op.register_fake
        def _fake(*args: object, **kwargs: object) -> None:
            return None

        return fn

    return register
