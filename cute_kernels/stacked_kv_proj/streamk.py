"""The stream-K part of the wgmma core's schedule, as seen by one CTA (device-side arithmetic).

The stream-K tiles are the last ``tiles`` tiles of the raster. Their ``tiles x k_tiles``
iterations (one k-tile of one tile each) are cut into ``grid`` equal contiguous ranges:
CTA ``c`` runs iterations ``[start(c), start(c + 1))`` with ``start(c) = c * iters // grid``.
A tile's *contributors* are the CTAs whose ranges meet it, in k order; a tile met by one CTA
only is finished by it like a data-parallel tile. A CTA keeps two workspace slots, for the
first and the last tile it meets (any tile between them it covers whole); the last
contributor of a tile to arrive reads them all.

Every value is a runtime ``Int32`` (the host picks the grid and the split per call), computed
with selects only, so the object can be built and queried anywhere in the kernel.
"""

from __future__ import annotations

import cutlass
from cutlass import Int32


class StreamK:
    """Stream-K ranges and segments of CTA ``cta`` among ``grid``.

    Everything a CTA asks more than once is computed once here, in 32-bit arithmetic (the
    host keeps ``iters * grid`` below 2^31: stream-K covers at most two waves of tiles): a
    chain of 64-bit divisions per work unit measured as microseconds of latency. The values
    are carried through dynamic control flow as the DSL's ``DynamicExpression`` protocol
    asks."""

    FIELDS = ("iters", "k_tiles", "cta", "grid", "begin", "end", "first_seg", "num_segments")

    def __init__(self, iters: Int32, k_tiles: Int32, cta: Int32, grid: Int32,
                 *derived: Int32) -> None:
        self.iters = iters  # stream-K tiles x k_tiles
        self.k_tiles = k_tiles
        self.cta = cta
        self.grid = grid
        if derived:
            for name, value in zip(self.FIELDS[4:], derived, strict=True):
                setattr(self, name, value)
            return
        self.begin = self.start(cta)
        self.end = self.start(cta + 1)
        has_work = self.end > self.begin
        #: Tiles this CTA's range meets (whole or in part), in order from this one.
        self.first_seg = self.begin // k_tiles
        last_seg = (self.end - 1) // k_tiles
        self.num_segments = cutlass.select_(has_work, last_seg - self.first_seg + 1, Int32(0))

    def __extract_mlir_values__(self) -> list:
        return [Int32(getattr(self, name)).ir_value() for name in self.FIELDS]

    def __new_from_mlir_values__(self, values: list) -> StreamK:
        return StreamK(*(Int32(v) for v in values))

    def start(self, cta: Int32) -> Int32:
        """First iteration of CTA ``cta``'s range."""
        return cta * self.iters // self.grid

    def k_range(self, seg: Int32) -> tuple[Int32, Int32]:
        """The k-tiles ``[lo, hi)`` of tile ``seg`` that this CTA's range covers."""
        tile_begin = seg * self.k_tiles
        lo = cutlass.max(self.begin, tile_begin) - tile_begin
        hi = cutlass.min(self.end, tile_begin + self.k_tiles) - tile_begin
        return lo, hi

    def cta_of(self, it: Int32) -> Int32:
        """The CTA whose range holds iteration ``it``."""
        return ((it + 1) * self.grid - 1) // self.iters

    def contributors(self, seg: Int32) -> tuple[Int32, Int32]:
        """(first CTA, number of CTAs) whose ranges meet tile ``seg``, in k order."""
        first = self.cta_of(seg * self.k_tiles)
        last = self.cta_of((seg + 1) * self.k_tiles - 1)
        return first, last - first + 1

    def slot(self, cta: Int32, seg: Int32) -> Int32:
        """Workspace slot of CTA ``cta``'s partial of tile ``seg``: its first or last tile."""
        first_of_cta = self.start(cta) // self.k_tiles
        return 2 * cta + cutlass.select_(seg == first_of_cta, Int32(0), Int32(1))

    def own_slot(self, seg: Int32) -> Int32:
        """This CTA's slot for tile ``seg``."""
        return 2 * self.cta + cutlass.select_(seg == self.first_seg, Int32(0), Int32(1))
