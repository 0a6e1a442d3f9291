"""One definition per public op: the eager function, the ``torch.library`` custom op with its
fake, and the ``check_*`` layout check.

A kernel family writes its op once, as a *validation* function with the public signature and
docstring (metadata only: it raises :class:`~cute_kernels.LayoutError` or returns the compile
key, ``None`` for tensors that carry no arch) and a *launch* function ``launch(key, args)``
that gets the key and every argument, in signature order. :func:`cute_op` turns the pair into

- the public function: in eager mode it validates and launches directly (the dispatcher would
  add tens of microseconds per call, more than the kernels take); under ``torch.compile`` it
  calls the custom op, so Dynamo never traces into the DSL;
- ``torch.ops.cute_kernels.<name>``: an opaque op that mutates the named cache arguments, with
  a fake implementation that does nothing (``torch.compile(fullgraph=True)`` and CUDA-graph
  capture work);
- ``<public>.check``: the validation alone, which rejects exactly what the op rejects except
  that it does not need CUDA tensors (``meta`` tensors work).

Host cost. The full validation costs 10-20 us of Python per call, more than the launch. A layout
that passed once is remembered under a *signature* of everything the validation reads (each
tensor's dtype, shape, strides, device and the low bits of its address; every other argument's
type and value; the arch override), so a call with a layout seen before skips straight to the
launch, and anything else — a new or a rejected layout — runs the full validation, which raises
exactly as before. Rejections are never remembered.
"""

from __future__ import annotations

import functools
import inspect
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .arch import ARCH_ENV
from .validation import fail

NAMESPACE = "cute_kernels"
#: Layouts remembered per op (a serving process sees a handful; the bound only caps memory).
MAX_REMEMBERED_LAYOUTS = 4096
#: The device type the op launches on (``perf/host_cpu.py`` times the host path on CPU tensors).
LAUNCH_DEVICE_TYPE = "cuda"


def _meta(value: object) -> object:
    """What validation may read of one argument, hashable (raises TypeError when not)."""
    if isinstance(value, torch.Tensor):
        # the address's low bits decide every alignment check (all are <= 16 bytes)
        return (value.dtype, value.shape, value.stride(), value.device,
                value.data_ptr() & 15)
    if isinstance(value, (list, tuple)):
        return (type(value), *map(_meta, value))
    return (type(value), value)


def layout_signature(args: tuple) -> tuple:
    """The layout signature of a call's arguments (it may hold an unhashable value: its
    lookup then raises TypeError, and the call is validated in full)."""
    return (os.environ.get(ARCH_ENV), *map(_meta, args))


def cute_op(
    name: str, mutates_args: Sequence[str], launch: Callable[..., None]
) -> Callable[[Callable[..., Any]], Callable[..., None]]:
    """Decorate the validation function of op ``name`` (see the module doc)."""

    def register(validate: Callable[..., Any]) -> Callable[..., None]:
        signature = inspect.signature(validate).replace(return_annotation=None)
        params = list(signature.parameters.values())
        first = params[0].name  # the tensor whose device the kernel runs on
        defaults = tuple(p.default for p in params)
        required = sum(p.default is inspect.Parameter.empty for p in params)

        def positional(args: tuple, kwargs: dict) -> tuple:
            """All arguments in signature order (the fast path has no keywords)."""
            if not kwargs and required <= len(args) <= len(params):
                return args + defaults[len(args):]
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            return tuple(bound.arguments.values())

        accepted: dict[tuple, Any] = {}  # signature -> compile key, for CUDA calls
        checked: dict[tuple, bool] = {}  # signatures check() accepted

        def remember(table: dict, sig: tuple, value: object) -> None:
            if len(table) >= MAX_REMEMBERED_LAYOUTS:
                table.clear()
            try:
                table[sig] = value
            except TypeError:  # an unhashable argument: never remembered
                pass

        def run(*args: Any) -> None:
            sig = layout_signature(args)
            try:
                key = accepted.get(sig)
            except TypeError:
                key = None
            if key is None:
                key = validate(*args)
                if args[0].device.type != LAUNCH_DEVICE_TYPE:
                    fail(first, "a CUDA tensor", f"device {args[0].device}")
                remember(accepted, sig, key)
            launch(key, args)

        def impl(*args: Any, **kwargs: Any) -> None:
            run(*positional(args, kwargs))

        impl.__signature__ = signature  # type: ignore[attr-defined]
        impl.__name__ = name
        op = torch.library.custom_op(f"{NAMESPACE}::{name}", mutates_args=tuple(mutates_args))(
            impl
        )

        @op.register_fake
        def _fake(*args: object, **kwargs: object) -> None:
            return None

        @functools.wraps(validate)
        def public(*args: Any, **kwargs: Any) -> None:
            if torch.compiler.is_compiling():  # keep the kernel opaque to Dynamo
                getattr(torch.ops.cute_kernels, name)(*args, **kwargs)
            else:
                run(*positional(args, kwargs))

        def check(*args: Any, **kwargs: Any) -> None:
            args = positional(args, kwargs)
            sig = layout_signature(args)
            try:
                if sig in checked:
                    return
            except TypeError:
                pass
            validate(*args)
            remember(checked, sig, True)

        check.__signature__ = signature  # type: ignore[attr-defined]
        check.__name__ = f"check_{name}"
        check.__doc__ = (
            f"Raise :class:`LayoutError` if :func:`{name}` would reject these arguments.\n\n"
            "Reads metadata only: ``meta`` tensors work, so a model loader can check a layout "
            "without a GPU. On meta/CPU tensors the arch is checked only when "
            "``CUTE_KERNELS_ARCH`` names one."
        )
        public.__signature__ = signature  # type: ignore[attr-defined]
        public.check = check  # type: ignore[attr-defined]
        public.validate = validate  # type: ignore[attr-defined]
        public.op = op  # type: ignore[attr-defined]
        public.forget_layouts = lambda: (accepted.clear(), checked.clear())  # type: ignore
        return public

    return register
