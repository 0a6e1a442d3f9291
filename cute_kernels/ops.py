"""One definition per public op: the eager function, the ``torch.library`` custom op with its
fake, and the ``check_*`` layout check.

A kernel family writes its op once, as a *validation* function with the public signature and
docstring (metadata only: it raises :class:`~cute_kernels.LayoutError` or returns the compile
key, ``None`` for tensors that carry no arch) and a *prepare* function ``prepare(key, args)``
that gets the key and every argument, in signature order, and returns the function that
launches a call of that layout. :func:`cute_op` turns the pair into

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
type and value; the arch override and the op's other environment overrides), so a call with a
layout seen before skips straight to the launch ``prepare`` made for it (the compiled function,
the grid or plan, found once), and anything else — a new or a rejected layout — runs the full
validation, which raises exactly as before. Rejections are never remembered.

The signature is read afresh on every call, tensor by tensor (about 0.3 us a tensor on a
development CPU): a tensor whose metadata changed in place (``set_``, ``resize_``,
``as_strided_``, ``.data =``, ``torch.utils.swap_tensors``) is a new layout. Nothing is cached
by object identity, and the prepared launches hold none of the caller's tensors.

Before the signature, a call is matched against the few layouts the op saw last
(:class:`RecentLayout`): the same check, done mostly in C++ by Dynamo's tensor guards (dtype,
device, sizes, strides, plus requires_grad and dispatch keys, which only make it stricter),
the other arguments compared by type and value, and the addresses' alignment, in one
straight-line function generated for the layout when it is remembered. The guard reads
every tensor's sizes and strides before it compares anything, and those of a nested tensor
throw a C++ error that it does not catch (the process aborts), so each tensor's ``is_nested``
is tested first: a nested tensor misses, and the validation rejects it (~0.06 us a tensor on the
development CPU: +1.0 us for the TP-1 stacked call's 16, 2026-12-06). A serving step
calls each op with one layout per layer, so this is the path of nearly every call; anything
it does not match goes the signature way, which decides as before. A call of the op (not
``check``) leaves the alignment to the compiled function: TVM-FFI checks every tensor's
address against the alignment its compile assumed, which is the one the validation asks for
(each family's ``ALIGN`` table feeds both), in C++ before it launches, and refuses a misaligned
tensor without naming it; the op then runs the full validation, which raises the
:class:`~cute_kernels.LayoutError` a fresh process raises. Reading the addresses in Python cost
~0.07 us a tensor (16 in a TP-1 stacked call).
"""

from __future__ import annotations

import functools
import inspect
import operator
import os
from collections.abc import Callable, Sequence
from types import CodeType
from typing import Any

import torch

try:  # Dynamo's C++ tensor-metadata guard (absent from a torch built without Dynamo)
    from torch._C._dynamo.guards import TensorGuards
except ImportError:  # pragma: no cover
    TensorGuards = None

from .arch import ARCH_ENV
from .validation import LayoutError, fail

NAMESPACE = "cute_kernels"
#: Layouts remembered per op (a serving process sees a handful; the bound only caps memory).
MAX_REMEMBERED_LAYOUTS = 4096
#: The device type the op launches on (``perf/host_cpu.py`` times the host path on CPU tensors).
LAUNCH_DEVICE_TYPE = "cuda"
#: Layouts matched before the signature, most recent first (a model's layers share a few).
RECENT_LAYOUTS = 4


_Tensor = torch.Tensor
_SEQUENCES = (list, tuple)


def _meta(value: object) -> object:
    """What validation may read of one argument, hashable (raises TypeError when not)."""
    if isinstance(value, _Tensor):
        # the address's low bits decide every alignment check (all are <= 16 bytes)
        return (value.dtype, value.shape, value.stride(), value.device,
                value.data_ptr() & 15)
    if isinstance(value, _SEQUENCES):
        return (type(value), *map(_meta, value))
    return (type(value), value)


