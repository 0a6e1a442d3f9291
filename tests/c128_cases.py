"""Inputs for the C128 compressor tests and benchmark: permuted state pages with a padded page
stride, boundary and non-boundary tokens, negative slots, a poisoned paged cache."""

from __future__ import annotations

import dataclasses

import torch

FORMATS = {"packed584": (torch.uint8, 584), "bf16": (torch.bfloat16, 512),
           "fp8": (torch.float8_e4m3fn, 512)}
POISON = 0xA5
STATE_PAGE_STRIDE = 8208  # floats: a padded page (8 x 1024 + 16)


@dataclasses.dataclass
class C128Case:
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
        return ((self.slot_mapping >= 0) & (self.kv_slot_mapping >= 0)
                & ((self.positions + 1) % 128 == 0))


def kv_page_stride(fmt: str, kv_block_size: int) -> int:
    """In cache elements: vLLM's packed page (round up to 576 bytes), else one spare row."""
    if fmt == "packed584":
        return -(-kv_block_size * 584 // 576) * 576
    return (kv_block_size + 1) * 512


def make_case(fmt: str, num_tokens: int, kv_block_size: int, device, *, seed: int = 0,
              boundary_every: int | None = 3, num_requests: int = 4, windows: int = 8,
              negative_slots: bool = True, norm_dtype=torch.bfloat16,
              page_stride: int = STATE_PAGE_STRIDE, distinct_windows: bool = False) -> C128Case:
    """``boundary_every``: every n-th token sits on a boundary (None: every token; 0: none).
    ``distinct_windows``: token t reads its own window (request t % R, window t // R), so no
    two tokens share state rows (honest bandwidth in the benchmark)."""
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
    positions = torch.where(on_boundary, window * 128 + 127, positions)
    slot_mapping = t.clone()
    dtype, width = FORMATS[fmt]
    num_kv_blocks = -(-num_tokens // kv_block_size) + 2
    kv_slots = torch.randperm(num_kv_blocks * kv_block_size, generator=gen, device=device)
    kv_slots = kv_slots[:num_tokens].clone()
    if negative_slots:
        slot_mapping[t % 7 == 3] = -1
        kv_slots[t % 11 == 5] = -1
    stride = kv_page_stride(fmt, kv_block_size)
    backing = torch.empty(num_kv_blocks * stride, dtype=dtype, device=device)
    backing.view(torch.uint8).fill_(POISON)
    k_cache = backing.as_strided((num_kv_blocks, kv_block_size, width), (stride, width, 1))
    angles = torch.rand(windows * 128 + 16, 32, generator=gen, device=device) * 6.3
    cos_sin = torch.cat([angles.cos(), angles.sin()], dim=1)
    norm_weight = (1 + 0.25 * torch.randn(512, generator=gen, device=device)).to(norm_dtype)
    scale = torch.tensor([0.05], device=device) if fmt == "fp8" else None
    return C128Case(state, block_table, token_to_req, positions, slot_mapping, norm_weight, 1e-6,
                    cos_sin, k_cache, backing, kv_slots, kv_block_size, scale)
