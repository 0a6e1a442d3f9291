"""Pure-PyTorch references: the executable specs of the kernels.

Each function has its kernel's signature, runs on CPU and GPU tensors, mutates the cache the
same way, and states every rounding point explicitly (see specs/). Vectorised: no per-token
Python loop. The references compute from the layout facts alone (:mod:`cute_kernels.layouts`,
no DSL); they assume arguments the layout check accepts (``cute_kernels.check_<name>``).
"""

from __future__ import annotations

import torch

from .layouts import (
    C128_RATIO,
    C128_STATE_BLOCK,
    FP8_MAX,
    HEAD_DIM,
    NOPE_DIM,
    ROPE_DIM,
    UE8M0_MIN_AMAX,
    CacheFormat,
    cache_format,
)

# -- exact fp32 arithmetic helpers ----------------------------------------------------------------


def fma_f32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """fp32 ``fma(a, b, c)`` (one rounding), exactly, for finite inputs.

    ``a * b`` is exact in float64 (24 + 24 bits). The sum with ``c`` is computed in float64 with
    its exact error (TwoSum) and rounded to odd, and a round-to-odd float64 rounds to the same
    fp32 as the exact value (53 >= 24 + 2), so no double-rounding case remains.
    """
    prod = a.double() * b.double()
    c64 = c.double()
    s = prod + c64
    bp = s - prod
    err = (prod - (s - bp)) + (c64 - bp)
    odd = (s.view(torch.int64) & 1) == 1
    toward = torch.full_like(s, float("inf")).copysign(err)
    s = torch.where((err != 0) & ~odd, torch.nextafter(s, toward), s)
    return s.float()


