"""The remembered-layout fast path of the ops (cute_kernels.ops): a layout accepted once skips the
full validation, and everything the validation would reject is still rejected with the same
message, whatever was accepted before."""

from __future__ import annotations

import inspect

import pytest
import torch

import cute_kernels
from cute_kernels import LayoutError, ops
from cute_kernels.testing import (
    compress_c128_case,
    cpu_launches,
    kv_rope_insert_case,
    stacked_kv_proj_case,
)


def _message(fn, *args) -> str | None:
    try:
        fn(*args)
    except LayoutError as err:
        return str(err)
    return None


def _offset(t: torch.Tensor, elements: int = 1) -> torch.Tensor:
    """The same values at an address ``elements`` further on (a misaligned base)."""
    flat = torch.empty(t.numel() + elements, dtype=t.dtype)
    view = flat[elements:].view(t.shape)
    view.copy_(t)
    return view


CASES = {
    "kv_rope_insert": lambda: kv_rope_insert_case("bf16", 8, 16, "cpu").args(),
    "compress_c128": lambda: compress_c128_case("v4_packed", 16, 2, "cpu").args(),
    "stacked_kv_proj": lambda: stacked_kv_proj_case(8, hidden=128).args(),
}


@pytest.mark.parametrize("name", list(CASES))
def test_a_changed_layout_is_validated_again_and_a_rejection_is_not_remembered(name):
    op = getattr(cute_kernels, name)
    op.forget_layouts()
    args = CASES[name]()
    assert op.check(*args) is None
    assert op.check(*args) is None
    # A misaligned first tensor: a new signature, so the full validation runs and rejects.
    bad = (_offset(args[0]), *args[1:])
    first = _message(op.check, *bad)
    assert first is not None and "aligned" in first
    assert _message(op.check, *bad) == first  # rejections are never remembered
    assert op.check(*args) is None


@pytest.mark.parametrize("name", list(CASES))
def test_a_recent_layout_is_matched_without_the_signature(name, monkeypatch):
    """The call after an accepted one is matched by the recent-layout test alone (the
    signature is not built); a different layout is not."""
    op = getattr(cute_kernels, name)
    op.forget_layouts()
    args = CASES[name]()
    op.check(*args)
    built = []
    signature = ops._signature
    monkeypatch.setattr(ops, "_signature", lambda *a: built.append(1) or signature(*a))
    op.check(*args)
    assert built == []
    other = (_offset(args[0]), *args[1:])  # misaligned: not matched, validated, rejected
    assert _message(op.check, *other) is not None and built == [1]


def test_check_matches_a_recent_layout_whose_addresses_are_not_all_16_aligned(monkeypatch):
    """An index tensor 8 bytes past a 16-byte boundary is valid (int64 asks for 8): check
    matches such a layout again without the signature when the addresses are the layout's
    modulo 16 or all 16-byte aligned, and takes the signature path for any other pattern."""
    op = cute_kernels.kv_rope_insert
    op.forget_layouts()
    args = list(CASES["kv_rope_insert"]())
    odd = [*args[:3], _offset(args[3]), *args[4:]]  # positions, int64
    assert odd[3].data_ptr() % 16 == 8
    assert op.check(*odd) is None
    built = []
    signature = ops._signature
    monkeypatch.setattr(ops, "_signature", lambda *a: built.append(1) or signature(*a))
    assert op.check(*[*odd[:3], _offset(args[3]), *odd[4:]]) is None  # the same pattern
    assert op.check(*args) is None  # all aligned
    assert built == []
    other = [*args[:2], _offset(args[2]), *args[3:]]  # slot_mapping 8 bytes off instead
    assert op.check(*other) is None and built == [1]


