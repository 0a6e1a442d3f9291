"""The reference (the executable spec) against first principles, on the CPU."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
import torch

from cute_kernels import reference
from cute_kernels.layouts import NOPE_DIM, CacheFormat
from cute_kernels.testing import POISON, extreme_kv_rows
from cute_kernels.testing import kv_rope_insert_case as make_case

FORMATS = [f.value for f in CacheFormat]


def _round_to_f32_exact(x: Fraction) -> float:
    """Correct RNE rounding of an exact rational to fp32 (no double rounding)."""
    lo = np.float32(float(x))  # within one ulp of the answer
    for cand in (np.nextafter(lo, np.float32(-np.inf)), lo, np.nextafter(lo, np.float32(np.inf))):
        err = abs(Fraction(float(cand)) - x)
        half = Fraction(float(np.spacing(np.float32(abs(cand))))) / 2
        if err < half or (err == half and (int(cand.view(np.int32)) & 1) == 0):
            return float(cand)
    raise AssertionError("no fp32 within half an ulp")


def test_fma_f32_is_exactly_rounded():
    gen = torch.Generator().manual_seed(1)
    a = torch.randn(3000, generator=gen)
    b = torch.randn(3000, generator=gen)
    c = -(a * b) * (1 + torch.randn(3000, generator=gen) * 1e-6)  # heavy cancellation
    c[:1000] = torch.randn(1000, generator=gen)
    got = reference.fma_f32(a, b, c)
    for i in range(0, 3000, 7):
        exact = Fraction(a[i].item()) * Fraction(b[i].item()) + Fraction(c[i].item())
        assert got[i].item() == _round_to_f32_exact(exact), i


def test_fma_f32_differs_from_unfused():
    gen = torch.Generator().manual_seed(2)
    a, b, c = (torch.randn(100000, generator=gen) for _ in range(3))
    assert not torch.equal(reference.fma_f32(a, b, c), a * b + c)  # the rounding is real


def test_ue8m0_exponent_matches_log2_rule():
    amax = torch.cat([
        torch.rand(5000) * 1000,
        torch.tensor([0.0, 1e-6, 1e-4, 0.0448, 448.0, 896.0, 224.0, 3.5, 448.0 * 2**-20]),
    ])
    got = reference.ue8m0_exponent(amax)
    for a, e in zip(amax.tolist(), got.tolist(), strict=True):
        q = float(np.float32(max(np.float32(a), np.float32(1e-4))) / np.float32(448.0))
        assert e == math.ceil(math.log2(q)), a


def _decode_e4m3(codes: torch.Tensor) -> torch.Tensor:
    return codes.view(torch.float8_e4m3fn).float()


def _rotate64(x: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """Float64 GPT-J rotation of dims 448..511, interleaved."""
    x = x.double()
    c, s = cos_sin[:, :32].double(), cos_sin[:, 32:].double()
    e, o = x[:, NOPE_DIM::2], x[:, NOPE_DIM + 1 :: 2]
    return torch.stack([e * c - o * s, e * s + o * c], dim=-1).reshape(-1, 64)


def _written(case, fmt):
    """(tokens, slots) that were written, and each slot's page byte base and row."""
    tokens = torch.nonzero(case.slot_mapping >= 0).flatten()
    slots = case.slot_mapping[tokens]
    elem = case.k_cache.element_size()
    page = (slots // case.block_size) * case.k_cache.stride(0) * elem
    return tokens, slots, page, slots % case.block_size


def _bytes(case, start: torch.Tensor, length: int) -> torch.Tensor:
    flat = case.backing.view(torch.uint8)
    return flat[start.unsqueeze(1) + torch.arange(length)]


@pytest.mark.parametrize("extreme", [False, True])
@pytest.mark.parametrize("fmt", ["v4_packed", "v41_mxfp8"])
def test_packed_records_dequantise_to_the_input(fmt, extreme):
    """Every written record decodes to its input within e4m3's step; ``extreme``: the rows of
    ``extreme_kv_rows`` (the GPU test's byte-exact inputs), so the reference they are held to
    follows the scale rule across the whole bf16 range."""
    case = make_case(fmt, 700, 64, "cpu")
    if extreme:
        extreme_kv_rows(case.kv)
    reference.kv_rope_insert(*case.args())
    tokens, slots, page, row = _written(case, fmt)
    bs = case.block_size
    x = case.kv[tokens].float()
    cos_sin = case.cos_sin_cache[case.positions[tokens]]
    rope = _rotate64(x, cos_sin)
    if fmt == "v4_packed":
        data = _bytes(case, page + row * 576, 576)
        scales = _bytes(case, page + bs * 576 + row * 8, 8)
        assert bool((scales[:, 7] == 0).all()), "pad byte"
        values, group, groups = x[:, :NOPE_DIM].double(), 64, 7
        codes = data[:, :NOPE_DIM]
        got_rope = data[:, NOPE_DIM:].contiguous().view(torch.bfloat16).double()
        assert torch.allclose(got_rope, rope, rtol=2**-8, atol=1e-6)  # bf16 rounding
    else:
        data = _bytes(case, page + row * 512, 512)
        scales = _bytes(case, page + bs * 512 + row * 16, 16)
        values = torch.cat([x[:, :NOPE_DIM].double(), rope], dim=1)
        group, groups = 32, 16
        codes = data
    exps = scales[:, :groups].long() - 127
    # the scale rule: e = ceil(log2(max(amax, 1e-4) / 448)) per group
    amax = values.reshape(len(tokens), groups, group).abs().amax(-1)
    want = torch.tensor([[math.ceil(math.log2(max(a, 1e-4) / 448)) for a in r]
                         for r in amax.tolist()])
    if fmt == "v4_packed":
        assert torch.equal(exps, want)
    else:  # V4.1 quantises bf16-rounded values: the exponent may differ where rounding crosses
        assert (exps - want).abs().max() <= 1
    deq = _decode_e4m3(codes).double().reshape(len(tokens), groups, group)
    deq = deq * torch.pow(2.0, exps.double()).unsqueeze(-1)
    ref = values.reshape(len(tokens), groups, group)
    tol = ref.abs() * 2**-4 + torch.pow(2.0, exps.double() - 9).unsqueeze(-1)
    assert bool(((deq - ref).abs() <= tol + 2**-8 * ref.abs()).all())


def test_bf16_keeps_nope_bits_and_rotates_rope():
    case = make_case("bf16", 100, 32, "cpu")
    reference.kv_rope_insert(*case.args())
    tokens = torch.nonzero(case.slot_mapping >= 0).flatten()
    slots = case.slot_mapping[tokens]
    rows = case.k_cache[slots // 32, slots % 32]
    assert torch.equal(rows[:, :NOPE_DIM], case.kv[tokens, :NOPE_DIM])
    rope = _rotate64(case.kv[tokens].float(), case.cos_sin_cache[case.positions[tokens]])
    assert torch.allclose(rows[:, NOPE_DIM:].double(), rope, rtol=2**-8, atol=1e-6)


def test_fp8_multiplies_by_the_reciprocal_scale():
    case = make_case("fp8", 100, 32, "cpu")
    reference.kv_rope_insert(*case.args())
    tokens = torch.nonzero(case.slot_mapping >= 0).flatten()
    slots = case.slot_mapping[tokens]
    rows = case.k_cache[slots // 32, slots % 32].float().double()
    x = case.kv[tokens].double()
    x[:, NOPE_DIM:] = _rotate64(case.kv[tokens].float(), case.cos_sin_cache[case.positions[tokens]])
    want = (x / 0.7).clamp(-448, 448)
    assert bool(((rows - want).abs() <= want.abs() * 2**-4 + 2**-9).all())


def _record_bytes(case, fmt: CacheFormat) -> torch.Tensor:
    """Byte mask over the backing of the written slots' records, from the layout of
    specs/kv_rope_insert.md: a packed page holds ``block_size`` data records, then their
    scale rows; a plain cache one row per slot at ``stride(1)``."""
    _, _, page, row = _written(case, fmt)
    if fmt.packed:
        starts = [(page + row * fmt.data_bytes, fmt.data_bytes),
                  (page + case.block_size * fmt.data_bytes + row * fmt.scale_bytes,
                   fmt.scale_bytes)]
    else:
        starts = [(page + row * case.k_cache.stride(1) * case.k_cache.element_size(),
                   fmt.row_bytes)]
    mask = torch.zeros(case.backing.view(torch.uint8).numel(), dtype=torch.bool)
    for start, n in starts:
        mask[(start.unsqueeze(1) + torch.arange(n)).flatten()] = True
    return mask


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_only_selected_records_change(fmt):
    """Every changed byte lies in the record of a selected slot, and most of those records'
    bytes change (a byte may keep the poison's value by chance)."""
    case = make_case(fmt, 64, 32, "cpu")
    reference.kv_rope_insert(*case.args())
    changed = case.backing.view(torch.uint8).flatten() != POISON
    footprint = _record_bytes(case, CacheFormat(fmt))
    assert not bool((changed & ~footprint).any())
    assert int(changed.sum()) > 0.9 * int(footprint.sum())
    case.poison()
    case.slot_mapping.fill_(-1)
    reference.kv_rope_insert(*case.args())
    assert bool((case.backing.view(torch.uint8) == POISON).all())


def test_rows_beyond_the_slots_are_ignored():
    case = make_case("bf16", 10, 32, "cpu", extra_rows=20)
    slots = case.slot_mapping.clone()
    reference.kv_rope_insert(*case.args())
    first = case.backing.clone()
    case.kv[10:] = 99.0  # DP padding rows: never read
    case.poison()
    reference.kv_rope_insert(*case.args())
    assert torch.equal(case.backing, first)
    assert torch.equal(case.slot_mapping, slots)


@pytest.mark.parametrize("fmt", FORMATS)
def test_out_of_range_indices_write_nothing(fmt):
    """A slot past the cache (into the guard page behind it, or far past it) or a position
    outside the cos/sin table skips its row, exactly as a negative slot does."""
    case = make_case(fmt, 40, 16, "cpu", out_of_range=True)
    capacity = case.k_cache.shape[0] * case.k_cache.shape[1]
    rows = case.slot_mapping.shape[0]
    positions = case.positions[:rows]
    out = ((case.slot_mapping >= capacity) | (positions < 0)
           | (positions >= case.cos_sin_cache.shape[0]))
    assert 6 <= int(out.sum()) < rows - 8  # some rows of each kind, most rows written
    reference.kv_rope_insert(*case.args())
    skipped_backing, skipped_cache = case.twin()
    skipped_backing.view(torch.uint8).fill_(POISON)
    slots = case.slot_mapping.clone()
    slots[out] = -1
    safe_positions = case.positions.clamp(0, case.cos_sin_cache.shape[0] - 1)
    reference.kv_rope_insert(case.kv, skipped_cache, slots, safe_positions, case.cos_sin_cache,
                             case.block_size, case.fp8_scale, case.kv_mxfp8)
    assert torch.equal(case.backing.view(torch.uint8), skipped_backing.view(torch.uint8))
    guard = case.backing.view(torch.uint8)[case.k_cache.shape[0] * case.k_cache.stride(0)
                                           * case.k_cache.element_size():]
    assert guard.numel() > 0 and bool((guard == POISON).all())
    assert bool((case.backing.view(torch.uint8) != POISON).any())  # the other rows were written


@pytest.mark.parametrize("slot_pattern", ["random", "paged", "decode"])
def test_a_one_slot_case_writes_its_slot(slot_pattern):
    """The cases skip the last of every ``skip_every`` slots, so a decode-sized case (T = 1..4)
    writes every row: a test at those sizes checks values, not only untouched poison."""
    case = make_case(CacheFormat.BF16, 1, 64, "cpu", slot_pattern=slot_pattern)
    assert int(case.slot_mapping[0]) >= 0
    assert (make_case(CacheFormat.BF16, 12, 64, "cpu").slot_mapping == -1).nonzero().view(
        -1).tolist() == [4, 9]