def _signature(env: object, args: tuple) -> tuple:
    """:func:`layout_signature` flattened into one tuple, the hot path of every call.

    Each tensor contributes (dtype, shape, strides, device, address & 15), each sequence its
    type and length followed by its items', anything else (type, value). The entries are read
    left to right, and the first item of each tells which kind it is (a ``torch.dtype`` or a
    type), so equal signatures mean equal metadata argument by argument. A tensor without a
    data pointer (a sparse one) makes the signature unhashable, as an unhashable argument
    does: it is looked up and remembered nowhere, and the full validation names the tensor."""
    sig = [env]
    add = sig.append
    # The tensor branch is written out twice (top level, and items of a list) rather than
    # shared through a helper or a flattening inner loop: measured on the development CPU,
    # a known kv_rope_insert layout costs 2.72 us this way and 3.23 us with one loop over
    # flattened items (stacked_kv_proj: 8.31 against 8.94).
    try:
        for a in args:
            if isinstance(a, _Tensor):
                add(a.dtype)
                add(a.shape)
                add(a.stride())
                add(a.device)
                add(a.data_ptr() & 15)
            elif isinstance(a, _SEQUENCES):
                add(type(a))
                add(len(a))
                for c in a:
                    if isinstance(c, _Tensor):
                        add(c.dtype)
                        add(c.shape)
                        add(c.stride())
                        add(c.device)
                        add(c.data_ptr() & 15)
                    elif isinstance(c, _SEQUENCES):
                        add(_meta(c))
                    else:
                        add(type(c))
                        add(c)
            else:
                add(type(a))
                add(a)
    except RuntimeError:  # a tensor without storage has no data pointer
        return (env, sig)  # unhashable (a list inside)
    return tuple(sig)


class RecentLayout:
    """A layout accepted before, as a cheaper test than its signature: which arguments are
    tensors or sequences of tensors, every other argument's type and value, a
    ``TensorGuards`` over the tensors (in argument order, sequences flattened) and their
    addresses modulo 16. :attr:`match` is true exactly when the signature would be equal,
    except that it also asks for the same requires_grad and dispatch keys (a stricter test:
    a miss only costs the signature) and leaves the addresses out (a call of the op leaves
    them to the compiled function, see :func:`cute_op`). ``check`` asks
    :attr:`match_addresses`, which adds them: any addresses that are all 16-byte aligned
    (every alignment a validation checks is at most 16 bytes, so such a call passes them all,
    as the layout did), or else the layout's own addresses modulo 16. Tensors that are all on
    the meta device (a model loader's check) have no addresses to read: the guard holds them
    there."""

    __slots__ = ("match", "match_addresses", "target")

    def __init__(self, match: Callable[[object, tuple], bool],
                 match_addresses: Callable[[object, tuple], bool], target: object) -> None:
        self.match = match  # (env, args) -> bool, every test but the addresses'
        self.match_addresses = match_addresses  # the same, and the addresses (check's test)
        self.target = target  # what the op keeps for the layout (its launch, or True)

    @classmethod
    def of(cls, env: object, args: tuple, target: object) -> RecentLayout | None:
        """The entry for ``args``, or None when they hold something it cannot match (a
        sequence of other than tensors, no C++ guards in this torch)."""
        if TensorGuards is None:
            return None
        tensors, sequences, values = [], [], []
        for i, a in enumerate(args):
            if isinstance(a, _Tensor):
                tensors.append(i)
            elif isinstance(a, _SEQUENCES):
                if not all(isinstance(c, _Tensor) for c in a):
                    return None
                sequences.append((i, type(a), len(a)))
            else:
                values.append((i, a))
        flat = _picker(tensors, [i for i, _, _ in sequences])(args)
        # The guard answers False for a tensor object passed twice (it asks its tensors to be
        # distinct), so a layout that passes one tensor in two places would never match and be
        # remembered again on every call (~300 us each): the guard takes each object once, and
        # the test asks the other places to hold that same object.
        first: dict[int, int] = {}  # id -> the first place of that object
        for k, t in enumerate(flat):
            first.setdefault(id(t), k)
        same = [(k, first[id(t)]) for k, t in enumerate(flat) if first[id(t)] != k]
        unique = [flat[k] for k in first.values()]
        try:
            guard = TensorGuards(
                *unique, dynamic_dims_sizes=[list(t.shape) for t in unique],
                dynamic_dims_strides=[list(t.stride()) for t in unique])
        except (TypeError, RuntimeError):
            return None
        addressless = all(t.device.type == "meta" for t in unique)
        aligns = None if addressless else tuple(t.data_ptr() & 15 for t in unique)
        return cls(*_matcher(len(args), env, tensors, sequences, values, same, guard.check,
                             aligns), target)


