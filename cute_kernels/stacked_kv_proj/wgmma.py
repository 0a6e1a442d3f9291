"""sm_90a stacked KV projection core: a persistent, warp-specialised TMA + warpgroup ``wgmma``
GEMM whose epilogue works on the accumulator registers, with a data-parallel and a stream-K
(split-K) part in one schedule."""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import BFloat16, Float32, Int32, Int64, Uint32, const_expr
from cutlass._mlir.dialects import nvvm

from .. import dsl_utils as du
from .base import StackedKvProjBase, neox_rotate, r2
from .plan import TileConfig
from .streamk import StreamK

WGMMA_SMEM_BUDGET = 224 * 1024  # the TMA ring adds only its mbarriers
# setmaxnreg split of the core's 64 K registers: the TMA warpgroup needs a handful, the MMA
# warpgroups hold up to 128 fp32 accumulators each (m64n256) plus the epilogue's operands.
PRODUCER_REGS = 40
CONSUMER_REGS = 232
CONSUMER_BARRIER = 1  # named barrier of the consumer warpgroups (0 is the CTA's)

# What a consumer does with one unit of its work.
FULL = 0  # all k-tiles of a tile: MMA, epilogue
# a k-range of a stream-K tile: MMA, store the fp32 partial, arrive; the last to arrive sums
# the tile's partials and runs its epilogue
PARTIAL = 1


class WgmmaPipeline:
    """The TMA ring and its producer's and consumers' stage steps, shared by both sm_90a cores
    (``stages`` and ``consumer_warpgroups`` set by the core)."""

    @staticmethod
    def token_rows(mX: cute.Tensor) -> cute.Tensor:
        """``ctx_hidden`` as a TMA source. DLPack may report stride 1 for a size-1 dim
        (T = 1); a TMA descriptor needs 16-byte strides, and any stride >= H describes a
        single row equally well."""
        row_stride = cutlass.max(mX.stride[0], Int64(mX.shape[1]))
        return cute.make_tensor(mX.iterator, cute.make_layout(mX.shape, stride=(row_stride, 1)))

    def producer_start(self, hidden: Int32) -> tuple:
        """The producer's ring state and its loads' L2 policies: ``(state, whether the weight
        loads evict first, the evict-first cache policy)``."""
        return (pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages),
                self.weight_evict_first(hidden), du.evict_first_policy())

    def consumer_states(self) -> tuple:
        """The consumers' ``(read, release)`` states of the ring, both at its first stage."""
        return (pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages),
                pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages))

    @cute.jit
    def kernel_start(self, tma_a: cute.CopyAtom, tma_b: cute.CopyAtom) -> tuple:
        """A CTA's indices ``(thread, block, grid size, warp)``, warp 0 having prefetched both
        operands' TMA descriptors (the first loads then skip the descriptor fetch)."""
        tidx, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        grid, _, _ = cute.arch.grid_dim()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp == 0:
            cute.nvgpu.cpasync.prefetch_descriptor(tma_a)
            cute.nvgpu.cpasync.prefetch_descriptor(tma_b)
        return tidx, bid, grid, warp

    def make_ring(self, barriers: cute.Pointer, sA_layout: cute.ComposedLayout,
                  sB_layout: cute.ComposedLayout) -> pipeline.PipelineTmaAsync:
        """The mbarrier ring of A and B stages (barriers at ``barriers``): one TMA thread
        fills a stage, one release per consumer warp frees it."""
        stage_bytes = cute.size_in_bytes(
            BFloat16, cute.slice_(sA_layout, (None, None, 0))
        ) + cute.size_in_bytes(BFloat16, cute.slice_(sB_layout, (None, None, 0)))
        return pipeline.PipelineTmaAsync.create(
            barrier_storage=barriers,
            num_stages=self.stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(
                pipeline.Agent.Thread, 4 * self.consumer_warpgroups
            ),
            tx_count=stage_bytes,
            cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)),
            defer_sync=True,
        )

    @cute.jit
    def load_stage(self, ring, producer, operands: tuple, k_tile: Int32, stream: Int64) -> None:
        """Producer: TMA k-tile ``k_tile`` of both operands into the next stage. ``operands``:
        per operand ``(atom, partitioned gmem, partitioned smem, tile index, evict_first)``,
        ``evict_first`` a runtime flag for the weight (its loads then carry the L2 cache
        policy ``stream``) and None for the tokens."""
        ring.producer_acquire(producer)
        barrier = ring.producer_get_barrier(producer)
        for i in cutlass.range_constexpr(len(operands)):
            atom, tXgX, tXsX, tile, evict_first = operands[i]
            src = tXgX[(None, tile, k_tile)]
            dst = tXsX[(None, producer.index)]
            if const_expr(evict_first is None):
                cute.copy(atom, src, dst, tma_bar_ptr=barrier)
            else:
                if evict_first:
                    cute.copy(atom, src, dst, tma_bar_ptr=barrier, cache_policy=stream)
                else:
                    cute.copy(atom, src, dst, tma_bar_ptr=barrier)
        ring.producer_commit(producer)

    @cute.jit
    def multiply(self, ring, read, release, tiled_mma, acc, tCrA, tCrB, k_blocks: int,
                 k_count: Int32) -> tuple:
        """``acc`` = the sum over the next ``k_count`` stages of the ring (at least one), one
        wgmma group in flight; every stage but the last goes back to the producer as soon as
        its wgmmas retire, and all have retired on return. Returns the advanced ``(read,
        release)`` states (``release`` at the last stage, not released)."""
        acc.fill(0.0)
        self.mma_stage(ring, read, tiled_mma, acc, tCrA, tCrB, k_blocks)
        read.advance()
        for _k_tile in cutlass.range(1, k_count, unroll=1):
            self.mma_stage(ring, read, tiled_mma, acc, tCrA, tCrB, k_blocks)
            # Keep one wgmma group in flight; the one before it has retired, so its stage
            # goes back to the producer.
            cute.nvgpu.warpgroup.wait_group(1)
            ring.consumer_release(release)
            read.advance()
            release.advance()
        cute.nvgpu.warpgroup.wait_group(0)
        return read, release

    @cute.jit
    def mma_stage(self, ring, state, tiled_mma, acc, tCrA, tCrB, k_blocks: int) -> None:
        """Wait for k-tile ``state`` to land, then issue its wgmmas as one commit group."""
        ring.consumer_wait(state)
        cute.nvgpu.warpgroup.fence()  # orders the accumulator register writes before wgmma
        for kb in cutlass.range_constexpr(k_blocks):
            coord = (None, None, kb, state.index)
            cute.gemm(tiled_mma, acc, tCrA[coord], tCrB[coord], acc)
        cute.nvgpu.warpgroup.commit_group()