def test_one_tensor_in_two_places_is_matched_as_a_recent_layout(monkeypatch):
    """Dynamo's guard answers False for a tensor passed twice; the recent-layout test guards
    each object once and asks the other place to hold the same object, so such a layout is
    remembered once (it was rebuilt on every call, ~300 us each). Equal but distinct tensors
    there, or another tensor, are decided as a fresh validation decides them."""
    op = cute_kernels.kv_rope_insert
    args = list(CASES["kv_rope_insert"]())
    shared = [*args[:2], args[3], *args[3:]]  # slot_mapping is positions (same length, int64)
    built = []
    of = ops.RecentLayout.of
    monkeypatch.setattr(ops.RecentLayout, "of",
                        classmethod(lambda cls, *a: built.append(1) or of(*a)))
    with cpu_launches() as launches:
        op.forget_layouts()
        for _ in range(3):
            op(*shared)
            assert op.check(*shared) is None
        assert len(built) == 2 and len(launches) == 3  # one entry for the op, one for check
        twin = [*shared[:2], shared[3].clone(), *shared[3:]]  # equal, not the same object
        assert _message(op, *twin) is None and _message(op.check, *twin) is None
        other = [*shared[:2], shared[3].to(torch.int32), *shared[3:]]
        assert _message(op, *other) == _fresh(op, other) is not None
    stacked = cute_kernels.stacked_kv_proj
    args = list(stacked_kv_proj_case(8, hidden=128).args())
    shared = [*args[:9], [args[8][0], *args[9][1:]], *args[10:]]  # v_caches[0] is k_caches[0]
    stacked.forget_layouts()
    del built[:]
    for _ in range(3):
        assert stacked.check(*shared) is None
    assert len(built) == 1


def test_a_new_token_count_compiles_no_new_test_code():
    """Each token count is a new layout (the guard holds the sizes), but the generated test's
    source depends only on where the arguments sit: it is compiled once per call form (a
    compile cost ~300 us on the development Xeon, per new token count of every op)."""
    op = cute_kernels.kv_rope_insert
    op.forget_layouts()
    args = kv_rope_insert_case("bf16", 32, 16, "cpu").args()
    kv, k_cache, slots, positions, *rest = args
    with cpu_launches() as launches:
        op(kv[:1], k_cache, slots[:1], positions[:1], *rest)
        compiled = ops._compiled.cache_info().misses
        for tokens in range(2, 9):
            op(kv[:tokens], k_cache, slots[:tokens], positions[:tokens], *rest)
            assert launches[-1].args[0].shape[0] == tokens  # launched on this call's rows
        assert ops._compiled.cache_info().misses == compiled
        assert len(launches) == 8


@pytest.mark.parametrize("name", list(CASES))
def test_a_sparse_tensor_is_rejected_by_name(name):
    """A sparse tensor has neither strides nor a data pointer, so no signature: the check and
    the call validate it in full and name it; nothing is launched or remembered."""
    op = getattr(cute_kernels, name)
    op.forget_layouts()
    args = CASES[name]()
    first = next(iter(inspect.signature(op).parameters))
    bad = (args[0].to_sparse(), *args[1:])
    assert first in _message(op.check, *bad) and "torch.strided" in _message(op.check, *bad)
    with cpu_launches() as launches:
        assert _message(op, *bad) == _message(op.validate, *bad)
        assert launches == []
        op(*args)
        assert len(launches) == 1
    assert op.check(*args) is None


def _nested(t: torch.Tensor) -> torch.Tensor:
    """A nested tensor of the strided layout holding ``t``: no one shape, no strides (reading
    either raises), and Dynamo's tensor guard aborts the process on it."""
    return torch.nested.nested_tensor([t.clone()])


@pytest.mark.parametrize("name", list(CASES))
def test_a_nested_tensor_is_rejected_by_name(name):
    """In every tensor's place, after the layout was accepted by the op and by check (so the
    recent-layout test sees it first): a LayoutError naming the argument, from both, as a fresh
    validation raises it; nothing is launched."""
    op = getattr(cute_kernels, name)
    args = CASES[name]()
    params = list(inspect.signature(op).parameters)
    with cpu_launches() as launches:
        for place in _tensor_places(args):
            i, j = place
            bad = list(args)
            bad[i] = _nested(args[i]) if j is None else [
                _nested(c) if k == j else c for k, c in enumerate(args[i])]
            want = _fresh(op, bad)
            assert want is not None and want.startswith(params[i]), (place, want)
            assert "nested" in want, (place, want)
            op(*args)
            op.check(*args)
            del launches[:]
            assert _message(op, *bad) == want, place
            assert _message(op.check, *bad) == want, place
            assert launches == [], place