def _matcher(count: int, env: object, tensors: list[int], sequences: list[tuple],
             values: list[tuple], same: list[tuple[int, int]], guard_check: Callable[..., bool],
             aligns: tuple | None
             ) -> tuple[Callable[[object, tuple], bool], Callable[[object, tuple], bool]]:
    """The tests of one layout as straight-line functions (generated, as ``dataclasses``
    generates its methods): :attr:`RecentLayout.match` (the environment, each value
    argument's identity or type and value, each sequence's type and length, then the guard
    over the tensors in one call) and :attr:`RecentLayout.match_addresses`, the same and then
    the tensors' addresses: all 16-byte aligned (their bitwise or), or else each modulo 16 as
    ``aligns`` (None: tensors without addresses, the test is ``match``). ``same`` pairs
    (place, earlier place) of the flattened tensors that held one object: the guard skips
    the later place, which must hold that object again. Measured on the
    development CPU, a TP-1 stacked call's match costs 1.1 us this way and 1.45 us as loops
    over the positions (the guard alone, 1.0)."""
    consts: dict[str, object] = {"ENV": env, "GUARD": guard_check, "ADDRESS": _Tensor.data_ptr,
                                 "ALIGNS": aligns}
    head = ["    try:", f"        {', '.join(f'a{i}' for i in range(count))}, = args",
            "        if env != ENV:", "            return False"]
    for i, value in values:
        consts[f"V{i}"], consts[f"T{i}"] = value, type(value)
        head += [f"        if a{i} is not V{i} and (type(a{i}) is not T{i} or a{i} != V{i}):",
                 "            return False"]
    # The sequences' lengths are fixed by the layout, so their items are unpacked into
    # names (one instruction a sequence): the guard then takes them as plain arguments and
    # the addresses need no indexing (on the development CPU the TP-1 stacked check's match
    # with the addresses took 2.43 us this way, 2.75 with the items indexed and the gcd of
    # the addresses instead of their or).
    items = []
    for i, kind, length in sequences:
        consts[f"S{i}"] = kind
        names = [f"s{i}_{k}" for k in range(length)]
        items += names
        head += [f"        if type(a{i}) is not S{i} or len(a{i}) != {length}:",
                 "            return False", f"        [{', '.join(names)}] = a{i}"]
    tensor_names = [f"a{i}" for i in tensors] + items
    for k, at in same:
        head += [f"        if {tensor_names[k]} is not {tensor_names[at]}:",
                 "            return False"]
    repeated = {k for k, _ in same}
    tensor_names = [name for k, name in enumerate(tensor_names) if k not in repeated]
    # A non-tensor in a tensor's place fails the tests (False or an error). A nested tensor
    # of the strided layout must not reach the guard: it reads every tensor's strides before
    # it compares anything, and a nested tensor's strides throw a C++ error that the guard
    # does not catch (the process aborts). Such a call misses here; the validation rejects it.
    nested = " or ".join(f"{name}.is_nested" for name in tensor_names) or "False"
    guard = f"(not ({nested}) and GUARD({', '.join(tensor_names)}))"
    # (a non-tensor has no is_nested: AttributeError)
    tail = ["    except (TypeError, ValueError, AttributeError):", "        return False"]
    source = ["def match(env, args):", *head, f"        return {guard}", *tail]
    if aligns is not None and tensor_names:
        # the addresses are read again for the rare layout not all 16-byte aligned (keeping
        # them in names cost the common case ~0.2 us of the stacked check's 4.7)
        source += [
            "def match_addresses(env, args):", *head, f"        if not {guard}:",
            "            return False",
            f"        return (({' | '.join(f'ADDRESS({n})' for n in tensor_names)}) & 15 == 0"
            f" or ({', '.join(f'ADDRESS({n}) & 15' for n in tensor_names)},) == ALIGNS)",
            *tail]
    exec(_compiled("\n".join(source)), consts)  # noqa: S102 - built from positions only
    match = consts["match"]
    return match, consts.get("match_addresses", match)  # type: ignore[return-value]


