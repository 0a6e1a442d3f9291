"""Inputs for the KV-insert tests and benchmark, in the layout vLLM's own regression test uses:
padded ``as_strided`` pages, 0xA5 poison, random scattered slots with every fifth one -1, and
``kv`` rows beyond the slots (DP padding)."""

from __future__ import annotations

import dataclasses

import torch

FORMATS = {  # name -> (cache dtype, kv_mxfp8, record width)
    "v4_packed": (torch.uint8, False, 584),
    "v41_mxfp8": (torch.uint8, True, 528),
    "bf16": (torch.bfloat16, False, 512),
    "fp8": (torch.float8_e4m3fn, False, 512),
}
POISON = 0xA5


@dataclasses.dataclass
class KvInsertCase:
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


def page_stride(block_size: int, width: int) -> int:
    """vLLM's test padding: whole 576-element units plus one more (always some page padding)."""
    return -(-block_size * width // 576) * 576 + 576


def make_case(fmt: str, num_slots: int, block_size: int, device: str | torch.device,
              extra_rows: int = 3, seed: int = 42, kv_rows: int | None = None,
              max_pos: int | None = None, positions_base: int = 7,
              skip_every: int = 5, slot_pattern: str = "random") -> KvInsertCase:
    """``slot_pattern``: "random" scatters every slot (the regression-test layout); "paged" is
    what a paged allocator gives a prefill: pages in random order, slots consecutive inside."""
    dtype, mxfp8, width = FORMATS[fmt]
    gen = torch.Generator(device="cpu").manual_seed(seed)
    rows = kv_rows if kv_rows is not None else num_slots + extra_rows
    num_blocks = max(1, -(-(num_slots + 7) // block_size))
    stride = page_stride(block_size, width)
    backing = torch.empty(num_blocks * stride, dtype=dtype, device=device)
    backing.view(torch.uint8).fill_(POISON)
    k_cache = backing.as_strided((num_blocks, block_size, width), (stride, width, 1))
    kv = torch.randn(rows, 512, generator=gen).to(torch.bfloat16).to(device)
    positions = (torch.arange(rows) + positions_base).to(device)
    angles = torch.randn(max_pos or rows + positions_base + 16, 32, generator=gen)
    cos_sin = torch.cat([angles.cos(), angles.sin()], dim=1).to(device)
    if slot_pattern == "random":
        slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_slots]
    else:
        pages = torch.randperm(num_blocks, generator=gen)
        t = torch.arange(num_slots)
        slots = pages[t // block_size] * block_size + t % block_size
    if skip_every:
        slots[::skip_every] = -1
    scale = torch.tensor([0.7], device=device) if fmt == "fp8" else None
    return KvInsertCase(kv, k_cache, backing, slots.to(device), positions, cos_sin, block_size,
                        scale, mxfp8)