class _Subclass(torch.Tensor):
    pass


def _odd_values(value: object) -> list:
    """Values of other types, dtypes, layouts and sizes for the place of ``value``."""
    odd = [None, 0, -1, 1.5, float("nan"), 2**70, "x", b"x", True, object(), [], (), {}]
    if isinstance(value, torch.Tensor):
        odd += [value.as_subclass(_Subclass), value.to("meta"), value.unsqueeze(0),
                value[..., :0], torch.tensor(1.0), torch.empty(0),
                value.to(torch.complex64), value.to_sparse(), value.float().requires_grad_()]
        if value.dim() == 2:
            odd.append(value.t())
    elif isinstance(value, (list, tuple)):
        odd += [tuple(value), value[:-1], [*value, value[0]], [None] * len(value),
                [1] * len(value), [t.to("meta") for t in value], [t.float() for t in value]]
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        odd += [torch.tensor(value), -value, float("inf"), 10**30]
    return odd


@pytest.mark.parametrize("name", list(CASES))
def test_any_value_in_any_place_is_decided_as_a_fresh_validation_decides_it(name):
    """Every argument replaced by each of ~25 values of other types, dtypes, layouts and sizes,
    after the layout was accepted by the op and by check (so the recent-layout test and the
    signature see the call first): the op and check each raise exactly what a fresh
    validation raises — a LayoutError, never another exception — or accept it as it does."""
    op = getattr(cute_kernels, name)
    args = CASES[name]()
    with cpu_launches():
        for i, value in enumerate(args):
            for odd in _odd_values(value):
                bad = [*args[:i], odd, *args[i + 1:]]
                want = _fresh(op, bad)
                op(*args)
                op.check(*args)
                assert _message(op.check, *bad) == want, (i, repr(odd)[:60])
                if want is not None:  # (an accepted call would launch, which tells nothing)
                    assert _message(op, *bad) == want, (i, repr(odd)[:60])


def test_a_sparse_item_of_a_sequence_is_rejected_by_name():
    stacked = cute_kernels.stacked_kv_proj
    stacked.forget_layouts()
    args = list(stacked_kv_proj_case(8, hidden=128).args())
    stacked.check(*args)
    sparse_cache = [*args[:9], [args[9][0].to_sparse(), *args[9][1:]], *args[10:]]
    assert "v_caches[0]" in _message(stacked.check, *sparse_cache)


