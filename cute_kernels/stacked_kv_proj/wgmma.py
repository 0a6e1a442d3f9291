"""sm_90a stacked KV projection core: a persistent, warp-specialised TMA + warpgroup ``wgmma``
GEMM whose epilogue works on the accumulator registers."""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import BFloat16, Float32, Int32, Int64, Uint32, const_expr

from .. import dsl_utils as du
from .base import StackedKvProjBase, neox_rotate, r2
from .plan import TileConfig

WGMMA_SMEM_BUDGET = 224 * 1024  # the TMA ring adds only its mbarriers
# setmaxnreg split of the core's 64 K registers: the TMA warpgroup needs a handful, the MMA
# warpgroups hold up to 128 fp32 accumulators each (m64n256) plus the epilogue's operands.
PRODUCER_REGS = 40
CONSUMER_REGS = 232


class StackedKvProjWgmma(StackedKvProjBase):
    """sm_90a core: persistent and warp-specialised.

    Warpgroup 0 is the producer: one thread issues the TMA loads of A and B k-tiles into an
    mbarrier-guarded SMEM ring (``PipelineTmaAsync``), running ahead across tile boundaries, so
    the next tile's first stages land while the consumers run the epilogue. Warpgroups 1.. are
    consumers, one per 64 rows of the tile: ``wgmma`` m64nBNk16 from SMEM, one commit group in
    flight. ``setmaxnreg`` moves registers from the producer to the consumers. Rows of
    ``ctx_hidden`` beyond T are zero-filled by TMA. The CTAs stride over the tiles in the
    grouped raster order.

    The epilogue works on the accumulator registers, with no SMEM round trip. In the wgmma
    fragment, thread ``(warp w, lane l)`` of a consumer warpgroup holds rows ``16w + l/4`` and
    ``+8`` at columns ``8j + 2(l%4) + {0, 1}`` for every ``j``: a row of a head is spread over
    the 4 lanes of a quad, and the NeoX partner ``d + D/2`` of a column is in the same thread
    (D/2 is a multiple of 8). So the sum of squares is an in-thread sum plus two quad shuffles,
    RoPE is register-local, and each thread stores 4-byte pairs (a quad writes 16 contiguous
    bytes per ``j``; L2 merges the sectors of a cache row before they reach DRAM)."""

    def __init__(self, num_layers: int, n_kv: int, head_dim: int, has_bias: bool,
                 has_commit: bool, norm_dtype: type, tile: TileConfig) -> None:
        self.consumer_warpgroups = tile.bm // 64
        super().__init__(num_layers, n_kv, head_dim, has_bias, has_commit, norm_dtype, tile,
                         128 * (1 + self.consumer_warpgroups))
        self.stages = self.ring_stages(16, WGMMA_SMEM_BUDGET)
        assert self.bm in (64, 128) and self.bn in (64, 128, 256)

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
        max_ctas: Int32,
        stream: cuda.CUstream,
    ) -> None:
        k_major = cutlass.tensor_utils.LayoutEnum.ROW_MAJOR  # both operands are [rows, H], H inner
        tiled_mma = sm90_utils.make_trivial_tiled_mma(
            BFloat16, BFloat16, k_major.sm90_mma_major_mode(), k_major.sm90_mma_major_mode(),
            Float32, (self.consumer_warpgroups, 1, 1), tiler_mn=(64, self.bn),
        )
        tile_mnk = (self.bm, self.bn, self.bk)
        sA_layout = sm90_utils.make_smem_layout_a(k_major, tile_mnk, BFloat16, self.stages)
        sB_layout = sm90_utils.make_smem_layout_b(k_major, tile_mnk, BFloat16, self.stages)
        # DLPack may report stride 1 for a size-1 dim (T = 1); a TMA descriptor needs 16-byte
        # strides, and any stride >= H describes a single row equally well.
        row_stride = cutlass.max(mX.stride[0], Int64(mX.shape[1]))
        mX_rows = cute.make_tensor(mX.iterator, cute.make_layout(mX.shape, stride=(row_stride, 1)))
        tma_a, tma_mA = cute.nvgpu.cpasync.make_tiled_tma_atom(
            cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp(), mX_rows,
            cute.slice_(sA_layout, (None, None, 0)), (self.bm, self.bk),
        )
        tma_b, tma_mW = cute.nvgpu.cpasync.make_tiled_tma_atom(
            cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp(), mW,
            cute.slice_(sB_layout, (None, None, 0)), (self.bn, self.bk),
        )

        @cute.struct
        class SharedStorage:
            full_empty: cute.struct.MemRange[Int64, self.stages * 2]
            sA: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(sA_layout)], 1024]
            sB: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(sB_layout)], 1024]

        self.shared_storage = SharedStorage
        num_tiles = cute.ceil_div(mX.shape[0], self.bm) * self.num_n_tiles
        self.kernel(
            tma_a, tma_mA, tma_b, tma_mW, mBias, mNormW, eps, mPos, mCosSin, mLoc, mCommit,
            width, k_caches, v_caches, sA_layout, sB_layout, tiled_mma,
        ).launch(
            grid=[cutlass.min(num_tiles, max_ctas), 1, 1],
            block=[self.threads, 1, 1],
            stream=stream,
        )

    @cute.kernel
    def kernel(
        self,
        tma_a: cute.CopyAtom,
        mA: cute.Tensor,
        tma_b: cute.CopyAtom,
        mB: cute.Tensor,
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
        sA_layout: cute.ComposedLayout,
        sB_layout: cute.ComposedLayout,
        tiled_mma: cute.TiledMma,
    ) -> None:
        tidx, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        grid, _, _ = cute.arch.grid_dim()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp == 0:
            cute.nvgpu.cpasync.prefetch_descriptor(tma_a)
            cute.nvgpu.cpasync.prefetch_descriptor(tma_b)
        num_m_tiles = cute.ceil_div(mLoc.shape[0], self.bm)
        num_tiles = num_m_tiles * self.num_n_tiles
        k_tiles = mA.shape[1] // self.bk

        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        stage_bytes = cute.size_in_bytes(
            BFloat16, cute.slice_(sA_layout, (None, None, 0))
        ) + cute.size_in_bytes(BFloat16, cute.slice_(sB_layout, (None, None, 0)))
        ring = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.full_empty.data_ptr(),
            num_stages=self.stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            # one release per consumer warp
            consumer_group=pipeline.CooperativeGroup(
                pipeline.Agent.Thread, 4 * self.consumer_warpgroups
            ),
            tx_count=stage_bytes,
            cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)),
            defer_sync=True,
        )
        pipeline.pipeline_init_arrive(cluster_shape_mn=(1, 1), is_relaxed=True)

        sA = storage.sA.get_tensor(sA_layout.outer, swizzle=sA_layout.inner)
        sB = storage.sB.get_tensor(sB_layout.outer, swizzle=sB_layout.inner)
        gA = cute.local_tile(mA, (self.bm, self.bk), (None, None))  # (bm, bk, m tiles, k tiles)
        gB = cute.local_tile(mB, (self.bn, self.bk), (None, None))
        tAsA, tAgA = cute.nvgpu.cpasync.tma_partition(
            tma_a, 0, cute.make_layout(1), cute.group_modes(sA, 0, 2), cute.group_modes(gA, 0, 2)
        )
        tBsB, tBgB = cute.nvgpu.cpasync.tma_partition(
            tma_b, 0, cute.make_layout(1), cute.group_modes(sB, 0, 2), cute.group_modes(gB, 0, 2)
        )
        pipeline.pipeline_init_wait(cluster_shape_mn=(1, 1))

        warpgroup = cute.arch.make_warp_uniform(tidx // 128)
        if warpgroup == 0:
            cute.arch.setmaxregister_decrease(PRODUCER_REGS)
            if warp == 0:
                producer = pipeline.make_pipeline_state(
                    pipeline.PipelineUserType.Producer, self.stages
                )
                for tile in cutlass.range(bid, num_tiles, grid, unroll=1):
                    tile_m, tile_n = self.tile_coords(tile, num_m_tiles)
                    for k_tile in cutlass.range(k_tiles, unroll=1):
                        ring.producer_acquire(producer)
                        barrier = ring.producer_get_barrier(producer)
                        cute.copy(tma_a, tAgA[(None, tile_m, k_tile)],
                                  tAsA[(None, producer.index)], tma_bar_ptr=barrier)
                        cute.copy(tma_b, tBgB[(None, tile_n, k_tile)],
                                  tBsB[(None, producer.index)], tma_bar_ptr=barrier)
                        ring.producer_commit(producer)
                        producer.advance()
        else:
            cute.arch.setmaxregister_increase(CONSUMER_REGS)
            ctid = tidx - 128  # thread index among the consumers
            wg_mma = tiled_mma.get_slice(ctid - ctid % 128)
            tCrA = tiled_mma.make_fragment_A(wg_mma.partition_A(sA))
            tCrB = tiled_mma.make_fragment_B(wg_mma.partition_B(sB))
            acc = cute.make_rmem_tensor(tiled_mma.partition_shape_C((self.bm, self.bn)), Float32)
            # (row, column) in the tile of each accumulator register of this thread
            tCcC = tiled_mma.get_slice(ctid).partition_C(
                cute.make_identity_tensor((self.bm, self.bn))
            )
            k_blocks = cute.size(tCrA, mode=[2])
            read = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
            release = pipeline.make_pipeline_state(
                pipeline.PipelineUserType.Consumer, self.stages
            )
            for tile in cutlass.range(bid, num_tiles, grid, unroll=1):
                tile_m, tile_n = self.tile_coords(tile, num_m_tiles)
                # The epilogue's row metadata (slot, then position: two dependent global
                # loads) is fetched now and lands while the main loop runs.
                rows = [self.row_destination(mLoc, mCommit, width,
                                             tile_m * self.bm + tCcC[2 * r][0])
                        for r in range(2)]
                positions = [cutlass.select_(valid, mPos[t], Int64(0)) for t, _, valid in rows]
                # Zeroed accumulators and a static ACCUMULATE flag: nothing loop-carried in
                # the MMA.
                acc.fill(0.0)
                tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
                self.mma_stage(ring, read, tiled_mma, acc, tCrA, tCrB, k_blocks)  # k-tile 0
                read.advance()
                for _k_tile in cutlass.range(1, k_tiles, unroll=1):
                    self.mma_stage(ring, read, tiled_mma, acc, tCrA, tCrB, k_blocks)
                    # Keep one wgmma group in flight; the one before it has retired, so its
                    # stage goes back to the producer.
                    cute.nvgpu.warpgroup.wait_group(1)
                    ring.consumer_release(release)
                    read.advance()
                    release.advance()
                cute.nvgpu.warpgroup.wait_group(0)
                ring.consumer_release(release)
                release.advance()
                self.epilogue(acc, tCcC, mBias, mNormW, eps, mCosSin, k_caches, v_caches,
                              tile_n, [(slot, valid) for _, slot, valid in rows], positions)

    @cute.jit
    def mma_stage(self, ring, state, tiled_mma, acc, tCrA, tCrB, k_blocks: int) -> None:
        """Wait for k-tile ``state`` to land, then issue its wgmmas as one commit group."""
        ring.consumer_wait(state)
        cute.nvgpu.warpgroup.fence()  # orders the accumulator register writes before wgmma
        for kb in cutlass.range_constexpr(k_blocks):
            coord = (None, None, kb, state.index)
            cute.gemm(tiled_mma, acc, tCrA[coord], tCrB[coord], acc)
        cute.nvgpu.warpgroup.commit_group()

    @cute.jit
    def epilogue(
        self,
        acc: cute.Tensor,
        tCcC: cute.Tensor,
        mBias: cute.Tensor | None,
        mNormW: cute.Tensor,
        eps: Float32,
        mCosSin: cute.Tensor,
        k_caches: tuple,
        v_caches: tuple,
        tile_n: Int32,
        rows: list,
        positions: list,
    ) -> None:
        """This thread's two rows of the tile -> cache rows, from the accumulator registers.
        Register ``4j + 2r + e`` holds row ``r`` (0: the first, 1: +8), column ``8j + e``
        beyond the thread's first column; its NeoX partner is ``D / 16`` groups of 8 on.
        ``rows``: (slot, written?) per row; ``positions``: the RoPE position per row. Both
        rows are finished before either is stored, so no load waits behind a store."""
        half = self.head_dim // 2
        groups = self.bn // 8  # column groups of 8 per row
        head_groups = self.head_dim // 8
        partner = 4 * (head_groups // 2)  # register distance from d to d + D/2
        quad_col = tCcC[0][1]  # this thread's first column: 2 * (lane % 4)
        layer, is_k, base, row_bytes = self.tile_destination(tile_n, k_caches, v_caches,
                                                             quad_col)
        rPair = cute.make_rmem_tensor((2,), self.norm_dtype)
        rW = cute.make_rmem_tensor((4,), Float32)  # norm weights at d, d + 1, d + D/2, +1
        rCos = cute.make_rmem_tensor((2,), Float32)
        rSin = cute.make_rmem_tensor((2,), Float32)
        rWord = cute.make_rmem_tensor((1,), Uint32)
        if const_expr(self.has_bias):
            rB = cute.make_rmem_tensor((2,), BFloat16)
            for j in cutlass.range_constexpr(groups):  # both rows share the column's bias
                col = tile_n * self.bn + quad_col + 8 * j
                cute.autovec_copy(cute.local_tile(mBias, (2,), (col // 2,)), rB)
                for r in cutlass.range_constexpr(2):
                    for e in cutlass.range_constexpr(2):
                        acc[4 * j + 2 * r + e] = du.add_rn(acc[4 * j + 2 * r + e],
                                                         rB[e].to(Float32))

        if is_k:
            # R1 for K heads; a V value's R1 is the bf16 rounding of its store.
            for i in cutlass.range_constexpr(self.bn // 2):
                acc[i] = du.round_to_bf16(acc[i])

            # Every lane of the warp is here (is_k is CTA-uniform): safe to shuffle.
            inv_d = Float32(1.0 / self.head_dim)  # exact: D is a power of two
            gCS = [mCosSin[positions[r], None] for r in range(2)]
            for head in cutlass.range_constexpr(self.heads_per_tile):
                first = 4 * head * head_groups  # register of row 0's first head column
                rstd = []
                for r in cutlass.range_constexpr(2):
                    ss = Float32(0.0)
                    for g in cutlass.range_constexpr(head_groups):
                        for e in cutlass.range_constexpr(2):
                            y = acc[first + 4 * g + 2 * r + e]
                            ss = ss + y * y
                    ss = ss + cute.arch.shuffle_sync_bfly(ss, offset=1)  # the quad holds
                    ss = ss + cute.arch.shuffle_sync_bfly(ss, offset=2)  # the whole row
                    rstd.append(du.rsqrt_approx(ss * inv_d + eps))
                for g in cutlass.range_constexpr(head_groups // 2):
                    d = quad_col + 8 * g  # head column of the first half
                    for h in cutlass.range_constexpr(2):
                        cute.autovec_copy(cute.local_tile(
                            mNormW[layer, None], (2,), ((d + h * half) // 2,)), rPair)
                        for e in cutlass.range_constexpr(2):
                            rW[2 * h + e] = rPair[e].to(Float32)
                    for r in cutlass.range_constexpr(2):
                        cute.autovec_copy(cute.local_tile(gCS[r], (2,), (d // 2,)), rCos)
                        cute.autovec_copy(cute.local_tile(gCS[r], (2,), ((half + d) // 2,)),
                                          rSin)
                        for e in cutlass.range_constexpr(2):
                            i1 = first + 4 * g + 2 * r + e
                            i2 = i1 + partner
                            acc[i1], acc[i2] = neox_rotate(
                                r2(acc[i1], rstd[r], rW[e]), r2(acc[i2], rstd[r], rW[2 + e]),
                                rCos[e], rSin[e],
                            )

        for r in cutlass.range_constexpr(2):
            slot, valid = rows[r]
            if valid:
                row_addr = base + Int64(slot) * row_bytes
                for j in cutlass.range_constexpr(groups):
                    rWord[0] = du.pack_bf16x2(acc[4 * j + 2 * r], acc[4 * j + 2 * r + 1])  # R3
                    du.store_words(row_addr + 16 * j, rWord, align=4)