def rotate_gptj(
    x_even: torch.Tensor, x_odd: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """GPT-J RoPE pair, rounded as the kernels do:
    ``fma(e, c, -rn(o*s))`` and ``fma(e, s, rn(o*c))``."""
    return fma_f32(x_even, cos, -(x_odd * sin)), fma_f32(x_even, sin, x_odd * cos)


def ue8m0_exponent(amax: torch.Tensor) -> torch.Tensor:
    """``ceil(log2(max(amax, 1e-4) / 448))`` of fp32 ``amax``, exactly (int32)."""
    q = amax.float().clamp_min(UE8M0_MIN_AMAX) / FP8_MAX
    bits = q.view(torch.int32)
    exponent = ((bits >> 23) & 0xFF) - 127
    return (exponent + ((bits & 0x7FFFFF) != 0).to(torch.int32)).to(torch.int32)


def ue8m0_quantize(values: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """UE8M0 block quantisation of fp32 ``values [M, D]`` in groups of ``group`` dims.

    Returns ``(codes uint8 [M, D], scale bytes uint8 [M, D / group])`` where
    ``codes = e4m3_rne(clamp(v * 2^-e, -448, 448))`` and ``byte = clamp(e + 127, 0, 255)``.
    """
    m, d = values.shape
    grouped = values.reshape(m, d // group, group)
    exponent = ue8m0_exponent(grouped.abs().amax(dim=-1))
    inv_scale = torch.ldexp(torch.ones_like(grouped[..., 0]), -exponent.float())
    scaled = (grouped * inv_scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX)
    codes = scaled.to(torch.float8_e4m3fn).view(torch.uint8).reshape(m, d)
    return codes, (exponent + 127).clamp(0, 255).to(torch.uint8)


def in_table(positions: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Whether each position is a row of ``table`` (a cos/sin cache): rows whose position is
    not write nothing, in every kernel."""
    return (positions >= 0) & (positions < table.shape[0])


def _storage_bytes(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """A flat uint8 view of ``t``'s whole storage and ``t``'s byte offset in it."""
    flat = torch.empty(0, dtype=torch.uint8, device=t.device)
    flat.set_(t.untyped_storage())
    return flat, t.storage_offset() * t.element_size()


def _scatter_rows(flat: torch.Tensor, row_starts: torch.Tensor, rows: torch.Tensor) -> None:
    """``flat[row_starts[i] + j] = rows[i, j]`` for every row i and byte j."""
    index = row_starts.unsqueeze(1) + torch.arange(rows.shape[1], device=rows.device)
    flat[index.reshape(-1)] = rows.reshape(-1)


# -- KV insert ----------------------------------------------------------------------------------


def kv_rope_insert(
    kv: torch.Tensor,
    k_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    block_size: int,
    fp8_scale: torch.Tensor | None = None,
    kv_mxfp8: bool = False,
) -> None:
    """Reference of :func:`cute_kernels.kv_rope_insert` (specs/kv_rope_insert.md)."""
    fmt = cache_format(k_cache.dtype, bool(kv_mxfp8))
    n = slot_mapping.shape[0]
    capacity = k_cache.shape[0] * k_cache.shape[1]
    pos = positions[:n]
    written = (slot_mapping >= 0) & (slot_mapping < capacity) & in_table(pos, cos_sin_cache)
    tokens = torch.nonzero(written).flatten()
    if tokens.numel() == 0:
        return
    slots = slot_mapping[tokens]
    x = kv[:n][tokens].float()
    cos_sin = cos_sin_cache[pos[tokens]]
    half = ROPE_DIM // 2
    rot_even, rot_odd = rotate_gptj(
        x[:, NOPE_DIM::2], x[:, NOPE_DIM + 1 :: 2], cos_sin[:, :half], cos_sin[:, half:]
    )
    rope = torch.stack([rot_even, rot_odd], dim=-1).reshape(-1, ROPE_DIM)  # fp32, interleaved

    flat, base = _storage_bytes(k_cache)
    elem = k_cache.element_size()
    page = base + (slots // block_size) * k_cache.stride(0) * elem
    row = slots % block_size
    data_row = page + row * fmt.data_bytes
    scale_row = page + block_size * fmt.data_bytes + row * fmt.scale_bytes
    if fmt is CacheFormat.V4_PACKED:
        codes, scales = ue8m0_quantize(x[:, :NOPE_DIM], fmt.group)
        rope_bytes = rope.to(torch.bfloat16).view(torch.uint8)
        pad = torch.zeros_like(scales[:, :1])
        _scatter_rows(flat, data_row, torch.cat([codes, rope_bytes], dim=1))
        _scatter_rows(flat, scale_row, torch.cat([scales, pad], dim=1))
    elif fmt is CacheFormat.V41_MXFP8:
        values = torch.cat([x[:, :NOPE_DIM], rope], dim=1).to(torch.bfloat16).float()
        codes, scales = ue8m0_quantize(values, fmt.group)
        _scatter_rows(flat, data_row, codes)
        _scatter_rows(flat, scale_row, scales)
    else:
        row_start = page + row * k_cache.stride(1) * elem
        if fmt is CacheFormat.BF16:
            out = torch.cat([kv[:n][tokens][:, :NOPE_DIM], rope.to(torch.bfloat16)], dim=1)
            _scatter_rows(flat, row_start, out.view(torch.uint8))
        else:
            inv_scale = 1.0 / fp8_scale.reshape(1).float()  # IEEE fp32 division
            values = torch.cat([x[:, :NOPE_DIM], rope], dim=1)
            codes = (values * inv_scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
            _scatter_rows(flat, row_start, codes.view(torch.uint8))


# -- C128 compressor -------------------------------------------------------------------------------


def c128_compressed_tokens(
    block_table: torch.Tensor,
    token_to_req: torch.Tensor,
    positions: torch.Tensor,
    slot_mapping: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    kv_slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """Which tokens write a record (bool ``[T]``): on a 128-position boundary with both slots
    non-negative, and with every index in range — the request a row of ``block_table``, the
    window's pages inside that row, its first position a row of ``cos_sin_cache`` and the
    record slot inside ``k_cache``."""
    start = positions - (C128_RATIO - 1)
    return ((slot_mapping >= 0) & (kv_slot_mapping >= 0) & ((positions + 1) % C128_RATIO == 0)
            & (kv_slot_mapping < k_cache.shape[0] * k_cache.shape[1])
            & in_table(start, cos_sin_cache)
            & (positions < block_table.shape[1] * C128_STATE_BLOCK)
            & (token_to_req >= 0) & (token_to_req < block_table.shape[0]))


def c128_normed_windows(
    state_cache: torch.Tensor,
    block_table: torch.Tensor,
    token_to_req: torch.Tensor,
    positions: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    tokens: torch.Tensor,
) -> torch.Tensor:
    """Float64 ``RMSNorm(softmax-pool(window))`` of the given boundary tokens, ``[M, 512]``."""
    start = positions[tokens] - (C128_RATIO - 1)
    pages_per_window = C128_RATIO // C128_STATE_BLOCK
    page_index = (start // C128_STATE_BLOCK).unsqueeze(1) + torch.arange(
        pages_per_window, device=start.device
    )
    requests = token_to_req[tokens].long().unsqueeze(1)
    # page ids outside the state cache are clamped into it (the kernel's reads stay inside)
    pages = block_table[requests, page_index].long().clamp(0, state_cache.shape[0] - 1)
    rows = state_cache[pages].double().reshape(len(tokens), C128_RATIO, 2 * HEAD_DIM)
    weights = torch.softmax(rows[..., HEAD_DIM:], dim=1)  # per column, over the 128 rows
    pooled = (weights * rows[..., :HEAD_DIM]).sum(dim=1)
    rstd = torch.rsqrt(pooled.square().mean(dim=1, keepdim=True) + eps)
    return pooled * rstd * norm_weight.double()


def compress_c128(
    state_cache: torch.Tensor,
    block_table: torch.Tensor,
    token_to_req: torch.Tensor,
    positions: torch.Tensor,
    slot_mapping: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    kv_slot_mapping: torch.Tensor,
    kv_block_size: int,
    fp8_scale: torch.Tensor | None = None,
    chunk: int = 256,
) -> None:
    """Reference of :func:`cute_kernels.compress_c128` (specs/compress_c128.md), float64 inside;
    every stored value is rounded once from float64. ``chunk`` bounds the float64 working set."""
    fmt = cache_format(k_cache.dtype)
    boundary = c128_compressed_tokens(block_table, token_to_req, positions, slot_mapping,
                                      cos_sin_cache, k_cache, kv_slot_mapping)
    flat, base = _storage_bytes(k_cache)
    elem = k_cache.element_size()
    boundary_tokens = torch.nonzero(boundary).flatten()
    for tokens in boundary_tokens.split(chunk) if boundary_tokens.numel() else ():
        y = c128_normed_windows(state_cache, block_table, token_to_req, positions, norm_weight,
                                eps, tokens)
        cos_sin = cos_sin_cache[positions[tokens] - (C128_RATIO - 1)].double()
        half = ROPE_DIM // 2
        e, o = y[:, NOPE_DIM::2], y[:, NOPE_DIM + 1 :: 2]
        c, s = cos_sin[:, :half], cos_sin[:, half:]
        rope = torch.stack([e * c - o * s, e * s + o * c], dim=-1).reshape(-1, ROPE_DIM)
        slots = kv_slot_mapping[tokens]
        page = base + (slots // kv_block_size) * k_cache.stride(0) * elem
        row = slots % kv_block_size
        if fmt is CacheFormat.V4_PACKED:
            nope = y[:, :NOPE_DIM].to(torch.bfloat16).double()
            grouped = nope.reshape(len(tokens), NOPE_DIM // fmt.group, fmt.group)
            amax = grouped.abs().amax(dim=-1).clamp_min(UE8M0_MIN_AMAX)
            exponent = torch.ceil(torch.log2(amax / FP8_MAX))
            scaled = (grouped * torch.pow(2.0, -exponent).unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX)
            codes = scaled.to(torch.float8_e4m3fn).view(torch.uint8).reshape(len(tokens), -1)
            scales = (exponent + 127).clamp(0, 255).to(torch.uint8)
            record = torch.cat([codes, rope.to(torch.bfloat16).view(torch.uint8)], dim=1)
            _scatter_rows(flat, page + row * fmt.data_bytes, record)
            pad = torch.zeros_like(scales[:, :1])
            _scatter_rows(flat, page + kv_block_size * fmt.data_bytes + row * fmt.scale_bytes,
                          torch.cat([scales, pad], dim=1))
        else:
            values = torch.cat([y[:, :NOPE_DIM], rope], dim=1)
            if fmt is CacheFormat.BF16:
                out = values.to(torch.bfloat16).view(torch.uint8)
            else:
                scaled = values.to(torch.bfloat16).double() / fp8_scale.double().reshape(1)
                out = scaled.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
            _scatter_rows(flat, page + row * k_cache.stride(1) * elem, out)


# -- stacked KV projection ---------------------------------------------------------------


def stacked_kv_slots(
    cache_loc: torch.Tensor,
    cache_loc_2d: torch.Tensor | None,
    commit_lens: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows that write, their slots) in the order of the rows."""
    slots = cache_loc_2d.reshape(-1) if cache_loc_2d is not None else cache_loc
    valid = slots >= 0
    if commit_lens is not None:
        width = cache_loc_2d.shape[1]
        col = torch.arange(slots.shape[0], device=slots.device) % width
        valid &= col < commit_lens.to(torch.int64).repeat_interleave(width)
    rows = valid.nonzero().squeeze(1)
    return rows, slots[rows]


def _gemm_r1(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """bf16(x @ w^T + b) with an fp32 accumulation and one rounding (R1)."""
    if x.is_cuda:
        tf32 = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = False
        try:
            acc = x.float() @ w.float().t()
        finally:
            torch.backends.cuda.matmul.allow_tf32 = tf32
    else:
        acc = x.float() @ w.float().t()
    if b is not None:
        acc = acc + b.float()
    return acc.to(torch.bfloat16)


def k_norm_rope(
    k: torch.Tensor, w: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:
    """RMSNorm over the last dim (R2) then NeoX RoPE (R3) of bf16 ``k`` [R, n_kv, D]; ``w`` [D];
    ``cos``/``sin`` fp32 [R, 1, D/2]."""
    kf = k.float()
    var = kf.pow(2).mean(-1, keepdim=True)
    normed = (kf * torch.rsqrt(var + eps) * w.float()).to(torch.bfloat16)  # R2
    half = k.shape[-1] // 2
    x1, x2 = normed.float()[..., :half], normed.float()[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(torch.bfloat16)  # R3


def stacked_kv_proj(
    ctx_hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    k_norm_weight: torch.Tensor,
    eps: float,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    cache_loc: torch.Tensor,
    k_caches: list[torch.Tensor],
    v_caches: list[torch.Tensor],
    cache_loc_2d: torch.Tensor | None = None,
    commit_lens: torch.Tensor | None = None,
) -> None:
    """Reference of :func:`cute_kernels.stacked_kv_proj` (specs/stacked_kv_proj.md): the
    per-layer path with its three bf16 rounding points — R1 ``y = bf16(x @ W_l^T + b_l)`` (fp32
    accumulation, TF32 off, bias added in fp32), R2 the per-head RMSNorm in fp32 times the weight
    then bf16, R3 NeoX RoPE in fp32 (products rounded, no FMA) then bf16; V heads are ``y``.
    Rows with a negative slot, a position outside the cos/sin table, or a column ``t mod W >=
    commit_lens[t div W]`` write nothing, nor does a row into a cache its slot is past;
    ``cache_loc_2d`` replaces ``cache_loc`` when given. Syncs with the host (``nonzero``)."""
    num_layers = len(k_caches)
    n_kv, head_dim = k_caches[0].shape[1], k_caches[0].shape[2]
    kv = n_kv * head_dim
    rows, slots = stacked_kv_slots(cache_loc, cache_loc_2d, commit_lens)
    # a row whose position lies outside the cos/sin table writes nothing
    keep = in_table(positions[rows], cos_sin_cache)
    rows, slots = rows[keep], slots[keep]
    if rows.numel() == 0:
        return
    x = ctx_hidden[rows]  # only the rows that write: the GEMM is row-independent
    half = head_dim // 2
    table = cos_sin_cache[positions[rows]]
    cos = table[:, None, :half].float()
    sin = table[:, None, half:].float()
    for layer in range(num_layers):
        lo = layer * 2 * kv
        w_l = weight[lo:lo + 2 * kv]
        b_l = None if bias is None else bias[lo:lo + 2 * kv]
        y = _gemm_r1(x, w_l, b_l)  # R1
        k = y[:, :kv].reshape(-1, n_kv, head_dim)
        v = y[:, kv:].reshape(-1, n_kv, head_dim)
        k_out = k_norm_rope(k, k_norm_weight[layer], eps, cos, sin)
        store_rows(k_caches[layer], slots, k_out)
        store_rows(v_caches[layer], slots, v)


def store_rows(cache: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """``cache[slots] = rows`` for the slots inside ``cache``: a slot past its last row writes
    nothing."""
    fits = slots < cache.shape[0]
    cache[slots[fits]] = rows[fits]