def test_a_recent_layout_asks_for_the_same_types_and_values():
    """int against bool or float, list against tuple, another length, requires_grad, an
    inference tensor: each misses the recent-layout test and is decided by the signature path, as a
    fresh validation decides it."""
    op = cute_kernels.kv_rope_insert
    op.forget_layouts()
    args = list(kv_rope_insert_case("bf16", 8, 16, "cpu").args())
    op.check(*args)
    as_int = [*args[:7], int(args[7])]  # kv_mxfp8 False -> 0
    assert _message(op.check, *as_int) == _message(op.validate, *as_int)
    as_float = [*args[:5], float(args[5]), *args[6:]]  # block_size 16 -> 16.0 (== 16)
    assert "block_size" in _message(op.check, *as_float)
    assert _message(op.check, *as_float) == _message(op.validate, *as_float)
    grad = [args[0].clone().requires_grad_(), *args[1:]]
    assert op.check(*grad) is None
    with torch.inference_mode():
        frozen = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    assert op.check(*frozen) is None
    stacked = cute_kernels.stacked_kv_proj
    stacked.forget_layouts()
    args = list(stacked_kv_proj_case(8, hidden=128).args())
    stacked.check(*args)
    as_tuples = [*args[:8], tuple(args[8]), tuple(args[9]), *args[10:]]
    assert stacked.check(*as_tuples) is None
    # a misaligned item of a sequence, the layout otherwise recent: check reads every item's
    # address (the recent test unpacks the sequences)
    misaligned = [*args[:9], [*args[9][:-1], _offset(args[9][-1])], *args[10:]]
    assert "v_caches[" in _message(stacked.check, *misaligned)
    assert _message(stacked.check, *misaligned) == _message(stacked.validate, *misaligned)
    shorter = [*args[:8], args[8][:-1], args[9], *args[10:]]
    assert "v_caches" in _message(stacked.check, *shorter)
    # something other than a tensor where the layout had one, in a sequence or not: the
    # generated test answers no (it does not raise), and the validation names the argument
    not_a_cache = [*args[:8], [*args[8][:-1], "cache"], *args[9:]]
    assert "k_caches[" in _message(stacked.check, *not_a_cache)
    not_positions = [*args[:5], args[5].tolist(), *args[6:]]
    assert "positions" in _message(stacked.check, *not_positions)
    with cpu_launches() as launches:
        stacked(*args)
        assert "k_caches[" in _message(stacked, *not_a_cache)
        assert "positions" in _message(stacked, *not_positions)
        assert len(launches) == 1


def test_more_layouts_than_the_recent_ones_stay_correct():
    """Cycling through more layouts than RECENT_LAYOUTS: every call still decided right."""
    op = cute_kernels.kv_rope_insert
    op.forget_layouts()
    cases = [kv_rope_insert_case("bf16", tokens, 16, "cpu").args()
             for tokens in range(1, ops.RECENT_LAYOUTS + 3)]
    for _ in range(3):
        for args in cases:
            assert op.check(*args) is None
            bad = (_offset(args[0]), *args[1:])
            assert "aligned" in _message(op.check, *bad)


@pytest.mark.parametrize("name", list(CASES))
def test_every_rejection_survives_an_accepted_twin(name):
    """Accept the layout, then change one argument at a time in ways the validation
    rejects: each change is a new signature, rejected exactly as on a fresh process."""
    op = getattr(cute_kernels, name)
    args = CASES[name]()
    op.forget_layouts()
    fresh = []
    variants = []
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor) and a.numel() > 1:
            variants.append(args[:i] + (a.to(torch.float16),) + args[i + 1:])
            variants.append(args[:i] + (a.unsqueeze(0),) + args[i + 1:])
    for v in variants:
        op.forget_layouts()
        fresh.append(_message(op.check, *v))
    op.forget_layouts()
    assert op.check(*args) is None
    for v, want in zip(variants, fresh, strict=True):
        assert _message(op.check, *v) == want
    assert sum(m is not None for m in fresh) == len(variants)


def test_unhashable_arguments_fall_back_to_the_full_validation():
    op = cute_kernels.kv_rope_insert
    args = list(CASES["kv_rope_insert"]())
    args[3] = {"not": "a tensor"}  # unhashable
    with pytest.raises(LayoutError, match="positions: expected a torch.Tensor"):
        op.check(*args)


def test_the_op_path_keeps_rejecting_cpu_tensors():
    args = CASES["kv_rope_insert"]()
    for _ in range(2):  # never remembered: the CUDA check is part of the op's rejection
        with pytest.raises(LayoutError, match="kv: expected a CUDA tensor"):
            cute_kernels.kv_rope_insert(*args)


def test_the_arch_override_is_part_of_the_signature(monkeypatch):
    op = cute_kernels.kv_rope_insert
    op.forget_layouts()
    args = tuple(a.to("meta") if isinstance(a, torch.Tensor) and a.is_contiguous() else a
                 for a in CASES["kv_rope_insert"]())
    monkeypatch.setenv("CUTE_KERNELS_ARCH", "sm_90a")
    assert op.check(*args) is None
    monkeypatch.setenv("CUTE_KERNELS_ARCH", "sm_80")
    with pytest.raises(LayoutError, match="arch: expected one of"):
        op.check(*args)