@functools.lru_cache(maxsize=256)
def _compiled(source: str) -> CodeType:
    """The code of a layout's tests, compiled once per source. The source depends only on
    where the tensors, sequences and other arguments sit (their values are the functions'
    globals), so every token count of one call form shares it: a new token count's entry
    costs ~40 us instead of ~330 (the compile, development Xeon)."""
    return compile(source, "<cute_kernels recent layout>", "exec")


def _picker(tensors: list[int], sequences: list[int]) -> Callable[[tuple], list]:
    """A function returning the tensors at positions ``tensors``, then the items of the
    sequences at ``sequences``, as one list (one C call for the tensors)."""
    get = operator.itemgetter(*tensors) if len(tensors) >= 2 else None

    def pick(args: tuple) -> list:
        flat = [*get(args)] if get is not None else [args[i] for i in tensors]
        for i in sequences:
            flat += args[i]
        return flat

    return pick


def _remember_recent(recent: list, env: object, args: tuple, target: object) -> None:
    entry = RecentLayout.of(env, args, target)
    if entry is not None:
        recent.insert(0, entry)
        del recent[RECENT_LAYOUTS:]


def _env_reader(names: tuple[str, ...]) -> Callable[[], tuple]:
    """A function returning the values of environment variables ``names``, as ``os.environ``
    has them. ``os.environ.get`` costs about 0.5 us a name (it encodes the key and decodes the
    value); this reads the mapping's own dict of encoded keys and values, the same values,
    whenever ``os.environ`` is the standard mapping."""
    environ = os.environ
    data = getattr(environ, "_data", None)
    encode = getattr(environ, "encodekey", None)

    def slow() -> tuple:
        return tuple(map(os.environ.get, names))

    if not isinstance(data, dict) or encode is None:
        return slow
    keys = tuple(encode(name) for name in names)
    get = data.get
    present = data.keys()  # a live view: one C call tells whether any of the names is set
    unset = (None,) * len(names)
    first, others, others_unset = keys[0], keys[1:], unset[1:]

    def read() -> tuple:
        if os.environ is not environ:  # replaced wholesale: ask the new one
            return slow()
        if present.isdisjoint(keys):  # a serving process (0.13 against 0.23 us for 7 names)
            return unset
        # only the first (the arch, which a model loader sets to check a layout without a
        # GPU): one more disjointness test and a lookup (the stacked op's 7 names: ~0.2
        # against ~0.3 us for reading them all, on the development CPU)
        if present.isdisjoint(others):
            return (get(first),) + others_unset
        return tuple(map(get, keys))

    return read


_read_arch_env = _env_reader((ARCH_ENV,))


def skip_launch(args: tuple) -> None:
    """The launch ``prepare`` returns for a layout with nothing to do (no tokens)."""


def layout_signature(args: tuple, env: Sequence[str] = ()) -> tuple:
    """The layout signature of a call's arguments: the values of ``CUTE_KERNELS_ARCH`` and of
    ``env``, then every argument's metadata. It may hold an unhashable value: its lookup then
    raises TypeError, and the call is validated in full."""
    return _signature(_env_reader((ARCH_ENV, *env))(), args)


