"""Every tensor argument of every op moved by one element off its usual address: the layout
check either rejects it with a LayoutError naming that argument (before any compile or launch:
the alignment the kernel is compiled to assume), or accepts it, and then on a GPU the op writes
exactly the bytes it writes for the unmoved argument."""

from __future__ import annotations

import importlib
import inspect

import pytest
import torch

import cute_kernels
from cute_kernels import LayoutError
from cute_kernels.testing import compress_c128_case, kv_rope_insert_case, stacked_kv_proj_case

# the modules (their names in the package are the ops)
ALIGN_TABLES = {op: importlib.import_module(f"cute_kernels.{module}").ALIGN for op, module in (
    ("kv_rope_insert", "kv_rope_insert"), ("compress_c128", "compress_c128.interface"),
    ("stacked_kv_proj", "stacked_kv_proj.interface"))}

HAS_CUDA = torch.cuda.is_available()

# op -> (case builder on a device, indices of the output arguments)
OPS = {
    "kv_rope_insert": (lambda dev: kv_rope_insert_case("v4_packed", 37, 16, dev).args(), (1,)),
    "kv_rope_insert_fp8": (lambda dev: kv_rope_insert_case("fp8", 37, 16, dev).args(), (1,)),
    "compress_c128": (lambda dev: compress_c128_case("bf16", 40, 2, dev).args(), (8,)),
    "stacked_kv_proj": (lambda dev: stacked_kv_proj_case(37, 256, 2, 2, 128, dev, bias=True,
                                                         commit=True).args(), (8, 9)),
}


def _offset(t: torch.Tensor, elements: int = 1) -> torch.Tensor:
    """The same tensor (values, strides, the bytes around it) ``elements`` further on."""
    size = t.untyped_storage().nbytes() // t.element_size()
    base = torch.empty(size + elements, dtype=t.dtype, device=t.device)
    flat = torch.empty(0, dtype=t.dtype, device=t.device).set_(t.untyped_storage())
    base[elements:].copy_(flat)
    return base.as_strided(t.shape, t.stride(), t.storage_offset() + elements)


def _places(args: tuple) -> list[tuple[int, int | None]]:
    """(argument index, list index or None) of every tensor argument."""
    places = []
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor):
            places.append((i, None))
        elif isinstance(a, (list, tuple)):
            places += [(i, j) for j in range(len(a))]
    return places


def _moved(args: tuple, place: tuple[int, int | None]) -> tuple:
    i, j = place
    moved = list(args)
    if j is None:
        moved[i] = _offset(args[i])
    else:
        moved[i] = list(args[i])
        moved[i][j] = _offset(args[i][j])
    return tuple(moved)


def _name(op: str, place: tuple[int, int | None]) -> str:
    fn = getattr(cute_kernels, op.removesuffix("_fp8"))
    name = list(inspect.signature(fn).parameters)[place[0]]
    return name if place[1] is None else f"{name}[{place[1]}]"


CASES = [(op, place) for op, (build, _) in OPS.items() for place in _places(build("cpu"))]


def _assumed_align(op: str, place: tuple[int, int | None]) -> int:
    """The byte alignment the op's kernel is compiled to assume of that argument (its
    module's ``ALIGN`` table, which the build's fake tensors and the validation share)."""
    return ALIGN_TABLES[op.removesuffix("_fp8")][_name(op, (place[0], None))]


@pytest.mark.parametrize(("op", "place"), CASES, ids=lambda v: str(v))
def test_moved_argument_is_named_or_accepted(op, place):
    """Rejected, naming the argument, exactly when one element is less than the alignment
    the kernel assumes of it."""
    check = getattr(cute_kernels, f"check_{op.removesuffix('_fp8')}")
    args = _moved(OPS[op][0]("cpu"), place)
    moved = args[place[0]] if place[1] is None else args[place[0]][place[1]]
    misaligned = moved.element_size() % _assumed_align(op, place) != 0
    try:
        check(*args)
    except LayoutError as err:
        assert misaligned, str(err)
        assert str(err).startswith(f"{_name(op, place)}: expected"), str(err)
    else:
        assert not misaligned, f"a {moved.element_size()}-byte offset was accepted"


def _storage_bytes(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``t``'s storage as bytes: those before its first element, and the rest."""
    whole = torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())
    first = t.storage_offset() * t.element_size()
    return whole[:first], whole[first:]


def _outputs(args: tuple, outputs: tuple[int, ...]) -> list[torch.Tensor]:
    """Each output's storage as bytes, from the tensor's first element to the storage's end:
    the page padding and the guard behind a cache included (a moved tensor's storage holds
    the same bytes after one element of its own)."""
    flat = []
    for i in outputs:
        flat += list(args[i]) if isinstance(args[i], (list, tuple)) else [args[i]]
    return [_storage_bytes(t)[1].clone() for t in flat]


def _moved_output_head(args: tuple, place: tuple[int, int | None],
                       outputs: tuple[int, ...]) -> torch.Tensor | None:
    """The bytes of a moved output's storage before its first element (None: the moved
    argument is an input)."""
    if place[0] not in outputs:
        return None
    t = args[place[0]] if place[1] is None else args[place[0]][place[1]]
    return _storage_bytes(t)[0].clone()


@pytest.mark.gpu
@pytest.mark.parametrize(("op", "place"), CASES, ids=lambda v: str(v))
def test_moved_argument_gives_identical_bytes(op, place):
    build, outputs = OPS[op]
    fn = getattr(cute_kernels, op.removesuffix("_fp8"))
    baseline = build("cuda")
    fn(*baseline)
    torch.cuda.synchronize()
    want = _outputs(baseline, outputs)
    args = _moved(build("cuda"), place)
    head = _moved_output_head(args, place, outputs)
    try:
        getattr(cute_kernels, f"check_{op.removesuffix('_fp8')}")(*args)
    except LayoutError as err:
        # the layout was just accepted at aligned addresses: this call is matched as a recent
        # layout, and the compiled function's own alignment check refuses it before it launches
        before = _outputs(args, outputs)
        with pytest.raises(LayoutError) as raised:
            fn(*args)
        assert str(raised.value) == str(err)
        torch.cuda.synchronize()
        for g, w in zip(_outputs(args, outputs), before, strict=True):
            assert torch.equal(g, w)  # nothing written
    else:
        fn(*args)
        torch.cuda.synchronize()
        for g, w in zip(_outputs(args, outputs), want, strict=True):
            assert torch.equal(g, w)
    if head is not None:  # nothing written before a moved output either
        assert torch.equal(_moved_output_head(args, place, outputs), head)