def test_signature_reads_alignment_dtype_shape_strides_and_device():
    t = torch.zeros(4, 8)
    base = ops.layout_signature((t,))
    assert ops.layout_signature((t.clone(),)) == base  # same layout, other storage
    assert ops.layout_signature((_offset(t),)) != base
    assert ops.layout_signature((t.double(),)) != base
    assert ops.layout_signature((t.t(),)) != base
    assert ops.layout_signature((t[:2],)) != base
    assert ops.layout_signature((t.to("meta"),)) != ops.layout_signature((_offset(t),))
    assert ops.layout_signature((1,)) != ops.layout_signature((1.0,))
    assert ops.layout_signature((True,)) != ops.layout_signature((1,))


# -- the op path, run on CPU tensors (cute_kernels.testing.cpu_launches) -----------------------

FORMAT_CASES = {
    "kv_rope_insert": [lambda fmt=fmt: kv_rope_insert_case(fmt, 8, 16, "cpu").args()
                       for fmt in ("bf16", "fp8", "v4_packed", "v41_mxfp8")],
    "compress_c128": [lambda fmt=fmt: compress_c128_case(fmt, 16, 2, "cpu").args()
                      for fmt in ("bf16", "fp8", "v4_packed")],
    "stacked_kv_proj": [lambda: stacked_kv_proj_case(8, hidden=128).args(),
                        lambda: stacked_kv_proj_case(8, hidden=128, bias=True,
                                                     commit=True).args()],
}


def _fresh(op, args) -> str | None:
    """What the full validation says of ``args``, with nothing remembered."""
    op.forget_layouts()
    return _message(op.check, *args)


def _tensor_places(args: tuple) -> list[tuple[int, int | None]]:
    """(argument, list item or None) of every tensor in ``args``."""
    places = []
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor):
            places.append((i, None))
        elif isinstance(a, (list, tuple)):
            places += [(i, j) for j in (0, len(a) - 1)]
    return places


def _at(args: tuple, place: tuple[int, int | None]) -> torch.Tensor:
    i, j = place
    return args[i] if j is None else args[i][j]


def _misaligned_storage(t: torch.Tensor) -> tuple[torch.UntypedStorage, int]:
    extent = 1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride(), strict=True))
    return torch.empty(extent + 1, dtype=t.dtype).untyped_storage(), 1


def _set_misaligned(t: torch.Tensor) -> None:
    storage, offset = _misaligned_storage(t)
    t.set_(storage, offset, t.shape, t.stride())


def _set_aligned(t: torch.Tensor) -> None:
    storage, _ = _misaligned_storage(t)
    t.set_(storage, 0, t.shape, t.stride())


def _other_dtype(t: torch.Tensor) -> None:
    other = torch.float16 if t.dtype != torch.float16 else torch.float32
    t.data = torch.zeros(t.shape, dtype=other)


def _swap_misaligned(t: torch.Tensor) -> None:
    torch.utils.swap_tensors(t, _offset(t.contiguous()))


#: In-place changes of a tensor's metadata: the same Python object afterwards, with another
#: layout (or, for set_ to an aligned copy, the same layout at another address).
MUTATIONS = {
    "unsqueeze_": lambda t: t.unsqueeze_(0),
    "as_strided_": lambda t: t.as_strided_((1,) * t.dim(), t.stride()),
    "resize_": lambda t: t.resize_(*[s + 1 for s in t.shape]),
    "t_": lambda t: t.t_() if t.dim() == 2 else t.squeeze_(),
    "as_strided_ stride 0": lambda t: t.as_strided_(t.shape, (0, *t.stride()[1:])),
    "set_ misaligned": _set_misaligned,
    "set_ aligned": _set_aligned,
    ".data = other dtype": _other_dtype,
    "swap_tensors meta": lambda t: torch.utils.swap_tensors(t, torch.empty_strided(
        t.shape, t.stride(), dtype=t.dtype, device="meta")),
    "swap_tensors misaligned": _swap_misaligned,
    "swap_tensors nested": lambda t: torch.utils.swap_tensors(t, _nested(t)),
}


