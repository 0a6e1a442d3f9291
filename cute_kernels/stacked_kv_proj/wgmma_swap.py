"""sm_90a stacked KV projection core with the operands swapped: the weight tile is the wgmma's
A (its M: 64 weight rows per consumer warpgroup, or two m64 atoms each for a wide tile's 256)
and the token tile its B (its N: any multiple of 8 up to 256), so the token tile is sized to
fill the SMs, not by the wgmma's M. The accumulators hold head dims along rows, so the
epilogue runs from SMEM (:class:`~.staged.StagedEpilogue`). At decode sizes a tile's K can be
split over the CTAs of a cluster, whose partials are summed through distributed shared
memory."""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import BFloat16, Float32, Int32, Int64, const_expr

from .. import dsl_utils as du
from .base import StackedKvProjBase
from .plan import SWAPPED_C_ROW_PAD, TileConfig
from .staged import StagedEpilogue
from .wgmma import (
    CONSUMER_BARRIER,
    CONSUMER_REGS,
    PRODUCER_REGS,
    WGMMA_SMEM_BUDGET,
    WgmmaPipeline,
)

MAX_STAGES = 16  # ring depth cap (the small-N tiles: sw32 fits 11 stages in the budget)


class StackedKvProjWgmmaSwap(StagedEpilogue, WgmmaPipeline, StackedKvProjBase):
    """sm_90a core for few weight tiles: ``weight_tile @ token_tile^T`` on wgmma, one tile per
    CTA (the plan sizes the token tile so that the tiles fill the SMs in whole waves), or,
    split (``cluster=True``), one K range of a tile per CTA.

    Warpgroup 0 is the producer: one thread issues the TMA loads of the weight's and the
    tokens' k-tiles into an mbarrier ring (``PipelineTmaAsync``). Warpgroups 1.. are consumers,
    one per 64 weight rows of the tile (two for a wide tile's 256, each with two m64 atoms:
    warpgroup ``w`` rows ``[64 w, 64 w + 64)`` and the same ``+ 128``): ``wgmma`` m64nBMk16
    from SMEM, one commit group in flight. After the last k-tile the consumers stage the fp32
    accumulators transposed, as the ``[token, column]`` tile of the staged epilogue, in the
    drained ring (the producer issues nothing after the last k-tile), and finish the rows
    from there. Tokens beyond T are zero-filled by TMA and never stored.

    Split K (``cluster=True``, a runtime split ``S <= CLUSTER_MAX_SPLITS``): the ``S`` CTAs of
    a tile are one cluster, CTA ``b`` runs k-tiles ``[s K / S, (s + 1) K / S)`` of tile ``b /
    S`` (``s = b mod S``, its rank), stages its fp32 partial, and after a cluster barrier sums
    the ``s``-th ``1/S`` of the valid rows of all partials through DSMEM in split order and
    finishes those rows (:meth:`~.staged.StagedEpilogue.reduce_cluster`, as the mma core's
    cluster hand-over). So the few weight tiles of a tensor-parallel rank or a one-layer
    drafter at decode sizes stream on up to ``S`` times as many SMs, each with this core's
    TMA ring, and the per-head norm still sees full sums."""

    #: warpgroups besides the producer and the consumers (the persistent core's epilogue)
    EPILOGUE_WARPGROUPS = 0

    def __init__(self, num_layers: int, n_kv: int, head_dim: int, has_bias: bool,
                 has_commit: bool, norm_dtype: type, tile: TileConfig,
                 cluster: bool = False) -> None:
        bn = tile.columns(head_dim, n_kv * head_dim)
        assert bn in (64, 128, 256), "a swapped wgmma tile holds 64, 128 or 256 weight rows"
        # one m64 atom a consumer warpgroup, two for 256 rows
        self.consumer_warpgroups = min(bn // 64, 2)
        self.cluster = cluster  # K split over a cluster's CTAs, partials summed through DSMEM
        super().__init__(num_layers, n_kv, head_dim, has_bias, has_commit, norm_dtype, tile,
                         128 * (1 + self.consumer_warpgroups + self.EPILOGUE_WARPGROUPS))
        assert self.bm % 8 == 0 and self.bm <= 256, "the wgmma's N"
        self.consumer_threads = 128 * self.consumer_warpgroups
        self.init_ring_and_epilogue()

    def init_ring_and_epilogue(self) -> None:
        """The ring's depth and the staged epilogue's mapping: the consumers finish the rows
        themselves, from the drained ring."""
        self.stages = self.ring_stages(MAX_STAGES, WGMMA_SMEM_BUDGET)
        self.init_staged_epilogue(self.consumer_threads, self.bn + SWAPPED_C_ROW_PAD,
                                  CONSUMER_BARRIER)
        assert self.bm * self.c_stride * 4 <= self.stages * (self.bm + self.bn) * self.bk * 2, (
            "the staged tile fits in the ring")

    @cute.jit
    def __call__(
        self,
        mX: cute.Tensor,
        mW: cute.Tensor,
        mBias: cute.Tensor | None,
        mNormW: cute.Tensor,
        eps: Float32,
        mPos: cute.Tensor,
        mCosSin: cute.Tensor,
        mLoc: cute.Tensor,
        mCommit: cute.Tensor | None,
        width: Int32,
        k_caches: tuple,
        v_caches: tuple,
        mWork: cute.Tensor,
        mCount: cute.Tensor,
        grid_ctas: Int32,
        splits: Int32,
        stream: cuda.CUstream,
    ) -> None:
        """``mWork`` and ``mCount`` are unused (the wgmma cores' one signature, whose last
        two are the grid and here the split): ``grid_ctas`` CTAs, ``splits`` per tile (1
        unless ``cluster``)."""
        mLoc = self.token_slots(mLoc)
        k_major = cutlass.tensor_utils.LayoutEnum.ROW_MAJOR  # both operands are [rows, H], H inner
        tiled_mma = sm90_utils.make_trivial_tiled_mma(
            BFloat16, BFloat16, k_major.sm90_mma_major_mode(), k_major.sm90_mma_major_mode(),
            Float32, (self.consumer_warpgroups, 1, 1), tiler_mn=(64, self.bm),
        )
        tile_mnk = (self.bn, self.bm, self.bk)  # the MMA's (M, N, K): weight rows, tokens
        sW_layout = sm90_utils.make_smem_layout_a(k_major, tile_mnk, BFloat16, self.stages)
        sX_layout = sm90_utils.make_smem_layout_b(k_major, tile_mnk, BFloat16, self.stages)
        tma_w, tma_mW = cute.nvgpu.cpasync.make_tiled_tma_atom(
            cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp(), mW,
            cute.slice_(sW_layout, (None, None, 0)), (self.bn, self.bk),
        )
        mX_rows = self.token_rows(mX)
        tma_x, tma_mX = cute.nvgpu.cpasync.make_tiled_tma_atom(
            cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp(), mX_rows,
            cute.slice_(sX_layout, (None, None, 0)), (self.bm, self.bk),
        )

        self.shared_storage = self.shared_storage_type(sW_layout, sX_layout)
        kernel = self.kernel(
            tma_w, tma_mW, tma_x, tma_mX, mBias, mNormW, eps, mPos, mCosSin, mLoc, mCommit,
            width, k_caches, v_caches, splits, sW_layout, sX_layout, tiled_mma,
        )
        if const_expr(self.cluster):  # a tile's splits: one cluster
            kernel.launch(grid=[grid_ctas, 1, 1], block=[self.threads, 1, 1],
                          cluster=[splits, 1, 1], stream=stream)
        else:
            kernel.launch(grid=[grid_ctas, 1, 1], block=[self.threads, 1, 1], stream=stream)

    def shared_storage_type(self, sW_layout: cute.ComposedLayout,
                            sX_layout: cute.ComposedLayout) -> type:
        """The CTA's SMEM: the ring's mbarriers and stages."""
        return du.smem_struct(
            "SharedStorage",
            full_empty=cute.struct.MemRange[Int64, self.stages * 2],
            # the staged fp32 tile reuses both (contiguous: sW is a multiple of 1 KiB)
            sW=cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(sW_layout)], 1024],
            sX=cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(sX_layout)], 1024],
        )

    def operand_tiles(self, storage, tma_w: cute.CopyAtom, mW: cute.Tensor,
                      tma_x: cute.CopyAtom, mX: cute.Tensor, sW_layout: cute.ComposedLayout,
                      sX_layout: cute.ComposedLayout) -> tuple:
        """The ring's weight and token stages in SMEM and both operands' TMA partitions:
        ``(sW, sX, tWsW, tWgW, tXsX, tXgX)``, the global ones over (n or m tile, k-tile)."""
        sW = storage.sW.get_tensor(sW_layout.outer, swizzle=sW_layout.inner)
        sX = storage.sX.get_tensor(sX_layout.outer, swizzle=sX_layout.inner)
        gW = cute.local_tile(mW, (self.bn, self.bk), (None, None))  # (bn, bk, n tiles, k tiles)
        gX = cute.local_tile(mX, (self.bm, self.bk), (None, None))  # (bm, bk, m tiles, k tiles)
        tWsW, tWgW = cute.nvgpu.cpasync.tma_partition(
            tma_w, 0, cute.make_layout(1), cute.group_modes(sW, 0, 2), cute.group_modes(gW, 0, 2)
        )
        tXsX, tXgX = cute.nvgpu.cpasync.tma_partition(
            tma_x, 0, cute.make_layout(1), cute.group_modes(sX, 0, 2), cute.group_modes(gX, 0, 2)
        )
        return sW, sX, tWsW, tWgW, tXsX, tXgX

    def consumer_fragments(self, tiled_mma: cute.TiledMma, ctid: Int32, sW: cute.Tensor,
                           sX: cute.Tensor) -> tuple:
        """Consumer thread ``ctid``'s wgmma operand descriptors over the ring, its fp32
        accumulators (weight rows x tokens) and the k-blocks of a stage:
        ``(tCrW, tCrX, acc, k_blocks)``."""
        wg_mma = tiled_mma.get_slice(ctid - ctid % 128)
        tCrW = tiled_mma.make_fragment_A(wg_mma.partition_A(sW))
        tCrX = tiled_mma.make_fragment_B(wg_mma.partition_B(sX))
        acc = cute.make_rmem_tensor(tiled_mma.partition_shape_C((self.bn, self.bm)), Float32)
        return tCrW, tCrX, acc, cute.size(tCrW, mode=[2])

    @cute.kernel
    def kernel(
        self,
        tma_w: cute.CopyAtom,
        mW: cute.Tensor,
        tma_x: cute.CopyAtom,
        mX: cute.Tensor,
        mBias: cute.Tensor | None,
        mNormW: cute.Tensor,
        eps: Float32,
        mPos: cute.Tensor,
        mCosSin: cute.Tensor,
        mLoc: cute.Tensor,
        mCommit: cute.Tensor | None,
        width: Int32,
        k_caches: tuple,
        v_caches: tuple,
        splits: Int32,
        sW_layout: cute.ComposedLayout,
        sX_layout: cute.ComposedLayout,
        tiled_mma: cute.TiledMma,
    ) -> None:
        tidx, bid, _, warp = self.kernel_start(tma_w, tma_x)
        num_tokens = mLoc.shape[0]
        tile = bid // splits
        split = bid - tile * splits  # the CTA's rank in its cluster
        tile_m, tile_n = self.tile_coords(tile, cute.ceil_div(num_tokens, self.bm))
        k_tiles = mX.shape[1] // self.bk
        k_lo = split * k_tiles // splits  # the plan never splits finer than the k-tiles
        k_hi = (split + 1) * k_tiles // splits

        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        ring = self.make_ring(storage.full_empty.data_ptr(), sW_layout, sX_layout)
        pipeline.pipeline_init_arrive(cluster_shape_mn=(1, 1), is_relaxed=True)

        sW, sX, tWsW, tWgW, tXsX, tXgX = self.operand_tiles(storage, tma_w, mW, tma_x, mX,
                                                             sW_layout, sX_layout)
        pipeline.pipeline_init_wait(cluster_shape_mn=(1, 1))

        warpgroup = cute.arch.make_warp_uniform(tidx // 128)
        if warpgroup == 0:
            cute.arch.setmaxregister_decrease(PRODUCER_REGS)
            if warp == 0:
                producer, evict_first, stream = self.producer_start(mX.shape[1])
                operands = ((tma_w, tWgW, tWsW, tile_n, evict_first),
                            (tma_x, tXgX, tXsX, tile_m, None))
                for k_tile in cutlass.range(k_lo, k_hi, unroll=1):
                    self.load_stage(ring, producer, operands, k_tile, stream)
                    producer.advance()
            if const_expr(self.cluster):  # the reduction's two cluster barriers (see there)
                cute.arch.cluster_arrive_relaxed()
                cute.arch.cluster_wait()
                cute.arch.cluster_arrive_relaxed()
        else:
            cute.arch.setmaxregister_increase(CONSUMER_REGS)
            ctid = tidx - 128  # thread index among the consumers
            # The epilogue's row metadata, bias and norm weights, requested now: they land
            # while the main loop runs.
            rSlot, rPos, rCommitted, rCos, rSin, rBias, rNorm = self.epilogue_inputs(
                mBias, mNormW, mPos, mLoc, mCommit, width, tile_m, tile_n, ctid)
            tCrW, tCrX, acc, k_blocks = self.consumer_fragments(tiled_mma, ctid, sW, sX)
            read, release = self.consumer_states()
            tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
            read, release = self.multiply(ring, read, release, tiled_mma, acc, tCrW, tCrX,
                                          k_blocks, k_hi - k_lo)
            # Every stage has landed and every wgmma has read its operands: the ring is free
            # once all consumer warpgroups are here (the fence orders the async proxy's TMA
            # writes and wgmma reads before the staging's generic writes).
            cute.arch.fence_proxy("async.shared", space="cta")
            self.sync_epilogue_threads()
            sC = self.staged_tile(sW.iterator)
            self.stage_fragment(tiled_mma, ctid, acc, sC, True)
            if const_expr(self.cluster):
                self.arrive_staged()
            _, first_column = self.tile_layer(tile_n)
            self.rope_inputs(mCosSin, tile_m, first_column < self.kv, num_tokens, ctid, rSlot,
                             rPos, rCommitted, rCos, rSin)
            self.sync_epilogue_threads()
            row_lo, row_hi = Int32(0), Int32(self.bm)  # the tile rows this CTA finishes
            if const_expr(self.cluster):
                rows_valid = cutlass.min(num_tokens - tile_m * self.bm, self.bm)
                row_lo, row_hi = self.reduce_cluster(sC, split, splits, rows_valid, ctid)
            self.epilogue(sC, eps, num_tokens, k_caches, v_caches, tile_m, tile_n, ctid, rSlot,
                          rCommitted, rCos, rSin, rBias, rNorm, row_lo, row_hi)
        if const_expr(self.cluster):
            cute.arch.cluster_wait()  # the peers' reads of this CTA's partial are done
