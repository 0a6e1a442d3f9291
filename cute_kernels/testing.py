"""Test inputs and comparisons for the kernels, for this package's tests, ``perf/`` and users'
own tests: seeded, never zeros, poisoned outputs, padded and permuted layouts."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any
from unittest import mock

import torch

from . import reference
from .layouts import HEAD_DIM, CacheFormat
from .reference import in_table, k_norm_rope, stacked_kv_slots

#: Every byte of a fresh output backing (0xA5A5 is a finite bf16, ~ -2.9e-16).
POISON = 0xA5

# -- kv_rope_insert ------------------------------------------------------------------------------


@dataclasses.dataclass
class KvRopeInsertCase:
    kv: torch.Tensor
    k_cache: torch.Tensor
    backing: torch.Tensor  # the whole allocation behind k_cache, padding included
    slot_mapping: torch.Tensor
    positions: torch.Tensor
    cos_sin_cache: torch.Tensor
    block_size: int
    fp8_scale: torch.Tensor | None
    kv_mxfp8: bool

    def args(self, k_cache: torch.Tensor | None = None) -> tuple:
        return (self.kv, self.k_cache if k_cache is None else k_cache, self.slot_mapping,
                self.positions, self.cos_sin_cache, self.block_size, self.fp8_scale,
                self.kv_mxfp8)

    def poison(self) -> None:
        self.backing.view(torch.uint8).fill_(POISON)

    def twin(self) -> tuple[torch.Tensor, torch.Tensor]:
        """A second backing with the same strides (for the reference), and its cache view."""
        backing = self.backing.clone()
        return backing, backing.as_strided(self.k_cache.shape, self.k_cache.stride())


def kv_page_stride(block_size: int, width: int) -> int:
    """vLLM's test padding: whole 576-element units plus one more (always some page padding)."""
    return -(-block_size * width // 576) * 576 + 576


def kv_rope_insert_case(
    fmt: CacheFormat | str, num_slots: int, block_size: int, device: str | torch.device,
    extra_rows: int = 3, seed: int = 42, kv_rows: int | None = None,
    max_pos: int | None = None, positions_base: int = 7, skip_every: int = 5,
    slot_pattern: str = "random", out_of_range: bool = False,
) -> KvRopeInsertCase:
    """Inputs in the layout vLLM's own regression test uses: padded ``as_strided`` pages,
    poison, random scattered slots with every ``skip_every``-th one -1, and ``kv`` rows beyond
    the slots (DP padding). ``slot_pattern``: "random" scatters every slot (the regression-test
    layout); "paged" is what a paged allocator gives a prefill: pages in random order, slots
    consecutive inside; "decode" is one random slot per request, as a decode step writes.
    ``out_of_range``: the backing holds a guard page past the cache, and some rows' slots
    point into it or past it, or are negative with a slot's low 32 bits, some positions lie
    outside the cos/sin table (those rows write nothing)."""
    fmt = CacheFormat(fmt)
    dtype, mxfp8, width = fmt.dtype, fmt is CacheFormat.V41_MXFP8, fmt.record_width
    gen = torch.Generator(device="cpu").manual_seed(seed)
    rows = kv_rows if kv_rows is not None else num_slots + extra_rows
    num_blocks = max(1, -(-(num_slots + 7) // block_size))
    if slot_pattern == "decode":  # every slot in a page of its own
        num_blocks = num_slots + 1
    stride = kv_page_stride(block_size, width)
    backing = torch.empty((num_blocks + int(out_of_range)) * stride, dtype=dtype, device=device)
    backing.view(torch.uint8).fill_(POISON)
    k_cache = backing.as_strided((num_blocks, block_size, width), (stride, width, 1))
    kv = torch.randn(rows, HEAD_DIM, generator=gen).to(torch.bfloat16).to(device)
    positions = (torch.arange(rows) + positions_base).to(device)
    angles = torch.randn(max_pos or rows + positions_base + 16, 32, generator=gen)
    cos_sin = torch.cat([angles.cos(), angles.sin()], dim=1).to(device)
    if slot_pattern == "random":
        slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_slots]
    elif slot_pattern == "decode":
        pages = torch.randperm(num_blocks, generator=gen)[:num_slots]
        slots = pages * block_size + torch.randint(0, block_size, (num_slots,), generator=gen)
    else:
        pages = torch.randperm(num_blocks, generator=gen)
        t = torch.arange(num_slots)
        slots = pages[t // block_size] * block_size + t % block_size
    if skip_every:  # the last of every skip_every rows: a one-row case still writes its row
        slots[skip_every - 1::skip_every] = -1
    if out_of_range:
        capacity = num_blocks * block_size
        past = slots[1::6]
        past.copy_(capacity + torch.arange(past.numel()) * 7 % block_size)  # the guard page
        past[-1:] = 2**40  # far past it
        # negative, with the low 32 bits of a slot of the cache: a kernel that narrowed the
        # slot before testing its sign would write them
        slots[3::6] -= 2**32
        positions[2::6] = cos_sin.shape[0]
        positions[4::6] = -1 - torch.arange(positions[4::6].numel(), device=device)
    scale = torch.tensor([0.7], device=device) if fmt is CacheFormat.FP8 else None
    return KvRopeInsertCase(kv, k_cache, backing, slots.to(device), positions, cos_sin,
                            block_size, scale, mxfp8)


def extreme_kv_rows(kv: torch.Tensor, seed: int = 7) -> None:
    """Overwrite ``kv``'s rows (bf16 ``[T, 512]``) in place with the magnitudes a quantiser
    must get right bit for bit, cycling over the rows: every power-of-two scale of the
    normal rows from bf16's subnormals (2^-133) to 2^100; zero rows; rows below the UE8M0
    floor (1e-4); and rows whose 16-dim runs each hold one spike at the 1.75 x 2^k boundary
    of the exponent rule, one bf16 step above it, or of either sign next to tiny values."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    rows, width = kv.shape
    base = torch.randn(rows, width, generator=gen)
    scale = torch.pow(2.0, torch.arange(rows) % 234 - 133.0)
    out = base * scale[:, None]
    kind = torch.arange(rows) % 7
    out[kind == 1] = 0.0
    out[kind == 2] = base[kind == 2] * 3e-5
    spikes = kind >= 3
    if bool(spikes.any()):
        k = (torch.arange(rows)[spikes] % 40 - 20).to(torch.float32)
        boundary = torch.tensor([1.75, 1.7578125, -1.75, -1.7578125])
        spike = boundary[kind[spikes] - 3][:, None] * torch.pow(2.0, k)[:, None]
        row = base[spikes] * 1e-3
        row[:, ::16] = spike
        out[spikes] = row
    kv.copy_(out.to(torch.bfloat16))


# -- compress_c128 -------------------------------------------------------------------------------


STATE_PAGE_STRIDE = 8208  # floats: a padded page (8 x 1024 + 16)


@dataclasses.dataclass
class CompressC128Case:
    state_cache: torch.Tensor
    block_table: torch.Tensor
    token_to_req: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    norm_weight: torch.Tensor
    eps: float
    cos_sin_cache: torch.Tensor
    k_cache: torch.Tensor
    backing: torch.Tensor
    kv_slot_mapping: torch.Tensor
    kv_block_size: int
    fp8_scale: torch.Tensor | None

    def args(self, k_cache: torch.Tensor | None = None) -> tuple:
        return (self.state_cache, self.block_table, self.token_to_req, self.positions,
                self.slot_mapping, self.norm_weight, self.eps, self.cos_sin_cache,
                self.k_cache if k_cache is None else k_cache, self.kv_slot_mapping,
                self.kv_block_size, self.fp8_scale)

    def fresh_cache(self, poison: int = POISON) -> tuple[torch.Tensor, torch.Tensor]:
        backing = torch.empty_like(self.backing)
        backing.view(torch.uint8).fill_(poison)
        return backing, backing.as_strided(self.k_cache.shape, self.k_cache.stride())

    @property
    def boundary(self) -> torch.Tensor:
        """The tokens that write a record."""
        return reference.c128_compressed_tokens(
            self.block_table, self.token_to_req, self.positions, self.slot_mapping,
            self.cos_sin_cache, self.k_cache, self.kv_slot_mapping)


def c128_page_stride(fmt: CacheFormat, kv_block_size: int) -> int:
    """In cache elements: vLLM's packed page (round up to 576 bytes), else one spare row."""
    if fmt.packed:
        return -(-kv_block_size * fmt.record_width // 576) * 576
    return (kv_block_size + 1) * HEAD_DIM


def compress_c128_case(
    fmt: CacheFormat | str, num_tokens: int, kv_block_size: int, device, *, seed: int = 0,
    boundary_every: int | None = 3, boundary_from: int = 0, num_requests: int = 4,
    windows: int = 8, negative_slots: bool = True, norm_dtype=torch.bfloat16,
    page_stride: int = STATE_PAGE_STRIDE, distinct_windows: bool = False,
    out_of_range: bool = False,
) -> CompressC128Case:
    """Permuted state pages with a padded page stride, boundary and non-boundary tokens,
    negative slots, a poisoned paged cache. ``boundary_every``: every n-th token sits on a
    boundary (None: every token; 0: none), from token ``boundary_from`` on.
    ``distinct_windows``: token t reads its own window (request t % R, window t // R), so no
    two tokens share state rows (honest bandwidth in the benchmark). ``out_of_range``: a guard
    page past the cache, and boundary tokens with, by turns, a record slot in it or far past
    it, a negative position, a window past its block-table row, a request outside the table;
    the cos/sin table ends before the last window; some page ids lie outside the state cache
    (clamped: their windows are written, from the pages clamped into it)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    t = torch.arange(num_tokens, device=device)
    if distinct_windows:
        windows = -(-num_tokens // num_requests)
        token_to_req = (t % num_requests).to(torch.int32)
        window = t // num_requests
    else:
        token_to_req = torch.randint(0, num_requests, (num_tokens,), generator=gen,
                                     device=device, dtype=torch.int32)
        window = torch.randint(0, windows, (num_tokens,), generator=gen, device=device)
    pages_per_req = windows * 16
    num_pages = num_requests * pages_per_req + 3
    state = torch.empty(num_pages * page_stride, device=device).as_strided(
        (num_pages, 8, 1024), (page_stride, 1024, 1))
    state.normal_(generator=gen)
    state[..., 512:] *= 3.0  # a peaked softmax
    block_table = torch.randperm(num_pages, generator=gen, device=device)
    block_table = block_table[: num_requests * pages_per_req]
    block_table = block_table.reshape(num_requests, pages_per_req).to(torch.int32)
    positions = window * 128 + torch.randint(0, 127, (num_tokens,), generator=gen, device=device)
    if boundary_every is None:
        on_boundary = torch.ones_like(t, dtype=torch.bool)
    elif boundary_every == 0:
        on_boundary = torch.zeros_like(t, dtype=torch.bool)
    else:
        on_boundary = t % boundary_every == boundary_every - 1
    on_boundary &= t >= boundary_from
    positions = torch.where(on_boundary, window * 128 + 127, positions)
    slot_mapping = t.clone()
    fmt = CacheFormat(fmt)
    dtype, width = fmt.dtype, fmt.record_width
    num_kv_blocks = -(-num_tokens // kv_block_size) + 2
    kv_slots = torch.randperm(num_kv_blocks * kv_block_size, generator=gen, device=device)
    kv_slots = kv_slots[:num_tokens].clone()
    if negative_slots:
        slot_mapping[t % 7 == 3] = -1
        kv_slots[t % 11 == 5] = -1
    if out_of_range:
        marked = torch.nonzero(on_boundary).flatten()[1::3]
        kind = torch.arange(marked.numel(), device=device) % 6
        guard = num_kv_blocks * kv_block_size
        kv_slots[marked[kind == 0]] = guard + marked[kind == 0] % kv_block_size
        kv_slots[marked[kind == 0][:1]] = 2**40
        positions[marked[kind == 1]] = -1
        positions[marked[kind == 2]] = windows * 128 + 127
        token_to_req[marked[kind == 3]] = num_requests
        token_to_req[marked[kind == 4]] = -1
        block_table.view(-1)[::37] = num_pages + 5
        block_table.view(-1)[5::37] = -3
    stride = c128_page_stride(fmt, kv_block_size)
    backing = torch.empty((num_kv_blocks + int(out_of_range)) * stride, dtype=dtype,
                          device=device)
    backing.view(torch.uint8).fill_(POISON)
    k_cache = backing.as_strided((num_kv_blocks, kv_block_size, width), (stride, width, 1))
    table_rows = (windows - 1) * 128 if out_of_range else windows * 128 + 16
    angles = torch.rand(table_rows, 32, generator=gen, device=device) * 6.3
    cos_sin = torch.cat([angles.cos(), angles.sin()], dim=1)
    norm_weight = (1 + 0.25 * torch.randn(HEAD_DIM, generator=gen, device=device)).to(norm_dtype)
    scale = torch.tensor([0.05], device=device) if fmt is CacheFormat.FP8 else None
    return CompressC128Case(state, block_table, token_to_req, positions, slot_mapping,
                            norm_weight, 1e-6, cos_sin, k_cache, backing, kv_slots,
                            kv_block_size, scale)


def _c128_reference(case: CompressC128Case) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference's output backing (from the case's poison) and the bytes it writes: those
    that differ from the poison under two poisons."""
    outputs = []
    for poison in (POISON, POISON ^ 0xFF):
        backing, cache = case.fresh_cache(poison)
        reference.compress_c128(*case.args(cache))
        outputs.append((backing, backing.view(torch.uint8) != poison))
    (backing, written), (_, also_written) = outputs
    return backing, written | also_written


def _e4m3_step(value: torch.Tensor) -> torch.Tensor:
    """The spacing of e4m3 codes at |value| (in the code's own scale)."""
    exp = torch.floor(torch.log2(value.abs().clamp_min(2.0**-6)))
    return torch.pow(2.0, exp - 3)


def _bf16_ulp(value: torch.Tensor) -> torch.Tensor:
    exp = torch.floor(torch.log2(value.abs().clamp_min(2.0**-126)))
    return torch.pow(2.0, exp - 7)


def _c128_bf16_tolerance(ref: torch.Tensor) -> torch.Tensor:
    """One bf16 ulp, with a floor for values near zero: the pooled sum cancels, and its fp32
    error (~2^-20 of the row's largest value) exceeds a tiny value's own ulp."""
    floor = ref.abs().amax(dim=-1, keepdim=True) * 2.0**-16
    return torch.maximum(_bf16_ulp(ref), floor)


def _c128_records(case: CompressC128Case, backing: torch.Tensor) -> tuple:
    """(tokens, codes-or-values region, scale region) of every boundary token's record."""
    tokens = torch.nonzero(case.boundary).flatten()
    slots = case.kv_slot_mapping[tokens]
    kb = case.kv_block_size
    elem = case.k_cache.element_size()
    page = (slots // kb) * case.k_cache.stride(0) * elem
    row = slots % kb
    flat = backing.view(torch.uint8)

    def take(start: torch.Tensor, n: int) -> torch.Tensor:
        return flat[start.unsqueeze(1) + torch.arange(n, device=flat.device)]

    if case.k_cache.dtype == torch.uint8:
        return tokens, take(page + row * 576, 576), take(page + kb * 576 + row * 8, 8)
    return tokens, take(page + row * case.k_cache.stride(1) * elem, 512 * elem), None


def c128_mismatch(case: CompressC128Case, got_backing: torch.Tensor) -> str | None:
    """Why ``got_backing`` (the case's cache backing after a call) breaks the tolerance rules
    of specs/compress_c128.md against the float64 reference, or None when it keeps them: every
    byte outside the records as poisoned, scale bytes exact (except where amax / 448 lies
    within 1e-6 of a power of two), fp8 values within one e4m3 step, bf16 values within one
    ulp (with a floor near zero)."""
    ref_backing, written = _c128_reference(case)
    got = got_backing.view(torch.uint8)
    if not bool((got[~written] == POISON).all()):
        return "bytes outside the records changed"
    tokens, got_data, got_scales = _c128_records(case, got_backing)
    _, ref_data, ref_scales = _c128_records(case, ref_backing)
    if tokens.numel() == 0:
        return None
    if case.k_cache.dtype == torch.uint8:
        y = reference.c128_normed_windows(case.state_cache, case.block_table, case.token_to_req,
                                          case.positions, case.norm_weight, case.eps, tokens)
        amax = y[:, :448].to(torch.bfloat16).double().reshape(-1, 7, 64).abs().amax(-1)
        q = torch.log2(amax.clamp_min(1e-4) / 448.0)
        ratio = torch.pow(2.0, q)
        near_pow2 = (torch.pow(2.0, q.round()) - ratio).abs() <= 1e-6 * ratio
        if not bool(((got_scales[:, :7] == ref_scales[:, :7]) | near_pow2).all()):
            return "scale bytes differ"
        if not bool((got_scales[:, 7] == 0).all()):
            return "pad byte"

        def decode(data: torch.Tensor, scales: torch.Tensor) -> tuple:
            codes = data[:, :448].contiguous().view(torch.float8_e4m3fn).double()
            return (codes.reshape(-1, 7, 64),
                    torch.pow(2.0, scales[:, :7].double() - 127).unsqueeze(-1))

        got_codes, got_scale = decode(got_data, got_scales)
        ref_codes, ref_scale = decode(ref_data, ref_scales)
        step = _e4m3_step(ref_codes) * torch.maximum(got_scale, ref_scale)
        err = (got_codes * got_scale - ref_codes * ref_scale).abs()
        if not bool((err <= step * (1 + 1e-9)).all()):
            return f"fp8 value off by {float((err / step).max())} steps"
        got_rope = got_data[:, 448:].contiguous().view(torch.bfloat16).double()
        ref_rope = ref_data[:, 448:].contiguous().view(torch.bfloat16).double()
        rope_err = (got_rope - ref_rope).abs() / _c128_bf16_tolerance(ref_rope)
        if not bool((rope_err <= 1 + 1e-9).all()):
            return f"bf16 RoPE off by {float(rope_err.max())} tolerances"
    elif case.k_cache.dtype == torch.bfloat16:
        g = got_data.contiguous().view(torch.bfloat16).double()
        r = ref_data.contiguous().view(torch.bfloat16).double()
        err = (g - r).abs() / _c128_bf16_tolerance(r)
        if not bool((err <= 1 + 1e-9).all()):
            worst = int(err.flatten().argmax())
            return (f"bf16 value off by {float(err.max())} tolerances: "
                    f"{float(g.flatten()[worst])} vs {float(r.flatten()[worst])}")
    else:
        g = got_data.contiguous().view(torch.float8_e4m3fn).double()
        r = ref_data.contiguous().view(torch.float8_e4m3fn).double()
        if not bool(((g - r).abs() <= _e4m3_step(r) * (1 + 1e-9)).all()):
            return "fp8 value off"
    return None


# -- stacked_kv_proj ------------------------------------------------------------------------------


ROPE_THETA = 1e6


def rope_table(max_pos: int, head_dim: int, theta: float = ROPE_THETA) -> torch.Tensor:
    """fp32 [max_pos, D]: cos of the D/2 frequencies, then their sin (NeoX layout)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return torch.cat([angles.cos(), angles.sin()], dim=1).float()


def commit_width(tokens: int) -> int:
    """A request width W dividing T (7/8 as in DSpark verify blocks; T itself otherwise)."""
    for w in (8, 7):
        if tokens % w == 0:
            return w
    return tokens


@dataclasses.dataclass
class StackedKvProjCase:
    ctx_hidden: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor | None
    k_norm_weight: torch.Tensor
    eps: float
    positions: torch.Tensor
    cos_sin_cache: torch.Tensor
    cache_loc: torch.Tensor
    k_caches: list[torch.Tensor]
    v_caches: list[torch.Tensor]
    k_backings: list[torch.Tensor]  # whole allocations behind the caches, padding included
    v_backings: list[torch.Tensor]
    cache_loc_2d: torch.Tensor | None
    commit_lens: torch.Tensor | None

    @property
    def num_layers(self) -> int:
        return len(self.k_caches)

    def args(self, k_caches=None, v_caches=None) -> tuple:
        return (self.ctx_hidden, self.weight, self.bias, self.k_norm_weight, self.eps,
                self.positions, self.cos_sin_cache, self.cache_loc,
                self.k_caches if k_caches is None else k_caches,
                self.v_caches if v_caches is None else v_caches,
                self.cache_loc_2d, self.commit_lens)

    def poison(self) -> None:
        for b in (*self.k_backings, *self.v_backings):
            b.view(torch.uint8).fill_(POISON)

    def twin(self) -> tuple[list, list, list, list]:
        """Copies of the backings with the same strides (for the reference), and their views:
        (k_backings, v_backings, k_caches, v_caches)."""
        kb = [b.clone() for b in self.k_backings]
        vb = [b.clone() for b in self.v_backings]
        kc = [b.as_strided(c.shape, c.stride()) for b, c in zip(kb, self.k_caches, strict=True)]
        vc = [b.as_strided(c.shape, c.stride()) for b, c in zip(vb, self.v_caches, strict=True)]
        return kb, vb, kc, vc

    def written_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows that write, their slots), from the documented rules (for caches of one slot
        count, as the cases have)."""
        rows, slots = stacked_kv_slots(self.cache_loc, self.cache_loc_2d, self.commit_lens)
        keep = (in_table(self.positions[rows], self.cos_sin_cache)
                & (slots < self.k_caches[0].shape[0]))
        return rows[keep], slots[keep]


def stacked_kv_proj_case(
    tokens: int,
    hidden: int = 256,
    num_layers: int = 2,
    n_kv: int = 2,
    head_dim: int = 128,
    device: str | torch.device = "cpu",
    *,
    bias: bool = False,
    commit: bool = False,
    row_pad: int = 0,
    norm_dtype: torch.dtype = torch.float32,
    skip_every: int = 5,
    extra_slots: int = 16,
    max_pos: int = 4096,
    eps: float = 1e-6,
    seed: int = 0,
    out_of_range: bool = False,
) -> StackedKvProjCase:
    """Per-layer caches with padded row strides and poison fill, scattered slots with every
    ``skip_every``-th one -1, optional bias, ``cache_loc_2d`` / ``commit_lens`` rows, distinct
    per-layer k-norm weights (a wrong layer or a wrong slice fails), and a real NeoX cos/sin
    table. ``row_pad`` extra elements per cache row (a multiple of 8 keeps rows 16-byte aligned).
    ``out_of_range``: each backing holds guard rows past its cache, and some rows' slots point
    into them or far past them, some positions lie outside the table (those rows write
    nothing)."""
    dev = torch.device(device)
    gen = torch.Generator(device=dev).manual_seed(seed)  # generate where the data lives
    kv = n_kv * head_dim
    rows = num_layers * 2 * kv
    x = torch.randn(tokens, hidden, generator=gen, device=dev).to(torch.bfloat16)
    w = (torch.randn(rows, hidden, generator=gen, device=dev) / hidden ** 0.5).to(torch.bfloat16)
    b = None
    if bias:
        b = (0.5 * torch.randn(rows, generator=gen, device=dev)).to(torch.bfloat16)
    norm_w = 1.0 + 0.25 * torch.randn(num_layers, head_dim, generator=gen, device=dev)
    norm_w = norm_w.to(norm_dtype)
    positions = torch.randint(0, max_pos, (tokens,), generator=gen, device=dev)
    slots = tokens + extra_slots
    loc = torch.randperm(slots, generator=gen, device=dev)[:tokens]
    if skip_every:  # the last of every skip_every rows: a one-row case still writes its row
        loc[skip_every - 1::skip_every] = -1
    guard_rows = 8 if out_of_range else 0
    if out_of_range:
        past = loc[1::6]
        past.copy_(slots + torch.arange(past.numel(), device=dev) % guard_rows)
        past[-1:] = 2**40
        positions[2::6] = max_pos
        positions[4::6] = -1
    loc_2d = lens = None
    if commit:
        width = commit_width(tokens)
        bs = tokens // width
        loc_2d = loc.reshape(bs, width).clone()
        lens = torch.randint(0, width + 1, (bs,), generator=gen, device=dev).to(torch.int32)
        lens[0] = width  # at least one full request
        loc = torch.full_like(loc, -1)  # replaced by cache_loc_2d: must be ignored

    stride0 = kv + row_pad

    def cache() -> tuple[torch.Tensor, torch.Tensor]:
        backing = torch.empty((slots + guard_rows) * stride0, dtype=torch.bfloat16,
                              device=device)
        backing.view(torch.uint8).fill_(POISON)
        return backing, backing.as_strided((slots, n_kv, head_dim), (stride0, head_dim, 1))

    ks = [cache() for _ in range(num_layers)]
    vs = [cache() for _ in range(num_layers)]
    return StackedKvProjCase(
        ctx_hidden=x, weight=w, bias=b, k_norm_weight=norm_w, eps=eps, positions=positions,
        cos_sin_cache=rope_table(max_pos, head_dim).to(dev), cache_loc=loc,
        k_caches=[c for _, c in ks], v_caches=[c for _, c in vs],
        k_backings=[b for b, _ in ks], v_backings=[b for b, _ in vs],
        cache_loc_2d=loc_2d, commit_lens=lens,
    )


#: An fp32 accumulation of K bf16 products (each exact) in any order differs from the exact sum
#: by about 2^-24 * sqrt(K) * sqrt(sum (x_i w_i)^2), 4e-6 of that norm at K = 4096 (measured
#: flips on the H200: 1.9e-6..3.3e-6 of it). An R1 value whose exact sum lies within this
#: fraction of that norm of a bf16 rounding midpoint may round either way in a correct kernel.
R1_MIDPOINT_WINDOW = 1e-5
#: More near-midpoint R1 values than this in one head is not a rounding-order effect.
MAX_R1_CANDIDATES = 8


def _bf16_neighbours(acc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The bf16 values just below and just above each float64 value of ``acc`` (non-zero)."""
    near = acc.to(torch.bfloat16)
    up = near.double() <= acc  # the other neighbour lies above
    negative = near < 0
    # sign-magnitude bits: one step up the pattern moves away from zero
    step = torch.where(up ^ negative, 1, -1).to(torch.int16)
    other = (near.view(torch.int16) + step).view(torch.bfloat16)
    return torch.minimum(near, other), torch.maximum(near, other)


def r1_flip_explains(case: StackedKvProjCase, layer: int, row: int, head: int,
                     got: torch.Tensor) -> bool:
    """Whether the kernel's K head ``got`` [D] of ``ctx_hidden`` row ``row`` is the reference's
    norm + RoPE of an R1 that rounds some near-midpoint sums (within R1_MIDPOINT_WINDOW) the
    other way: every element within 1 ulp for one such choice. Exact sums in float64."""
    d = got.shape[-1]
    kv = case.k_caches[0].shape[1] * d
    lo = layer * 2 * kv + head * d
    x = case.ctx_hidden[row].double()
    w = case.weight[lo:lo + d].double()
    terms = w * x
    acc = terms.sum(-1)
    if case.bias is not None:
        acc = acc + case.bias[lo:lo + d].double()
    below, above = _bf16_neighbours(acc)
    midpoint = (below.double() + above.double()) / 2
    window = R1_MIDPOINT_WINDOW * terms.pow(2).sum(-1).sqrt()
    candidates = ((acc - midpoint).abs() <= window).nonzero().squeeze(1).tolist()
    if len(candidates) > MAX_R1_CANDIDATES:
        return False
    y = acc.to(torch.bfloat16)
    table = case.cos_sin_cache[case.positions[row]].float()
    cos, sin = table[None, None, :d // 2], table[None, None, d // 2:]
    for choice in range(1 << len(candidates)):
        flipped = y.clone()
        for bit, col in enumerate(candidates):
            flipped[col] = above[col] if choice >> bit & 1 else below[col]
        want = k_norm_rope(flipped[None, None], case.k_norm_weight[layer], case.eps, cos, sin)
        if int(ulp_distance(got, want[0, 0]).max()) <= 1:
            return True
    return False


def _assert_close_or_r1_flip(case: StackedKvProjCase, layer: int | None, rows: torch.Tensor,
                             got: torch.Tensor, want: torch.Tensor) -> None:
    """assert_close(rtol=atol=2e-2) of written rows [R, n_kv, D]; a K head outside it passes
    only when :func:`r1_flip_explains` reproduces it (a summation-order effect, not a bug)."""
    bad = ~torch.isclose(got.float(), want.float(), rtol=2e-2, atol=2e-2)
    heads = bad.any(-1).nonzero().tolist()
    for r, h in heads:
        if layer is None or not r1_flip_explains(case, layer, int(rows[r]), h, got[r, h]):
            torch.testing.assert_close(got[r, h].float(), want[r, h].float(), rtol=2e-2,
                                       atol=2e-2, msg=lambda m, r=r, h=h: (
                                           f"row {int(rows[r])} head {h} (layer {layer}), not "
                                           f"explained by an R1 rounding flip: {m}"))


def ulp_distance(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """Distance in bf16 ulps (steps between representable values; +0 and -0 are equal)."""

    def ordered(t: torch.Tensor) -> torch.Tensor:
        bits = t.contiguous().view(torch.int16).to(torch.int32)
        return torch.where(bits < 0, -(bits & 0x7FFF), bits)

    return (ordered(got) - ordered(want)).abs()


@dataclasses.dataclass
class Comparison:
    within_one_ulp: float  # fraction of written K/V elements within 1 bf16 ulp
    max_ulp: int
    untouched_equal: bool  # every element of every row not written still holds the poison
    elements: int = 0  # written K/V elements compared

    @property
    def exact_enough(self) -> bool:
        return self.within_one_ulp >= 0.999 and self.untouched_equal


def compare_stacked(case: StackedKvProjCase, ref_k: list[torch.Tensor], ref_v: list[torch.Tensor],
            assert_close: bool = True) -> Comparison:
    """Kernel caches (``case``) against reference caches (same strides). Written rows: ulp
    statistics and ``assert_close(rtol=atol=2e-2)`` (a K head outside it must be reproduced by
    the reference with R1 flips of near-midpoint sums, :func:`_assert_close_or_r1_flip`); every
    other row (and the row padding) must still be poison."""
    rows, slots = case.written_rows()
    near = total = 0
    max_ulp = 0
    untouched = True
    # layer index for K caches, None for V caches (V heads are R1 itself: nothing to attribute)
    layers = (*range(case.num_layers), *([None] * case.num_layers))
    for layer, got_c, want_c, got_b in zip(layers, (*case.k_caches, *case.v_caches),
                                           (*ref_k, *ref_v),
                                           (*case.k_backings, *case.v_backings), strict=True):
        got, want = got_c[slots], want_c[slots]
        if slots.numel():
            d = ulp_distance(got, want)
            near += int((d <= 1).sum())
            total += d.numel()
            max_ulp = max(max_ulp, int(d.max()))
            if assert_close:
                _assert_close_or_r1_flip(case, layer, rows, got, want)
        mask = torch.ones(got_b.numel(), dtype=torch.bool, device=got_b.device)
        stride0 = got_c.stride(0)
        width = got_c.shape[1] * got_c.shape[2]
        cols = torch.arange(width, device=got_b.device)
        mask[(slots[:, None] * stride0 + cols[None, :]).reshape(-1)] = False
        untouched &= bool((got_b.view(torch.uint8).view(-1, 2)[mask] == POISON).all())
    frac = near / total if total else 1.0
    return Comparison(frac, max_ulp, untouched, total)


# -- the host path on CPU tensors --------------------------------------------------------------


@dataclasses.dataclass
class Launch:
    """One call of a compiled function, as :func:`cpu_launches` records it."""

    family: str
    key: Any
    args: tuple


@contextlib.contextmanager
def cpu_launches(arch: str = "sm_90a", sms: int = 132,
                 resident: dict[tuple[int, int, int], int] | None = None,
                 record: bool = True) -> Iterator[list[Launch]]:
    """Run the ops' host path on CPU tensors as if they were tensors of CUDA device 0: no
    compile, and every compiled function records its call (a :class:`Launch`) instead of
    launching. The arch is ``arch``, the device has ``sms`` SMs, the driver answers
    ``resident[(cluster, ctas_per_sm, threads)]`` clusters (default: one per ``ctas_per_sm``
    slots of ``sms``), the current stream is a constant and no stream is capturing. Yields the
    list of launches (empty with ``record=False``: the compiled functions do nothing). For tests
    of the host path and ``perf/host_cpu.py``; every op forgets its layouts on entry and exit."""
    from . import compile_cache, ops
    from .arch import ARCH_ENV
    from .stacked_kv_proj import interface

    launches: list[Launch] = []
    stream = SimpleNamespace(cuda_stream=7)
    table = resident or {}

    def query(index: int, cluster: int, ctas_per_sm: int, threads: int, sms: int) -> int:
        return table.get((cluster, ctas_per_sm, threads), ctas_per_sm * sms // cluster)

    def recorder(family: Any):
        def compiled_for(key: Any):
            alignments = _compiled_alignments(family, key)

            def launch(*args: Any) -> None:
                _refuse_misaligned(alignments, args)
                launches.append(Launch(family.family, key, args))

            def nothing(*args: Any) -> None:
                return None

            return launch if record else nothing
        return compiled_for

    def forget() -> None:
        for op in ops_with_layouts():
            op.forget_layouts()

    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.dict("os.environ", {ARCH_ENV: arch}))
        stack.enter_context(mock.patch.object(ops, "LAUNCH_DEVICE_TYPE", "cpu"))
        stack.enter_context(mock.patch("torch.cuda.current_device", lambda: 0))
        stack.enter_context(mock.patch("torch.cuda.current_stream", lambda *a: stream))
        stack.enter_context(mock.patch("torch.cuda.is_current_stream_capturing", lambda: False))
        stack.enter_context(mock.patch.object(interface, "_raw_stream",
                                              lambda index: stream.cuda_stream))
        stack.enter_context(mock.patch.object(interface, "_workspaces", {}))
        stack.enter_context(mock.patch.object(interface, "_retired", []))
        stack.enter_context(mock.patch("cute_kernels.arch._sm_counts", {0: sms}))
        stack.enter_context(mock.patch("cute_kernels.arch._cluster_cache", {}))
        stack.enter_context(mock.patch("cute_kernels.arch._query_max_active_clusters", query))
        for family in compile_cache.families().values():
            stack.enter_context(mock.patch.object(family, "_compiled", {}))
            stack.enter_context(mock.patch.object(family, "_load_or_compile",
                                                  recorder(family)))
        stack.callback(forget)
        forget()
        yield launches


def _compiled_alignments(family: Any, key: Any) -> tuple:
    """The byte alignment the compiled function of ``key`` assumes of each argument (None for
    a non-tensor; a tuple for a tuple of tensors), read from the fake arguments of its build
    (nothing is compiled)."""
    from . import dsl_utils

    def alignment(fake: Any) -> Any:
        if isinstance(fake, tuple):
            return tuple(map(alignment, fake))
        return getattr(fake, "_assumed_align", None)

    with mock.patch.object(dsl_utils, "compile_tvm_ffi", lambda launcher, *fakes, arch: fakes):
        return tuple(map(alignment, family._build(key)))


def _refuse_misaligned(alignments: tuple, args: tuple) -> None:
    """What the compiled function does before it launches: refuse a tensor whose address is
    not aligned as its compile assumed (TVM-FFI raises ValueError, naming no argument)."""
    # the stream, the build's last argument, is not passed
    for align, arg in zip(alignments, args, strict=False):
        if isinstance(align, tuple):
            _refuse_misaligned(align, tuple(arg))
        elif align is not None and isinstance(arg, torch.Tensor) and arg.data_ptr() % align:
            raise ValueError(f"Misaligned Tensor data, expected data alignment={align} bytes")


def ops_with_layouts() -> list:
    """The public ops (each remembers the layouts it accepted)."""
    import cute_kernels

    return [cute_kernels.kv_rope_insert, cute_kernels.compress_c128,
            cute_kernels.stacked_kv_proj]