@pytest.mark.parametrize("mutation", list(MUTATIONS))
@pytest.mark.parametrize("name", list(CASES))
def test_in_place_metadata_changes_after_acceptance(name, mutation):
    """Accept a layout through both the op and check, then change one tensor's metadata in
    place: the op and check answer exactly what a fresh validation answers, and an accepted call
    launches on the tensor as it is now."""
    op = getattr(cute_kernels, name)
    with cpu_launches() as launches:
        for place in _tensor_places(CASES[name]()):
            args = CASES[name]()
            t = _at(args, place)
            if t.numel() <= 1 and mutation == "t_":
                continue
            op.forget_layouts()
            op(*args)
            op(*args)
            assert op.check(*args) is None
            MUTATIONS[mutation](t)
            got_op, got_check = _message(op, *args), _message(op.check, *args)
            want = _fresh(op, args)
            assert got_op == want, (place, got_op, want)
            assert got_check == want, (place, got_check, want)
            if want is None:  # still accepted: the launch got the tensor's current address
                del launches[:]
                op(*args)
                (launch,) = launches
                assert t.data_ptr() in _addresses(launch.args), place


def test_a_refused_launch_of_a_recent_layout(monkeypatch):
    """A recent layout is matched without its addresses: a misaligned tensor is refused by the
    compiled function (TVM-FFI's ValueError), and the op raises the validation's LayoutError
    instead; a launch that fails for another reason on a valid layout re-raises its error."""
    from cute_kernels import testing

    op = cute_kernels.stacked_kv_proj
    args = CASES["stacked_kv_proj"]()
    with cpu_launches() as launches:
        op(*args)
        bad = list(args)
        bad[8] = [*args[8][:-1], _offset(args[8][-1])]  # the last K cache, misaligned
        with pytest.raises(LayoutError, match=r"k_caches\[1\]: expected a data pointer aligned"):
            op(*bad)
        assert len(launches) == 1  # refused before the launch

        def failing(alignments: tuple, values: tuple) -> None:
            raise RuntimeError("CUDA error: an illegal instruction was encountered")

        monkeypatch.setattr(testing, "_refuse_misaligned", failing)
        with pytest.raises(RuntimeError, match="illegal instruction"):
            op(*args)
        monkeypatch.undo()
        op(*args)
        assert len(launches) == 2


def _addresses(values: tuple) -> set[int]:
    out = set()
    for v in values:
        if isinstance(v, torch.Tensor):
            out.add(v.data_ptr())
        elif isinstance(v, (list, tuple)):
            out |= _addresses(tuple(v))
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_the_op_and_check_agree_with_a_fresh_validation(name):
    """For each accepted layout and each variant of it (other dtypes, ranks, alignments, scalar
    values): the op, check and a fresh validation say the same, in any order."""
    op = getattr(cute_kernels, name)
    with cpu_launches():
        for make in FORMAT_CASES[name]:
            args = make()
            variants = [args]
            for i, a in enumerate(args):
                if isinstance(a, torch.Tensor):
                    variants += [args[:i] + (v,) + args[i + 1:]
                                 for v in (a.to(torch.float16), a.unsqueeze(0), _offset(a))]
                elif isinstance(a, bool):
                    variants.append(args[:i] + (not a,) + args[i + 1:])
                    variants.append(args[:i] + (int(a),) + args[i + 1:])
                elif isinstance(a, int):
                    variants += [args[:i] + (v,) + args[i + 1:] for v in (a + 1, float(a), True)]
                elif isinstance(a, float):
                    variants += [args[:i] + (v,) + args[i + 1:]
                                 for v in (-1.0, float("nan"), float("inf"), 0, True)]
            fresh = [_fresh(op, v) for v in variants]
            assert fresh[0] is None
            op.forget_layouts()
            for _ in range(2):
                for v, want in zip(variants, fresh, strict=True):
                    assert _message(op, *v) == want
                    assert _message(op.check, *v) == want