def cute_op(
    name: str,
    mutates_args: Sequence[str],
    prepare: Callable[[Any, tuple], Callable[[tuple], None]],
    env: Sequence[str] = (),
) -> Callable[[Callable[..., Any]], Callable[..., None]]:
    """Decorate the validation function of op ``name`` (see the module doc). ``prepare(key,
    args)`` is called once per accepted signature and returns the function that launches a call
    of that signature (from its positional arguments); ``env`` names the environment variables
    besides ``CUTE_KERNELS_ARCH`` that the validation or ``prepare`` reads."""
    read_env = _env_reader((ARCH_ENV, *env)) if env else _read_arch_env

    def register(validate: Callable[..., Any]) -> Callable[..., None]:
        signature = inspect.signature(validate).replace(return_annotation=None)
        params = list(signature.parameters.values())
        first = params[0].name  # the tensor whose device the kernel runs on
        defaults = tuple(p.default for p in params)
        required = sum(p.default is inspect.Parameter.empty for p in params)
        count = len(params)

        def positional(args: tuple, kwargs: dict) -> tuple:
            """All arguments in signature order (the fast path has no keywords)."""
            if not kwargs and required <= len(args) <= count:
                return args + defaults[len(args):]
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            return tuple(bound.arguments.values())

        accepted: dict[tuple, Callable[[tuple], None]] = {}  # signature -> launch, CUDA calls
        checked: dict[tuple, bool] = {}  # signatures check() accepted
        recent_accepted: list[RecentLayout] = []  # the last few of each, matched first
        recent_checked: list[RecentLayout] = []

        def remember(table: dict, sig: tuple, value: object) -> None:
            if len(table) >= MAX_REMEMBERED_LAYOUTS:
                table.clear()
            try:
                table[sig] = value
            except TypeError:  # an unhashable argument: never remembered
                pass

        def first_call(sig: tuple, args: tuple) -> Callable[[tuple], None]:
            """A signature not accepted yet: the full validation, which raises as it always
            did, then the launch prepared and remembered."""
            key = validate(*args)
            if args[0].device.type != LAUNCH_DEVICE_TYPE:
                fail(first, "a CUDA tensor", f"device {args[0].device}")
            launch = prepare(key, args)
            remember(accepted, sig, launch)
            return launch

        def run(args: tuple) -> None:
            env = read_env()
            # A recent layout is matched without the addresses: the compiled function checks
            # every tensor's alignment (the one its compile assumed, the one the validation
            # asks for) in C++ before it launches, and a refusal is answered below.
            for entry in recent_accepted:
                if entry.match(env, args):
                    try:
                        entry.target(args)
                    except Exception:
                        refused(args)
                        raise
                    return
            sig = _signature(env, args)
            try:
                launch = accepted.get(sig)
            except TypeError:
                launch = None
            if launch is None:
                launch = first_call(sig, args)
            _remember_recent(recent_accepted, env, args, launch)
            launch(args)

        def refused(args: tuple) -> None:
            """A launch of a recent layout failed (the compiled function refuses a misaligned
            tensor, without naming it): raise what the full validation says of the call, the
            error a fresh process raises; if it accepts the call, the caller re-raises."""
            try:
                validate(*args)
            except LayoutError as err:
                raise err from None

        def impl(*args: Any, **kwargs: Any) -> None:
            run(positional(args, kwargs))

        impl.__signature__ = signature  # type: ignore[attr-defined]
        impl.__name__ = name
        op = torch.library.custom_op(f"{NAMESPACE}::{name}", mutates_args=tuple(mutates_args))(
            impl
        )

        @op.register_fake
        def _fake(*args: object, **kwargs: object) -> None:
            return None

        is_compiling = torch.compiler.is_compiling

        @functools.wraps(validate)
        def public(*args: Any, **kwargs: Any) -> None:
            if is_compiling():  # keep the kernel opaque to Dynamo
                getattr(torch.ops.cute_kernels, name)(*args, **kwargs)
            elif not kwargs and required <= len(args) <= count:
                run(args + defaults[len(args):])
            else:
                run(positional(args, kwargs))

        def check(*args: Any, **kwargs: Any) -> None:
            args = positional(args, kwargs)
            env = read_env()
            for entry in recent_checked:
                if entry.match_addresses(env, args):
                    return
            sig = _signature(env, args)
            try:
                known = sig in checked
            except TypeError:
                known = False
            if not known:
                validate(*args)
                remember(checked, sig, True)
            _remember_recent(recent_checked, env, args, True)

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
        public.forget_layouts = lambda: (  # type: ignore[attr-defined]
            accepted.clear(), checked.clear(), recent_accepted.clear(), recent_checked.clear())
        return public

    return register
