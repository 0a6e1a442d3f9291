"""sm_90a swapped wgmma core, persistent, with the epilogue on a warpgroup of its own: while
the consumers run one tile's MMAs, the epilogue warpgroup finishes the tile before it from a
staged copy, and the producer's ring never drains between tiles. So the fixed cost of a tile
(the ring's first stages, the norm/RoPE/scatter) is paid once per CTA, not once per tile."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import BFloat16, Float32, Int64, const_expr

from .. import dsl_utils as du
from .plan import SWAPPED_C_ROW_PAD
from .wgmma import PRODUCER_REGS, WGMMA_SMEM_BUDGET
from .wgmma_swap import MAX_STAGES, StackedKvProjWgmmaSwap

# setmaxnreg of the epilogue warpgroup beside two consumer warpgroups (512 threads launch with
# at most 128 registers; beside one, 384 threads, it keeps what the kernel launched with, up to
# 168, as a decrease below an unknown launch count would be undefined): a pass of the epilogue
# keeps at most EPILOGUE_ROWS_PER_PASS rows' cos/sin (16 fp32 each) in registers (sw128p
# compiles without spills at 128 or 160; 160, as measured, leaves room for the 24 bytes a
# 256-column tile spilled at 128). The consumers get the rest of the 64 K, at most 232.
EPILOGUE_REGS = 160
EPILOGUE_ROWS_PER_PASS = 4
MAX_CONSUMER_REGS = 232


class StackedKvProjWgmmaSwapPersistent(StackedKvProjWgmmaSwap):
    """Persistent swapped core: CTA ``b`` of a grid of ``G`` takes tiles ``b, b + G, ...`` of
    the grouped raster.

    Warpgroup 0 is the producer: one thread loads every k-tile of the CTA's tiles, one after
    another, into the mbarrier ring, so the next tile's first stages land while the last ones
    of the tile before are multiplied. Warpgroups ``1..C`` are the consumers (as in the
    one-tile core); after a tile's last wgmma they release its stages, wait until the
    epilogue has emptied the staged tile, stage their fp32 accumulators transposed into the
    ``[token, column]`` tile of its own SMEM (not the ring, which holds the next tile's
    stages), mark it full and go on with the next tile. Warpgroup ``C + 1`` is the epilogue:
    for each tile it requests the row metadata, bias and norm weights, waits for the staged
    tile, finishes its rows in passes of at most ``EPILOGUE_ROWS_PER_PASS`` rows a thread (the
    mapping of ``128 x passes`` threads, one pass at a time, so that the cos/sin rows of a
    pass fit in its registers), and marks the staged tile empty. The hand-over is a one-stage
    mbarrier pipeline (``PipelineAsync``: the full barrier's arrivals release the staging
    writes to the epilogue's wait, the empty barrier's the epilogue's reads to the next
    staging)."""

    EPILOGUE_WARPGROUPS = 1

    def init_ring_and_epilogue(self) -> None:
        """The ring beside the staged tile, the consumers' registers, and the epilogue
        warpgroup's mapping: ``128 x passes`` threads, each pass at most
        ``EPILOGUE_ROWS_PER_PASS`` rows a thread."""
        self.epilogue_warpgroup = 1 + self.consumer_warpgroups
        c_stride = self.bn + SWAPPED_C_ROW_PAD
        self.staged_floats = self.bm * c_stride
        self.stages = self.ring_stages(MAX_STAGES, WGMMA_SMEM_BUDGET - 4 * self.staged_floats)
        assert self.stages >= 2, "a ring beside the staged tile"
        regs = (512 - PRODUCER_REGS - EPILOGUE_REGS) // self.consumer_warpgroups
        self.consumer_regs = min(MAX_CONSUMER_REGS, regs - regs % 8)
        rows_of_128 = -(-self.bm // self.epilogue_row_step(128))
        self.epilogue_passes = -(-rows_of_128 // EPILOGUE_ROWS_PER_PASS)
        self.init_staged_epilogue(128 * self.epilogue_passes, c_stride, None)

    def shared_storage_type(self, sW_layout: cute.ComposedLayout,
                            sX_layout: cute.ComposedLayout) -> type:
        """The ring's mbarriers and stages, the staged tile's two mbarriers, and the staged fp32
        tile apart from the ring."""
        return du.smem_struct(
            "SharedStorage",
            full_empty=cute.struct.MemRange[Int64, self.stages * 2],
            staged_full_empty=cute.struct.MemRange[Int64, 2],
            sW=cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(sW_layout)], 1024],
            sX=cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(sX_layout)], 1024],
            sC=cute.struct.Align[cute.struct.MemRange[Float32, self.staged_floats], 16],
        )

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
        width: cutlass.Int32,
        k_caches: tuple,
        v_caches: tuple,
        splits: cutlass.Int32,
        sW_layout: cute.ComposedLayout,
        sX_layout: cute.ComposedLayout,
        tiled_mma: cute.TiledMma,
    ) -> None:
        tidx, bid, grid, warp = self.kernel_start(tma_w, tma_x)
        num_tokens = mLoc.shape[0]
        num_m_tiles = cute.ceil_div(num_tokens, self.bm)
        num_tiles = num_m_tiles * self.num_n_tiles
        k_tiles = mX.shape[1] // self.bk

        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        ring = self.make_ring(storage.full_empty.data_ptr(), sW_layout, sX_layout)
        # the staged tile's hand-over: the consumers fill it, the epilogue empties it
        staged = pipeline.PipelineAsync.create(
            barrier_storage=storage.staged_full_empty.data_ptr(), num_stages=1,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread,
                                                     128 * self.consumer_warpgroups),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 128),
            defer_sync=True,
        )
        pipeline.pipeline_init_arrive(cluster_shape_mn=(1, 1), is_relaxed=True)

        sW, sX, tWsW, tWgW, tXsX, tXgX = self.operand_tiles(storage, tma_w, mW, tma_x, mX,
                                                             sW_layout, sX_layout)
        sC = self.staged_tile(storage.sC.data_ptr())
        pipeline.pipeline_init_wait(cluster_shape_mn=(1, 1))

        warpgroup = cute.arch.make_warp_uniform(tidx // 128)
        if warpgroup == 0:
            cute.arch.setmaxregister_decrease(PRODUCER_REGS)
            if warp == 0:
                producer, evict_first, stream = self.producer_start(mX.shape[1])
                for tile in cutlass.range(bid, num_tiles, grid, unroll=1):
                    tile_m, tile_n = self.tile_coords(tile, num_m_tiles)
                    operands = ((tma_w, tWgW, tWsW, tile_n, evict_first),
                                (tma_x, tXgX, tXsX, tile_m, None))
                    for k_tile in cutlass.range(k_tiles, unroll=1):
                        self.load_stage(ring, producer, operands, k_tile, stream)
                        producer.advance()
        elif warpgroup == self.epilogue_warpgroup:
            if const_expr(self.consumer_warpgroups == 2):
                cute.arch.setmaxregister_increase(EPILOGUE_REGS)
            etid = tidx - 128 * self.epilogue_warpgroup
            unstage = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
            for tile in cutlass.range(bid, num_tiles, grid, unroll=1):
                tile_m, tile_n = self.tile_coords(tile, num_m_tiles)
                _, first_column = self.tile_layer(tile_n)
                # a loop, not unrolled: ptxas would hoist every pass's loads to the top
                for p in cutlass.range(self.epilogue_passes, unroll=1):
                    vtid = etid + 128 * p  # this pass's thread of the epilogue's mapping
                    rSlot, rPos, rCommitted, rCos, rSin, rBias, rNorm = self.epilogue_inputs(
                        mBias, mNormW, mPos, mLoc, mCommit, width, tile_m, tile_n, vtid)
                    if p == 0:  # the first pass's inputs land while it waits
                        staged.consumer_wait(unstage)
                    self.rope_inputs(mCosSin, tile_m, first_column < self.kv, num_tokens, vtid,
                                     rSlot, rPos, rCommitted, rCos, rSin)
                    self.epilogue(sC, eps, num_tokens, k_caches, v_caches, tile_m, tile_n,
                                  vtid, rSlot, rCommitted, rCos, rSin, rBias, rNorm,
                                  cutlass.Int32(0), cutlass.Int32(self.bm))
                staged.consumer_release(unstage)
                unstage.advance()
        else:
            cute.arch.setmaxregister_increase(self.consumer_regs)
            ctid = tidx - 128  # thread index among the consumers
            tCrW, tCrX, acc, k_blocks = self.consumer_fragments(tiled_mma, ctid, sW, sX)
            read, release = self.consumer_states()
            stage = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
            tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
            for _tile in cutlass.range(bid, num_tiles, grid, unroll=1):
                read, release = self.multiply(ring, read, release, tiled_mma, acc, tCrW, tCrX,
                                              k_blocks, k_tiles)
                ring.consumer_release(release)  # the ring runs on into the next tile
                release.advance()
                staged.producer_acquire(stage)
                self.stage_fragment(tiled_mma, ctid, acc, sC, True)
                staged.producer_commit(stage)
                stage.advance()