def test_a_launch_matches_the_layout():
    """What each op hands the compiled function: the caller's cache tensor itself (the kernel
    views it as bytes), a 1-D scale, the C128 grid and the stacked plan's schedule, on every
    call."""
    with cpu_launches(resident={(8, 2, 256): 30}) as launches:
        case = kv_rope_insert_case("fp8", 8, 16, "cpu")
        scale = torch.tensor([[0.5]])
        for _ in range(3):
            cute_kernels.kv_rope_insert(*case.args()[:6], scale)
        assert len(launches) == 3
        for launch in launches:
            cache, got_scale = launch.args[4], launch.args[5]
            assert cache is case.k_cache and cache.dtype == torch.float8_e4m3fn
            assert got_scale.shape == (1,) and got_scale.data_ptr() == scale.data_ptr()

        del launches[:]
        # the cluster core's grid: the resident clusters; the stream core's: one CTA per SM,
        # never more than tokens
        for tokens, grid in ((30, 30), (64, 64), (4096, 132)):
            case = compress_c128_case("bf16", tokens, 2, "cpu")
            for _ in range(2):
                cute_kernels.compress_c128(*case.args())
            assert [launch.args[-1] for launch in launches] == [grid, grid]
            assert all(launch.args[8] is case.k_cache for launch in launches)
            assert {launch.key.core for launch in launches} == {
                "cluster" if tokens < 31 else "stream"}
            del launches[:]

        del launches[:]
        from cute_kernels.stacked_kv_proj.interface import plan_for_call

        case = stacked_kv_proj_case(8, hidden=128, commit=True)
        plan = plan_for_call(case.args())
        for _ in range(2):
            cute_kernels.stacked_kv_proj(*case.args())
        assert len(launches) == 2
        for launch in launches:
            assert launch.key.variant == plan.variant
            assert launch.args[7] is case.cache_loc_2d  # as it comes: the kernel reads [T]
            schedule = ((plan.grid, plan.dp_tiles) if plan.variant.impl == "wgmma"
                        else (plan.splits,))
            assert launch.args[-len(schedule):] == schedule
            assert launch.args[10] == tuple(case.k_caches)


def test_stacked_overrides_are_part_of_the_signature(monkeypatch):
    """CUTE_KERNELS_STACKED_* change the plan and may reject: a layout accepted before an
    override changes is validated and planned again."""
    op = cute_kernels.stacked_kv_proj
    args = CASES["stacked_kv_proj"]()
    with cpu_launches() as launches:
        op(*args)
        assert op.check(*args) is None
        monkeypatch.setenv("CUTE_KERNELS_STACKED_TILE", "nonsense")
        assert "CUTE_KERNELS_STACKED_TILE" in _message(op, *args)
        assert "CUTE_KERNELS_STACKED_TILE" in _message(op.check, *args)
        for tile in ("m128", "m64"):
            monkeypatch.setenv("CUTE_KERNELS_STACKED_TILE", tile)
            del launches[:]
            op(*args)
            assert launches[0].key.variant.tile == tile
        monkeypatch.setenv("CUTE_KERNELS_STACKED_IMPL", "mma")
        del launches[:]
        op(*args)
        # the 12 arguments, then the split-K workspace, its counters and the split count
        assert launches[0].key.variant.impl == "mma" and len(launches[0].args) == 15