class StackedKvProjWgmma(WgmmaPipeline, StackedKvProjBase):
    """sm_90a core: persistent and warp-specialised.

    Warpgroup 0 is the producer: one thread issues the TMA loads of A and B k-tiles into an
    mbarrier-guarded SMEM ring (``PipelineTmaAsync``), running ahead across work units, so the
    next unit's first stages land while the consumers run the epilogue. Warpgroups 1.. are
    consumers, one per 64 rows of the tile: ``wgmma`` m64nBNk16 from SMEM, one commit group in
    flight. ``setmaxnreg`` moves registers from the producer to the consumers. Rows of
    ``ctx_hidden`` beyond T are zero-filled by TMA.

    Schedule (both parts are runtime values, so one compile serves every plan). The first
    ``dp_tiles`` tiles (a multiple of the grid) are data-parallel: CTA ``b`` takes tiles
    ``b, b + G, ...`` in the grouped raster order. The remaining tiles are stream-K: their
    ``tiles x k_tiles`` iterations are cut into ``G`` equal contiguous ranges, one per CTA, so
    every SM streams the same share of the weight whatever the tile count. A range covers the
    tail of one tile, whole tiles, and the head of another; a whole tile goes straight to the
    epilogue, a part of a tile is a *partial*: its fp32 accumulators go to a workspace slot
    (two per CTA: its first and its last tile) and the tile's counter is incremented with
    release semantics. The contributor whose increment completes the count (acquire) sums
    the tile's ``n`` partials in contributor order (k order: a fixed order whoever sums, so
    the result is bitwise the same run to run) into its accumulators, runs the epilogue on
    the whole tile, so the per-head norm sees full sums, and resets the counter for the next
    launch (CUDA-graph replays included). No CTA ever waits for another: the others go on
    with their next unit.

    The epilogue works on the accumulator registers, with no SMEM round trip. In the wgmma
    fragment, thread ``(warp w, lane l)`` of a consumer warpgroup holds rows ``16w + l/4`` and
    ``+8`` at columns ``8j + 2(l%4) + {0, 1}`` for every ``j``: a row of a head is spread over
    the 4 lanes of a quad, and the NeoX partner ``d + D/2`` of a column is in the same thread
    (D/2 is a multiple of 8). So the sum of squares is an in-thread sum plus two quad shuffles,
    RoPE is register-local, and each thread stores 4-byte pairs (a quad writes 16 contiguous
    bytes per ``j``; L2 merges the sectors of a cache row before they reach DRAM). Partials are
    stored in the fragment's own order (register pair-major, thread-minor), so a warp's stores
    and loads of a register pair are 256 contiguous bytes."""

    def __init__(self, num_layers: int, n_kv: int, head_dim: int, has_bias: bool,
                 has_commit: bool, norm_dtype: type, tile: TileConfig) -> None:
        self.consumer_warpgroups = tile.bm // 64
        super().__init__(num_layers, n_kv, head_dim, has_bias, has_commit, norm_dtype, tile,
                         128 * (1 + self.consumer_warpgroups))
        self.stages = self.ring_stages(16, WGMMA_SMEM_BUDGET)
        self.consumer_threads = 128 * self.consumer_warpgroups
        assert self.bm in (64, 128) and self.bn in (32, 64, 128, 256)

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
        dp_tiles: Int32,
        stream: cuda.CUstream,
    ) -> None:
        mLoc = self.token_slots(mLoc)
        k_major = cutlass.tensor_utils.LayoutEnum.ROW_MAJOR  # both operands are [rows, H], H inner
        tiled_mma = sm90_utils.make_trivial_tiled_mma(
            BFloat16, BFloat16, k_major.sm90_mma_major_mode(), k_major.sm90_mma_major_mode(),
            Float32, (self.consumer_warpgroups, 1, 1), tiler_mn=(64, self.bn),
        )
        tile_mnk = (self.bm, self.bn, self.bk)
        sA_layout = sm90_utils.make_smem_layout_a(k_major, tile_mnk, BFloat16, self.stages)
        sB_layout = sm90_utils.make_smem_layout_b(k_major, tile_mnk, BFloat16, self.stages)
        mX_rows = self.token_rows(mX)
        tma_a, tma_mA = cute.nvgpu.cpasync.make_tiled_tma_atom(
            cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp(), mX_rows,
            cute.slice_(sA_layout, (None, None, 0)), (self.bm, self.bk),
        )
        if const_expr(self.split_head):
            # Weight row head * D + half * D/2 + h * D/4 + r as modes (r, half, h, head): one
            # 5-D TMA box of (D/4 rows, both halves) is split-head tile 2 * head + h, the
            # head columns [h D/4, (h + 1) D/4) then [D/2 + h D/4, ...) of its CTA.
            quarter = self.head_dim // 4
            rs = mW.stride[0]
            mW = cute.make_tensor(mW.iterator, cute.make_layout(
                ((quarter, 2, 2, mW.shape[0] // self.head_dim), mW.shape[1]),
                stride=((rs, 2 * quarter * rs, quarter * rs, self.head_dim * rs), 1)))
        tma_b, tma_mW = cute.nvgpu.cpasync.make_tiled_tma_atom(
            cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp(), mW,
            cute.slice_(sB_layout, (None, None, 0)), (self.bn, self.bk),
        )

        @cute.struct
        class SharedStorage:
            full_empty: cute.struct.MemRange[Int64, self.stages * 2]
            # split-head tiles: per buffer (unit parity) the peer's row sums of squares and
            # the mbarrier its 32 quad leaders arrive on
            exchange_bar: cute.struct.MemRange[Int64, 2]
            exchange: cute.struct.MemRange[Float32, 2 * self.bm]
            # stream-K: the tile counter's value before this CTA's arrival, for its consumers
            arrived: cute.struct.MemRange[Int32, 1]
            sA: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(sA_layout)], 1024]
            sB: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(sB_layout)], 1024]

        self.shared_storage = SharedStorage
        kernel = self.kernel(
            tma_a, tma_mA, tma_b, tma_mW, mBias, mNormW, eps, mPos, mCosSin, mLoc, mCommit,
            width, k_caches, v_caches, mWork, mCount, dp_tiles, sA_layout, sB_layout, tiled_mma,
        )
        if const_expr(self.split_head):  # data-parallel: it waits only inside its clusters
            kernel.launch(grid=[grid_ctas, 1, 1], block=[self.threads, 1, 1],
                          cluster=[2, 1, 1], stream=stream)
        else:  # no CTA waits for another (stream-K: the last to arrive finishes a tile)
            kernel.launch(grid=[grid_ctas, 1, 1], block=[self.threads, 1, 1], stream=stream)

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
        mWork: cute.Tensor,
        mCount: cute.Tensor,
        dp_tiles: Int32,
        sA_layout: cute.ComposedLayout,
        sB_layout: cute.ComposedLayout,
        tiled_mma: cute.TiledMma,
    ) -> None:
        tidx, bid, grid, warp = self.kernel_start(tma_a, tma_b)
        num_m_tiles = cute.ceil_div(mLoc.shape[0], self.bm)
        k_tiles = mA.shape[1] // self.bk
        sk = StreamK((num_m_tiles * self.num_n_tiles - dp_tiles) * k_tiles, k_tiles, bid, grid)

        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        ring = self.make_ring(storage.full_empty.data_ptr(), sA_layout, sB_layout)
        if const_expr(self.split_head):
            if tidx == 0:
                for b in cutlass.range_constexpr(2):
                    cute.arch.mbarrier_init(storage.exchange_bar.data_ptr() + b,
                                            self.consumer_threads // 4)
        # (a split-head CTA's peer arrives on its exchange barriers: both CTAs of the cluster
        # pass this barrier before any exchange)
        cluster_shape = (2, 1) if self.split_head else (1, 1)
        pipeline.pipeline_init_arrive(cluster_shape_mn=cluster_shape, is_relaxed=True)

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
        pipeline.pipeline_init_wait(cluster_shape_mn=cluster_shape)

        warpgroup = cute.arch.make_warp_uniform(tidx // 128)
        if warpgroup == 0:
            cute.arch.setmaxregister_decrease(PRODUCER_REGS)
            if warp == 0:
                producer, evict_first, stream = self.producer_start(mA.shape[1])
                # The consumers' order: the data-parallel tiles, then the stream-K range.
                # (pipeline states advance in the loop bodies: the tracer carries locals only)
                for tile in cutlass.range(bid, dp_tiles, grid, unroll=1):
                    tile_m, tile_n = self.tile_coords(tile, num_m_tiles)
                    for k_tile in cutlass.range(k_tiles, unroll=1):
                        self.load_stage(ring, producer, ((tma_a, tAgA, tAsA, tile_m, None),
                                                         (tma_b, tBgB, tBsB, tile_n, evict_first)),
                                        k_tile, stream)
                        producer.advance()
                for it in cutlass.range(sk.begin, sk.end, unroll=1):
                    seg = it // k_tiles
                    tile_m, tile_n = self.tile_coords(dp_tiles + seg, num_m_tiles)
                    self.load_stage(ring, producer, ((tma_a, tAgA, tAsA, tile_m, None),
                                                     (tma_b, tBgB, tBsB, tile_n, evict_first)),
                                    it - seg * k_tiles, stream)
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
            read, release = self.consumer_states()
            num_dp = (dp_tiles - bid + grid - 1) // grid
            # Zeroed accumulators (each unit) and a static ACCUMULATE flag (set once, outside
            # the unit's branches): nothing loop-carried in the MMA.
            tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
            exchange = (Int32(storage.exchange.data_ptr().toint()),
                        storage.exchange_bar.data_ptr())
            exchanges = Int32(0)  # split-head: sums of squares exchanged so far (K tiles)
            sArrived = storage.arrived.get_tensor(cute.make_layout(1))
            for unit in cutlass.range(num_dp + sk.num_segments, unroll=1):
                # -- what this unit is: (tile, k-range, mode) ------------------------------
                tile = bid + unit * grid
                k_lo = Int32(0)
                k_hi = k_tiles
                mode = Int32(FULL)
                seg = Int32(0)
                if unit >= num_dp:
                    seg = sk.first_seg + unit - num_dp
                    tile = dp_tiles + seg
                    k_lo, k_hi = sk.k_range(seg)
                    if k_hi - k_lo != k_tiles:
                        mode = Int32(PARTIAL)
                tile_m, tile_n = self.tile_coords(tile, num_m_tiles)
                rows_valid = cutlass.min(mLoc.shape[0] - tile_m * self.bm, self.bm)
                # The epilogue's row metadata (slot, then position: two dependent global
                # loads) is fetched now and lands while the main loop runs.
                rows = []
                for r in cutlass.range_constexpr(2):
                    row = tCcC[2 * r][0]
                    rows.append(self.row_destination(mLoc, mCommit, width,
                                                     tile_m * self.bm + row))
                positions = [cutlass.select_(valid, mPos[t], Int64(0)) for t, _, valid in rows]
                # acc = the sum over this unit's k-tiles
                read, release = self.multiply(ring, read, release, tiled_mma, acc, tCrA, tCrB,
                                              k_blocks, k_hi - k_lo)
                ring.consumer_release(release)
                release.advance()
                finish = Int32(1)
                if mode == PARTIAL:  # finished here only by the last contributor to arrive
                    finish = self.hand_over(sk, seg, mWork, mCount, sArrived, acc, tCcC,
                                            rows_valid, ctid)
                if finish != 0:
                    exchanges = self.epilogue(acc, tCcC, mBias, mNormW, eps, mCosSin,
                                              k_caches, v_caches, tile_n,
                                              [(slot, valid) for _, slot, valid in rows],
                                              positions, exchange, exchanges)
        if const_expr(self.split_head):
            # Every remote write into a CTA precedes the arrivals it waits for, so no CTA can
            # exit while its peer still writes into it; a cluster barrier at the end says so
            # in a form compute-sanitizer's racecheck sees (it does not follow the remote
            # mbarrier arrivals: 1792 "block might have exited" reports without it).
            cute.arch.cluster_arrive()
            cute.arch.cluster_wait()

    @cute.jit
    def partial_addr(self, mWork: cute.Tensor, slot: Int32, row: Int32, col: Int32) -> Int64:
        """Byte address of element (row, col) of workspace ``slot`` (a row-major fp32 tile)."""
        index = (Int64(slot) * self.bm + row) * self.bn + col
        return mWork.iterator.toint() + index * 4

    @cute.jit
    def hand_over(self, sk, seg: Int32, mWork: cute.Tensor, mCount: cute.Tensor,
                  sArrived: cute.Tensor, acc: cute.Tensor, tCcC: cute.Tensor,
                  rows_valid: Int32, ctid: Int32) -> Int32:
        """Store this CTA's partial of stream-K tile ``seg`` (rows < ``rows_valid`` only) and
        count it as arrived with release semantics. The contributor whose arrival completes
        the count leaves in ``acc`` the sum of all the tile's partials in contributor order
        (``((p0 + p1) + p2) + ...``, its own re-read like the others: the same bits whoever
        is last), resets the counter and returns 1; the others return 0.

        Each thread stores and loads the elements of its own fragment (a quad's 32 contiguous
        bytes of a row); the partials were written by other SMs, so they are read from L2
        (``ld.global.cg``). Each load sits under its row's branch next to the addition that
        uses it, so they are not all in flight at once (the spec, "Status and known gaps")."""
        slot = sk.own_slot(seg)
        for q in cutlass.range_constexpr(self.bn // 4):
            row, col = tCcC[2 * q]
            if row < rows_valid:
                du.store_f32x2(self.partial_addr(mWork, slot, row, col), acc[2 * q],
                               acc[2 * q + 1])
        first, count = sk.contributors(seg)
        last = Int32(0)
        if self.arrive(mCount.iterator.toint() + Int64(seg) * 4, count, sArrived, ctid,
                       CONSUMER_BARRIER, self.consumer_threads):
            last = Int32(1)
            # Contributors after the first start their ranges inside this tile, so it is
            # their first tile (slot 2c); only the first's slot needs the division.
            first_slot = sk.slot(first, seg)
            for c in cutlass.range(count, unroll=1):
                src = cutlass.select_(c == 0, first_slot, 2 * (first + c))
                for q in cutlass.range_constexpr(self.bn // 4):
                    row, col = tCcC[2 * q]
                    if row < rows_valid:  # rows beyond were never stored (nor are written)
                        lo, hi = du.load_global_f32x2(self.partial_addr(mWork, src, row, col))
                        acc[2 * q] = cutlass.select_(c == 0, lo, du.add_rn(acc[2 * q], lo))
                        acc[2 * q + 1] = cutlass.select_(c == 0, hi,
                                                         du.add_rn(acc[2 * q + 1], hi))
        return last

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
        exchange: tuple,
        exchanges: Int32,
    ) -> Int32:
        """This thread's two rows of the tile -> cache rows, from the accumulator registers.
        Register ``4j + 2r + e`` holds row ``r`` (0: the first, 1: +8), column ``8j + e``
        beyond the thread's first column; its NeoX partner is ``D / 16`` groups of 8 on.
        ``rows``: (slot, written?) per row; ``positions``: the RoPE position per row. Both
        rows are finished before either is stored, so no load waits behind a store.
        Split-head tiles: the tile's columns are head columns ``[h D/4, (h + 1) D/4)`` then
        ``[D/2 + h D/4, ...)``, and each row's sum of squares is completed with the peer's
        (``exchange``: this CTA's buffer and barriers; ``exchanges``: how many it did before).
        Returns ``exchanges`` counted on."""
        groups = self.bn // 8  # column groups of 8 per row
        head_groups = self.head_cols // 8  # a head's column groups in this tile
        partner = 4 * (head_groups // 2)  # register distance from d to d + D/2
        # this thread's first head column: 2 * (lane % 4), in its quarter for a split head
        col_base = tCcC[0][1]
        if const_expr(self.split_head):
            col_base = col_base + (tile_n % 2) * (self.head_dim // 4)
        layer, is_k, base, row_bytes, slots = self.tile_destination(tile_n, k_caches,
                                                                    v_caches, col_base)
        # Indices out of range never reach memory: a row whose position lies outside the
        # cos/sin table (K and V tiles alike) or whose slot is past the cache's last row is
        # not stored, and reads table row 0.
        in_table = [(p >= 0) & (p < Int64(mCosSin.shape[0])) for p in positions]
        rows = [(slot, valid & in_table[r] & (slot < slots))
                for r, (slot, valid) in enumerate(rows)]
        positions = [cutlass.select_(in_table[r], p, Int64(0)) for r, p in enumerate(positions)]
        rWord = cute.make_rmem_tensor((1,), Uint32)
        # The rounding helpers are inline PTX, which the compiler keeps in program order with
        # the loads, so a load placed next to the math that uses it waits for its own L2 /
        # DRAM round trip: with the norm weights and cos/sin loaded per column group, 16 in a
        # row. So each batch of inputs is requested whole before any arithmetic that uses it
        # (one layer, T = 256: 25.5 -> 23.4 us).
        if const_expr(self.has_bias):
            rB = cute.make_rmem_tensor((groups * 2,), BFloat16)  # [j][e]; both rows share it
            for j in cutlass.range_constexpr(groups):
                col = self.stacked_column(tile_n, col_base, j)
                cute.autovec_copy(cute.local_tile(mBias, (2,), (col // 2,)),
                                  cute.local_tile(rB, (2,), (j,)))
            for j in cutlass.range_constexpr(groups):
                for r in cutlass.range_constexpr(2):
                    for e in cutlass.range_constexpr(2):
                        acc[4 * j + 2 * r + e] = du.add_rn(acc[4 * j + 2 * r + e],
                                                         rB[2 * j + e].to(Float32))

        if is_k:
            # Batches of (rows, column pairs (d, d + D/2)) whose inputs fit beside the
            # accumulators: all at once with 64 of them; one row and 8 pairs at a time with
            # 128 (more made ptxas spill). A thread's columns are the same in every head.
            pairs = head_groups // 2
            batch_pairs = pairs if self.bn <= 128 else min(pairs, 8)
            batch_rows = 2 if self.bn <= 128 else 1
            batches = [(r0, g0) for r0 in range(0, 2, batch_rows)
                       for g0 in range(0, pairs, batch_pairs)]
            rW = cute.make_rmem_tensor((batch_pairs * 4,), self.norm_dtype)  # [g][h][e]
            rCos = cute.make_rmem_tensor((batch_rows * batch_pairs * 2,), Float32)  # [r][g][e]
            rSin = cute.make_rmem_tensor((batch_rows * batch_pairs * 2,), Float32)
            if const_expr(not self.split_head):  # (a split head's: after its sums are sent)
                self.load_norm_inputs(mNormW, mCosSin, layer, positions, col_base, batches[0],
                                      batch_rows, batch_pairs, rW, rCos, rSin)

            # R1 for K heads; a V value's R1 is the bf16 rounding of its store.
            for i in cutlass.range_constexpr(self.bn // 2):
                acc[i] = du.round_to_bf16(acc[i])

            # Every lane of the warp is here (is_k is CTA-uniform): safe to shuffle.
            inv_d = Float32(1.0 / self.head_dim)  # exact: D is a power of two
            rstd = []  # [head][row]
            for head in cutlass.range_constexpr(self.heads_per_tile):
                first = 4 * head * head_groups  # register of row 0's first head column
                for r in cutlass.range_constexpr(2):
                    ss = Float32(0.0)
                    for g in cutlass.range_constexpr(head_groups):
                        for e in cutlass.range_constexpr(2):
                            y = acc[first + 4 * g + 2 * r + e]
                            ss = ss + y * y
                    ss = ss + cute.arch.shuffle_sync_bfly(ss, offset=1)  # the quad holds
                    ss = ss + cute.arch.shuffle_sync_bfly(ss, offset=2)  # the whole row
                    rstd.append(ss)
            if const_expr(self.split_head):
                # The sums leave first: the arrival's release waits for every earlier load
                # of the thread, so the norm weights and cos/sin are requested after it and
                # land while the peer's sums are awaited.
                places = self.exchange_places(tCcC, exchange, exchanges)
                self.send_sums(rstd, places)
                self.load_norm_inputs(mNormW, mCosSin, layer, positions, col_base, batches[0],
                                      batch_rows, batch_pairs, rW, rCos, rSin)
                rstd = self.receive_sums(rstd, places)
                exchanges = exchanges + 1
            rstd = [du.rsqrt_approx(ss * inv_d + eps) for ss in rstd]
            for n, (r0, g0) in enumerate(batches):
                if const_expr(n > 0):
                    self.load_norm_inputs(mNormW, mCosSin, layer, positions, col_base,
                                          (r0, g0), batch_rows, batch_pairs, rW, rCos, rSin)
                for head in cutlass.range_constexpr(self.heads_per_tile):
                    first = 4 * head * head_groups
                    for r in cutlass.range_constexpr(r0, r0 + batch_rows):
                        for g in cutlass.range_constexpr(g0, g0 + batch_pairs):
                            at = 2 * ((r - r0) * batch_pairs + g - g0)
                            w = 4 * (g - g0)
                            for e in cutlass.range_constexpr(2):
                                i1 = first + 4 * g + 2 * r + e
                                i2 = i1 + partner
                                acc[i1], acc[i2] = neox_rotate(
                                    r2(acc[i1], rstd[2 * head + r], rW[w + e].to(Float32)),
                                    r2(acc[i2], rstd[2 * head + r], rW[w + 2 + e].to(Float32)),
                                    rCos[at + e], rSin[at + e],
                                )

        for r in cutlass.range_constexpr(2):
            slot, valid = rows[r]
            if valid:
                row_addr = base + Int64(slot) * row_bytes
                for j in cutlass.range_constexpr(groups):
                    rWord[0] = du.pack_bf16x2(acc[4 * j + 2 * r], acc[4 * j + 2 * r + 1])  # R3
                    du.store_words(row_addr + 2 * self.group_offset(j), rWord, align=4)
        return exchanges

    def group_offset(self, j: int) -> int:
        """Columns from this thread's first column to its column group ``j``: 8 a group; a
        split head's second half starts ``D/4`` columns past the end of its first."""
        gap = self.head_dim // 4 if self.split_head and j >= self.bn // 16 else 0
        return 8 * j + gap

    @cute.jit
    def stacked_column(self, tile_n: Int32, col_base: Int32, j: int) -> Int32:
        """Stacked column of this thread's column group ``j`` of tile ``tile_n``."""
        first = (tile_n // 2) * self.head_dim if self.split_head else tile_n * self.bn
        return first + col_base + self.group_offset(j)

    def exchange_places(self, tCcC: cute.Tensor, exchange: tuple, exchanges: Int32) -> tuple:
        """What exchange number ``exchanges`` uses, for :meth:`send_sums` and
        :meth:`receive_sums`: the barrier of its buffer (parity ``exchanges % 2``), the
        barrier's phase, and the addresses of this thread's two rows in the buffer (the same
        offsets in both CTAs): ``(barrier, phase, addrs)``."""
        buf_addr, bars = exchange
        buf = exchanges % 2
        addrs = [buf_addr + (buf * self.bm + tCcC[2 * r][0]) * 4 for r in range(2)]
        return bars + buf, (exchanges // 2) % 2, addrs

    @cute.jit
    def send_sums(self, sums: list, places: tuple) -> None:
        """Split-head tiles, the first half of the exchange of the rows' sums of squares
        over the head's full D columns (``places`` from :meth:`exchange_places`): the quad
        leader of each row pair writes its two half-head sums into the peer CTA's buffer and
        arrives on the peer's barrier (release, cluster scope). A buffer is written again two
        exchanges later, after the peer has arrived on this CTA's barrier for the exchange
        between, which it does after reading it (:meth:`receive_sums`)."""
        barrier, _, addrs = places
        peer = 1 - cute.arch.block_idx_in_cluster()  # the CTA of the other half
        if cute.arch.lane_idx() % 4 == 0:
            for r in cutlass.range_constexpr(2):
                du.store_peer_f32(addrs[r], peer, sums[r])
            cute.arch.mbarrier_arrive(barrier, peer_cta_rank_in_cluster=peer,
                                      scope=nvvm.MemScopeKind.CLUSTER)

    @cute.jit
    def receive_sums(self, sums: list, places: tuple) -> list:
        """The second half: every thread waits on its own barrier (acquire, cluster scope)
        and adds the peer's halves to ``sums`` (IEEE addition commutes: both CTAs get the
        same bits)."""
        barrier, phase, addrs = places
        bar_addr = Int32(barrier.toint())
        while du.mbarrier_try_wait_cluster(bar_addr, phase) == 0:
            pass
        return [sums[r] + du.load_shared_b32(addrs[r], Float32) for r in range(2)]

    @cute.jit
    def load_norm_inputs(self, mNormW: cute.Tensor, mCosSin: cute.Tensor, layer: Int32,
                         positions: list, col_base: Int32, batch: tuple, rows: int, pairs: int,
                         rW: cute.Tensor, rCos: cute.Tensor, rSin: cute.Tensor) -> None:
        """Request the norm weights of column pairs ``g0 .. g0 + pairs - 1`` of this thread
        and the cos / sin of its rows ``r0 .. r0 + rows - 1`` at them, all at once
        (``batch = (r0, g0)``)."""
        r0, g0 = batch
        half = self.head_dim // 2
        for g in cutlass.range_constexpr(pairs):
            d = col_base + 8 * (g0 + g)  # head column of the first half
            for h in cutlass.range_constexpr(2):
                cute.autovec_copy(
                    cute.local_tile(mNormW[layer, None], (2,), ((d + h * half) // 2,)),
                    cute.local_tile(rW, (2,), (2 * g + h,)))
            for r in cutlass.range_constexpr(rows):
                gCS = mCosSin[positions[r0 + r], None]
                cute.autovec_copy(cute.local_tile(gCS, (2,), (d // 2,)),
                                  cute.local_tile(rCos, (2,), (r * pairs + g,)))
                cute.autovec_copy(cute.local_tile(gCS, (2,), ((half + d) // 2,)),
                                  cute.local_tile(rSin, (2,), (r * pairs + g,)))