@pytest.mark.parametrize("name", ["compress_c128", "stacked_kv_proj"])
def test_a_fallback_resident_count_is_not_remembered(name, monkeypatch):
    """While the driver cannot be asked (a capture), the grid comes from the formula and is
    worked out again on each call, until the query succeeds."""
    op = getattr(cute_kernels, name)
    args = (compress_c128_case("bf16", 512, 2, "cpu").args() if name == "compress_c128"
            else stacked_kv_proj_case(4, hidden=4096, num_layers=5, n_kv=8).args())
    with cpu_launches(resident={(8, 2, 256): 3, (1, 1, 384): 100}) as launches:
        monkeypatch.setenv("CUTE_KERNELS_STACKED_SCHEDULE", "streamk")  # a grid of all CTAs
        monkeypatch.setenv("CUTE_KERNELS_C128_CORE", "cluster")  # the core of clusters
        monkeypatch.setattr("torch.cuda.is_current_stream_capturing", lambda: True)
        op(*args)
        monkeypatch.setattr("torch.cuda.is_current_stream_capturing", lambda: False)
        op(*args)
        op(*args)
    first, second, third = launches
    if name == "compress_c128":
        assert (first.args[-1], second.args[-1], third.args[-1]) == (33, 3, 3)
    else:
        assert (first.args[-2], second.args[-2], third.args[-2]) == (132, 100, 100)


def test_a_cluster_split_is_planned_from_the_drivers_cluster_count(monkeypatch):
    """A TP-8 decode step splits its 10 weight tiles 8 ways in clusters; where the driver
    holds fewer clusters of 8 than that, the split is lowered until they all fit. While the
    driver cannot be asked, the formula plans, and the next call plans again."""
    args = stacked_kv_proj_case(1, hidden=4096, num_layers=5, n_kv=1).args()
    with cpu_launches(resident={(8, 2, 128): 9, (7, 2, 128): 11}) as launches:
        monkeypatch.setattr("torch.cuda.is_current_stream_capturing", lambda: True)
        cute_kernels.stacked_kv_proj(*args)
        monkeypatch.setattr("torch.cuda.is_current_stream_capturing", lambda: False)
        cute_kernels.stacked_kv_proj(*args)
        cute_kernels.stacked_kv_proj(*args)
    assert all(launch.key.variant.cluster for launch in launches)
    # 10 x 8 = 80 CTAs > 9 clusters of 8; 10 x 7 = 70 <= 11 clusters of 7
    assert [launch.args[-1] for launch in launches] == [8, 7, 7]


def test_the_environment_is_read_as_os_environ_has_it(monkeypatch):
    read = ops._env_reader(("CUTE_KERNELS_TEST_A", "CUTE_KERNELS_TEST_B"))
    one = ops._env_reader(("CUTE_KERNELS_TEST_A",))
    monkeypatch.delenv("CUTE_KERNELS_TEST_A", raising=False)
    monkeypatch.delenv("CUTE_KERNELS_TEST_B", raising=False)
    assert read() == (None, None) and one() == (None,)
    monkeypatch.setenv("CUTE_KERNELS_TEST_A", "x")
    first = read()
    assert first != (None, None) and one() == first[:1]
    monkeypatch.setenv("CUTE_KERNELS_TEST_A", "y")
    assert read() != first and read()[1] is None
    monkeypatch.setenv("CUTE_KERNELS_TEST_B", "x")
    assert read()[1] == first[0]
    monkeypatch.delenv("CUTE_KERNELS_TEST_A")
    assert read() == (None, first[0])
    monkeypatch.delenv("CUTE_KERNELS_TEST_B")  # none set again: the key view is live
    assert read() == (None, None) and one() == (None,)
    monkeypatch.setattr("os.environ", {"CUTE_KERNELS_TEST_A": "z"})
    assert read() == ("z", None) and one() == ("z",)


def test_torch_compile_keeps_the_op_opaque():
    """Under torch.compile(fullgraph=True) the public function calls the custom op, which
    launches at run time."""
    args = CASES["kv_rope_insert"]()
    with cpu_launches() as launches:
        compiled = torch.compile(lambda *a: cute_kernels.kv_rope_insert(*a), fullgraph=True,
                                 backend="eager")
        compiled(*args)
        assert len(launches) == 1
