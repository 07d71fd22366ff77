"""The Hopper decode stage 1 with the query rows as the M of both products: ``S = Q K^T``, ``O = P' V``.

v1's kernel (:mod:`foscar.cute.kernel_v1`) multiplies ``S^T = K Q^T``: the 64 tokens of a tile are the M of the
wgmma and a KV head's query rows its N columns, so that K is built in registers as the A operand. Beyond 8 rows
that costs the softmax most: a row's scores lie on 32 threads of four warps (three shuffles and a round through
shared memory a column slot), and P goes through shared memory as the B operand of ``O^T = V^T P'^T``. Here the
rows (a KV head's query heads times the step's tokens, at most 32) are the M: row ``i`` is M row
``16 (i // per) + i % per`` (``per = cols / 4``), so each thread holds at most one real row, the first of its
two accumulator rows, and its scores of a tile are 16 of that row's 64 (the other three in its quad).

- The producer is v1's: TMA copies of each tile's packed words and ``(s', z')`` into a stage ring per consumer.
- Each consumer warpgroup builds its tile's operands from the packed codes straight into shared memory, K
  (tokens x channels, BF16 ``q + beta_K`` by mantissa injection) and V^T (channels x tokens, FP16 by
  placement), with v1's register builders and A-fragment positions (:mod:`foscar.cute.fragment`): wgmma reads
  B only from shared memory. No scale is applied per value.
- ``S = Q K^T``: Q (BF16, M rows) in registers, K^T from shared memory. K's **acc-fold** per token: the score
  column ``t`` takes ``s'_t`` and the offset term ``z'_t sum(Q)``, centred on the pivot as v1 does
  (:func:`foscar.cute.folds.k_acc_fold`).
- The online softmax per row: two shuffles in the quad, no shared memory; the lazy rescale per thread (its row).
- V's **operand-fold**: ``P' = P s'_V / sigma`` (FP16, the A operand of ``O = P' V``, in registers: the
  accumulator's layout is the A fragment's), the **offset correction** ``sum_t P z'_t``, centred, gathered per
  row and added in the epilogue.

Each consumer writes its partial (``split * CONSUMERS + c``), as v1's do; the combine merges them.
"""
from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90
from cutlass import BFloat16, Float16, Float32, Int32, Int64, Uint32
from cutlass.cute.nvgpu import OperandMajorMode, warpgroup
from cutlass.memory import SmemAllocator

from ..format import P_UNITS_START
from .config import CONSUMERS, RESCALE_HEADROOM, THREADS, TILE, Sm90Config, column_token
from .folds import grow_sigma, p_units_bound, power_of_two_reciprocal
from .kernel_v1 import FoldDecodeSm90WS, ring_phase, ring_slot, ring_tile
from .fragment import k_register_source, v_register_source, v_token_half
from .operands import inject, inject_rotated, place
from .softmax import nonempty_max
from .warpgroup import TileRegisters, WarpgroupThread


def rows_mmas(cfg: Sm90Config) -> tuple:
    """``(qk, pv, k_store, v_store)``: the tiled MMAs of ``S = Q K^T`` (BF16, Q from registers, 64 x 64) and of
    ``O = P' V`` (FP16, P' from registers, 64 x head_dim), and the register-A ones whose A partitions place
    the built K (tokens x channels) and V^T (channels x tokens) in shared memory (v1's ``S^T`` and ``O^T``
    products: their fragments are what :func:`~foscar.cute.operands.build_k_registers` and
    :func:`~foscar.cute.operands.build_vt_registers` fill)."""
    def mma(dtype, n):
        return sm90.make_trivial_tiled_mma(dtype, dtype, OperandMajorMode.K, OperandMajorMode.K, Float32,
                                           (1, 1, 1), (TILE, n), warpgroup.OperandSource.RMEM)
    return mma(BFloat16, TILE), mma(Float16, cfg.head_dim), mma(BFloat16, 8), mma(Float16, 8)


def rows_layouts(cfg: Sm90Config) -> tuple:
    """The swizzled (128-byte) shared-memory layouts of Q (64 M rows x channels), the built K (tokens x
    channels) and V^T (channels x tokens), each K-major, these two with a mode of :data:`OPERAND_SLOTS`."""
    D = cfg.head_dim
    bf16 = warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.K_SW128, BFloat16)
    f16 = warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.K_SW128, Float16)
    return (cute.tile_to_shape(bf16, (TILE, D), (0, 1)), cute.tile_to_shape(bf16, (TILE, D, OPERAND_SLOTS), (0, 1, 2)),
            cute.tile_to_shape(f16, (D, TILE, OPERAND_SLOTS), (0, 1, 2)))


def rows_per_warp(cfg: Sm90Config) -> int:
    """Real rows of each warp's 16 M rows: ``cols / 4`` (8 at 32 columns, 4 at 16, 2 at 8)."""
    return cfg.cols // 4


def m_row(i: int, per: int) -> int:
    """The M row of query row ``i``."""
    return 16 * (i // per) + i % per


#: Operand slots of the CTA: two per consumer (a tile's K, V^T and token table built while the other is read)
OPERAND_SLOTS = 2 * CONSUMERS
#: (producer, consumer) registers a thread after ``setmaxnreg``: the producer builds operands (its words, one
#: register fragment at a time), the consumers hold Q, the accumulators and the P' fragment
ROWS_REGISTERS = (56, 224)


def operand_slot(c, k):
    """``(slot, phase)``: the operand slot of consumer ``c``'s ``k``-th tile and its mbarrier phase."""
    return 2 * c + (k & 1), (k >> 1) & 1


def lookahead(cfg: Sm90Config) -> int:
    """Tiles the producer's copies run ahead of its builders: the stage ring less the stage being built."""
    return cfg.stages * CONSUMERS - 1


class RowOperands:
    """The operand slots in shared memory (:data:`OPERAND_SLOTS`): K (``sK[token, channel, slot]``, BF16), V^T
    (``sV[channel, token, slot]``, FP16), the token table (``table[slot, token, j]``: K's ``s' qk_scale`` and its
    offset term's factor ``(z' + mid s') qk_scale``, V's ``s'`` and ``z' + mid s'``; zero past the sequence), each
    half's bound on the P' units (``bound[slot, half]``), and each slot's full and empty mbarriers."""

    def __init__(self, alloc: SmemAllocator, sK_layout: cute.ComposedLayout, sV_layout: cute.ComposedLayout):
        self.sK = alloc.allocate_tensor(BFloat16, sK_layout.outer, byte_alignment=1024, swizzle=sK_layout.inner)
        self.sV = alloc.allocate_tensor(Float16, sV_layout.outer, byte_alignment=1024, swizzle=sV_layout.inner)
        self.table = alloc.allocate_tensor(Float32, cute.make_layout((OPERAND_SLOTS, TILE, 4),
                                                                     stride=(4 * TILE, 4, 1)), byte_alignment=16)
        self.bound = alloc.allocate_tensor(Float32, cute.make_layout((OPERAND_SLOTS, 2), stride=(2, 1)),
                                           byte_alignment=16)
        self.full = alloc.allocate_array(Int64, OPERAND_SLOTS)
        self.empty = alloc.allocate_array(Int64, OPERAND_SLOTS)


@cute.jit
def store_k_operand(cfg: Sm90Config, regs: cute.Tensor, dst: cute.Tensor, kw: cute.Tensor):
    """K's BF16 operands ``q + beta_K`` (v1's :func:`~foscar.cute.operands.build_k_registers`) into shared memory at
    this thread's A-fragment positions (``dst``: the partition of the slot), one k16 block of registers at a
    time (few registers live: the producer's budget)."""
    words = cute.recast_tensor(regs, Uint32)
    for kb in cutlass.range_constexpr(cute.size(regs, mode=[2])):
        for j in cutlass.range_constexpr(4):
            i, field = k_register_source(cfg.bits, 4 * kb + j)
            words[4 * kb + j] = inject(Uint32(kw[i]), field, cfg.k_shl, cfg.bits, cfg.k_pattern)
        cute.autovec_copy(regs[None, None, kb], dst[None, None, kb])


@cute.jit
def store_vt_operand(cfg: Sm90Config, regs: cute.Tensor, dst: cute.Tensor, vw: cute.Tensor):
    """V^T's FP16 operands (v1's :func:`~foscar.cute.operands.build_vt_registers`) into shared memory at this
    thread's A-fragment positions, one (m64 block, k16 block) of registers at a time; each word's rotation made
    once."""
    words = cute.recast_tensor(regs, Uint32)
    halves = cute.size(regs, mode=[1])
    rotated = {}
    for kb in cutlass.range_constexpr(cute.size(regs, mode=[2])):
        for mh in cutlass.range_constexpr(halves):
            for j in cutlass.range_constexpr(4):
                r = 4 * (mh + halves * kb) + j
                vb, wh, field = v_register_source(cfg.bits, cfg.head_dim, r)
                h = v_token_half(r)
                shl = cfg.v_shls[h]
                key = (wh, vb, (field - shl) % 32)
                if cutlass.const_expr(key not in rotated):
                    rotated[key] = inject_rotated(Uint32(vw[wh, vb]), key[2])
                words[r] = place(rotated[key], shl, cfg.bits, cfg.v_patterns[h])
            cute.autovec_copy(regs[None, mh, kb], dst[None, mh, kb])


def first_row(e: int) -> int:
    """The accumulator (and A fragment) element of a thread's ``e``-th element of its first row: CuTe's ``m64nN``
    C fragment orders ``c + 2 r + 4 j`` (column ``8 j + 2 quad + c``, row ``+ 8 r``)."""
    return 4 * (e // 2) + e % 2


class RowsDecodeSm90(FoldDecodeSm90WS):
    """v1's stage ring with a producer warpgroup that also builds the operands, and consumers that multiply
    ``S = Q K^T`` and ``O = P' V`` (module docstring)."""

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mKC: cute.Tensor, mVC: cute.Tensor, mKP: cute.Tensor, mVP: cute.Tensor,
                 mBT: cute.Tensor, mSEQ: cute.Tensor, mOP: cute.Tensor, mLP: cute.Tensor, mRot: cute.Tensor,
                 mTS: cute.Tensor, qk_scale: Float32, num_splits: Int32, stream: cuda.CUstream):
        qk_mma, pv_mma, k_store, v_store = rows_mmas(self.cfg)
        sQ_layout, sK_layout, sV_layout = rows_layouts(self.cfg)
        atoms = self._tma_atoms(mKC, mVC, mKP, mVP)
        batch = cute.size(mQ, mode=[0])
        kv_heads = cute.size(mKC, mode=[1])
        self.rows_kernel(qk_mma, pv_mma, k_store, v_store, sQ_layout, sK_layout, sV_layout,
                         atoms[0][0], atoms[0][1], atoms[1][0], atoms[1][1], atoms[2][0], atoms[2][1],
                         atoms[3][0], atoms[3][1], mQ, mBT, mSEQ, mOP, mLP, qk_scale).launch(
            grid=(kv_heads, batch, num_splits), block=(THREADS * (1 + CONSUMERS), 1, 1), stream=stream,
            min_blocks_per_mp=1, preferred_smem_carveout=100)

    @cute.kernel
    def rows_kernel(self, qk_mma: cute.TiledMma, pv_mma: cute.TiledMma, k_store: cute.TiledMma,
                    v_store: cute.TiledMma, sQ_layout: cute.ComposedLayout, sK_layout: cute.ComposedLayout,
                    sV_layout: cute.ComposedLayout, atom_kc: cute.CopyAtom, tma_kc: cute.Tensor,
                    atom_vc: cute.CopyAtom, tma_vc: cute.Tensor, atom_kp: cute.CopyAtom, tma_kp: cute.Tensor,
                    atom_vp: cute.CopyAtom, tma_vp: cute.Tensor, mQ: cute.Tensor, mBT: cute.Tensor,
                    mSEQ: cute.Tensor, mOP: cute.Tensor, mLP: cute.Tensor, qk_scale: Float32):
        cfg = self.cfg
        slots = cfg.stages * CONSUMERS
        tidx, _, _ = cute.arch.thread_idx()
        kvh, b, split = cute.arch.block_idx()
        n_kvh, _, n_splits = cute.arch.grid_dim()
        role = cute.arch.make_warp_uniform(tidx // THREADS)  # the warpgroup: 0 producer, 1 + c consumer c
        if cutlass.const_expr(cfg.trigger_dependents):
            cute.arch.griddepcontrol_launch_dependents()
        qk_mma.set(warpgroup.Field.ACCUMULATE, True)
        pv_mma.set(warpgroup.Field.ACCUMULATE, True)

        alloc = SmemAllocator()
        ring = self._ring(alloc)
        sQ = alloc.allocate_tensor(BFloat16, sQ_layout.outer, byte_alignment=1024, swizzle=sQ_layout.inner)
        sQsum = alloc.allocate_tensor(Float32, cute.make_layout(TILE), byte_alignment=16)
        ops = RowOperands(alloc, sK_layout, sV_layout)
        if tidx == 0:
            for i in cutlass.range_constexpr(slots):
                cute.arch.mbarrier_init(ring.full + i, 1)
                cute.arch.mbarrier_init(ring.empty + i, THREADS)
            for i in cutlass.range_constexpr(OPERAND_SLOTS):
                cute.arch.mbarrier_init(ops.full + i, THREADS)
                cute.arch.mbarrier_init(ops.empty + i, THREADS)
        cute.arch.mbarrier_init_fence()
        n, t_lo, t_hi = self._split_tiles(mSEQ, b, split, n_splits)
        if role == 0:
            self._stage_q_rows(mQ, sQ, b, kvh, n_kvh, tidx)
        cute.arch.sync_threads()
        if role == 0:
            self._q_row_sums(sQ, sQsum, tidx)
        cute.arch.sync_threads()

        if role == 0:  # ---- producer: TMA copies (its first thread) and the operands (all) ------------------
            cute.arch.setmaxregister_decrease(ROWS_REGISTERS[0])
            tma = ((atom_kc, tma_kc), (atom_vc, tma_vc), (atom_kp, tma_kp), (atom_vp, tma_vp))
            self._produce(tma, ring, ops, k_store, v_store, mBT, b, kvh, t_lo, t_hi, n, qk_scale, tidx)
        for c in cutlass.range_constexpr(CONSUMERS):
            if role == c + 1:
                cute.arch.setmaxregister_increase(ROWS_REGISTERS[1])
                self._consume_rows(c, qk_mma, pv_mma, ops, sQ, sQsum, mOP, mLP, b, kvh, split, t_lo, t_hi, n,
                                   qk_scale, n_kvh)

    @cute.jit
    def _produce(self, tma: tuple, ring, ops, k_store: cute.TiledMma, v_store: cute.TiledMma, mBT: cute.Tensor, b,
                 kvh, t_lo, t_hi, n, qk_scale: Float32, ptid):
        """The producer warpgroup: its first warp keeps the stage ring :func:`lookahead` tiles ahead (v1's
        copies, issued by the whole warp: ``elect.sync``), and every thread builds its share of each tile's operands (K, V^T, the token table) from the
        stage into the tile's operand slot (:func:`operand_slot`), frees the stage, fences the writes for the
        wgmma's proxy and arrives on the slot's full barrier."""
        cfg = self.cfg
        D = cfg.head_dim
        ahead = lookahead(cfg)
        views = self._tma_views(tma, ring)  # partitions only: every thread, the first issues
        thr = WarpgroupThread(ptid, 0)
        if thr.warp == 0:
            for tile in cutlass.range(t_lo, cutlass.min(t_lo + ahead, t_hi), unroll=1):
                self._issue_tile(tma, views, ring, mBT, b, kvh, t_lo, tile, thr.lane)
        thr_k = k_store.get_slice(ptid)
        tKr = thr_k.make_fragment_A(thr_k.partition_shape_A((TILE, D)))
        tKs = thr_k.partition_A(ops.sK)
        thr_v = v_store.get_slice(ptid)
        tVr = thr_v.make_fragment_A(thr_v.partition_shape_A((D, TILE)))
        tVs = thr_v.partition_A(ops.sV)
        kw = cute.make_rmem_tensor(cute.make_layout(cfg.k_words), Int32)
        vw = cute.make_rmem_tensor(cute.make_layout((cfg.mh, cfg.v_blocks)), Int32)
        regs = TileRegisters(kw, vw, None, None)
        op_scale = qk_scale * cfg.k_factors[0]
        table = ops.table
        bounds = ops.bound
        for tile in cutlass.range(t_lo, t_hi, unroll=1):
            if thr.warp == 0:
                if tile + ahead < t_hi:
                    self._issue_tile(tma, views, ring, mBT, b, kvh, t_lo, tile + ahead, thr.lane)
            c, k = ring_tile(tile - t_lo, 1)
            slot = ring_slot(c, k, cfg.stages)
            os, phase = operand_slot(c, k)
            t0 = tile * TILE
            cute.arch.mbarrier_wait(ring.full + slot, ring_phase(k, cfg.stages))
            self._read_words(ring, slot, regs, thr)
            tok = ptid % TILE
            sel = ring.sKP if ptid < TILE else ring.sVP  # the first 64 threads take K's token parameters, the rest V's
            ps = sel[2 * tok, slot]
            pz = sel[2 * tok + 1, slot]
            cute.arch.mbarrier_wait(ops.empty + os, phase ^ 1)  # a fresh slot passes
            cute.arch.mbarrier_arrive(ring.empty + slot)  # the stage is in registers
            store_k_operand(cfg, tKr, tKs[None, None, None, os], kw)
            store_vt_operand(cfg, tVr, tVs[None, None, None, os], vw)
            # ---- the token table: K's acc-fold factors, V's scale and its offset's centre, the units' bound -----
            if t0 + tok >= n:  # past the sequence: no V (s', z') from whatever the page holds
                ps = Float32(0.0)
                pz = Float32(0.0)
            if ptid < TILE:
                table[os, tok, 0] = ps * op_scale
                table[os, tok, 1] = (pz + cfg.k_mid * ps) * qk_scale
            else:
                table[os, tok, 2] = ps
                table[os, tok, 3] = pz + cfg.v_mid * ps
                bound = p_units_bound(ps, pz)
                for sh in cutlass.range_constexpr(5):
                    bound = cute.arch.fmax(bound, cute.arch.shuffle_sync_bfly(bound, 1 << sh))
                if thr.lane == 0:
                    bounds[os, thr.warp - 2] = bound
            cute.arch.fence_view_async_shared()  # the wgmma reads the operands through the async proxy
            cute.arch.mbarrier_arrive(ops.full + os)

    @cute.jit
    def _stage_q_rows(self, mQ: cute.Tensor, sQ: cute.Tensor, b, kvh, n_kvh, tidx):
        """Q of KV head ``kvh``'s query rows into the M rows of ``sQ`` (:func:`m_row`), BF16, every other M row
        zero, by one warpgroup."""
        cfg = self.cfg
        D = cfg.head_dim
        per = rows_per_warp(cfg)
        for m in cutlass.range_constexpr(TILE):
            i = per * (m // 16) + m % 16
            real = m % 16 < per and i < cfg.rows
            for d0 in cutlass.range_constexpr(max(1, D // THREADS)):
                d = d0 * THREADS + tidx
                if d < D:
                    val = BFloat16(0.0)
                    if cutlass.const_expr(real):
                        val = mQ[b, self.query_row(i, kvh, n_kvh), d]
                    sQ[m, d] = val

    @cute.jit
    def _q_row_sums(self, sQ: cute.Tensor, sQsum: cute.Tensor, tidx):
        """``sum(Q)`` of each M row's BF16 operand (the acc-fold's offset term), by the threads of one warpgroup."""
        if tidx < TILE:
            acc = Float32(0.0)
            for d in cutlass.range(self.cfg.head_dim, unroll=8):
                acc += Float32(sQ[tidx, d])
            sQsum[tidx] = acc

    @cute.jit
    def _consume_rows(self, c: cutlass.Constexpr, qk_mma: cute.TiledMma, pv_mma: cute.TiledMma, ops,
                      sQ: cute.Tensor, sQsum: cute.Tensor, mOP: cute.Tensor, mLP: cute.Tensor, b, kvh, split, t_lo,
                      t_hi, n, qk_scale: Float32, n_kvh):
        """Consumer warpgroup ``c``: tiles ``t_lo + c, t_lo + c + CONSUMERS, ...`` of the split from their operand
        slots, then its partial."""
        cfg = self.cfg
        D = cfg.head_dim
        tidx, _, _ = cute.arch.thread_idx()
        thr = WarpgroupThread(tidx - THREADS * (c + 1), 1 + c)
        ctid = thr.tidx
        g = thr.lane // 4
        quad = thr.quad
        per = rows_per_warp(cfg)
        i_row = per * thr.warp + g  # this thread's query row, where g < per and i_row < rows
        qsum = sQsum[16 * thr.warp + g]
        cq = cfg.k_pivots[0] * qsum
        limit = n
        if cutlass.const_expr(cfg.step > 1):  # the tokens this row sees: the cache up to its own step token
            limit = n - (cfg.step - 1 - column_token(i_row, cfg.gqa, cfg.step))

        # ---- fragments --------------------------------------------------------------------------------------
        thr_qk = qk_mma.get_slice(ctid)
        tSrQ = thr_qk.make_fragment_A(thr_qk.partition_shape_A((TILE, D)))
        cute.autovec_copy(thr_qk.partition_A(sQ), tSrQ)
        tSrK = thr_qk.make_fragment_B(thr_qk.partition_B(ops.sK))
        accS = cute.make_rmem_tensor(thr_qk.partition_shape_C((TILE, TILE)), Float32)
        thr_pv = pv_mma.get_slice(ctid)
        tOrP = thr_pv.make_fragment_A(thr_pv.partition_shape_A((TILE, TILE)))
        tOrP.fill(0.0)  # the second row of each thread stays zero: padding
        tOrV = thr_pv.make_fragment_B(thr_pv.partition_B(ops.sV))
        accO = cute.make_rmem_tensor(thr_pv.partition_shape_C((TILE, D)), Float32)
        accO.fill(0.0)

        table = ops.table
        bounds = ops.bound
        f0, f1 = cfg.v_factors
        m = Float32(-Float32.inf)
        sigma = Float32(P_UNITS_START)
        lsum = Float32(0.0)
        corr = Float32(0.0)
        for tile in cutlass.range(t_lo + c, t_hi, CONSUMERS, unroll=1):
            k = (tile - t_lo) >> 1
            os, phase = operand_slot(c, k)
            nv = n - tile * TILE  # the tile's tokens inside the sequence
            lim = limit - tile * TILE  # and those this row sees
            cute.arch.mbarrier_wait(ops.full + os, phase)
            # ---- S = Q K^T --------------------------------------------------------------------------------------
            accS.fill(0.0)
            warpgroup.fence()
            for kb in cutlass.range_constexpr(cute.size(tSrQ, mode=[2])):
                cute.gemm(qk_mma, accS, tSrQ[None, None, kb], tSrK[None, None, kb, os], accS)
            warpgroup.commit_group()
            sig_new = grow_sigma(sigma, cute.arch.fmax(bounds[os, 0], bounds[os, 1]))
            warpgroup.wait_group(0)
            # ---- K's acc-fold per token column and the row's maximum ---------------------------------------------
            s = []
            mx = -Float32.inf
            for e in cutlass.range_constexpr(16):  # element e: token 8 (e // 2) + 2 quad + e % 2 of the row
                tok = 8 * (e // 2) + 2 * quad + e % 2
                x = (accS[first_row(e)] - cq) * table[os, tok, 0] + qsum * table[os, tok, 1]
                if tok >= nv:
                    x = -Float32.inf
                if cutlass.const_expr(cfg.step > 1):
                    if tok >= lim:
                        x = -Float32.inf
                s.append(x)
                mx = cute.arch.fmax(mx, x)
            for sh in cutlass.range_constexpr(2):
                mx = cute.arch.fmax(mx, cute.arch.shuffle_sync_bfly(mx, 1 << sh))
            # ---- the lazy rescale: the running maximum and the units move only when the tile asks -------------
            need = Int32(0)
            if mx > m + RESCALE_HEADROOM:
                need = Int32(1)
            if sig_new != sigma:
                need = Int32(1)
            if need != 0:
                m_new = cute.arch.fmax(m, mx)
                al = cute.math.exp2(m - nonempty_max(m_new), fastmath=True)
                f = al * (sigma * power_of_two_reciprocal(sig_new))
                for e in cutlass.range_constexpr(cute.size(accO) // 2):  # the row's elements (its first)
                    accO[first_row(e)] = accO[first_row(e)] * f
                lsum = lsum * al
                corr = corr * al
                m = m_new
                sigma = sig_new
            m_use = nonempty_max(m)
            inv = power_of_two_reciprocal(sigma)
            cs = [cfg.v_pivots[h] * sigma for h in range(2)]
            for e in cutlass.range_constexpr(16):
                h = (e // 2) % 2  # the token half of its k16 block (fragment.v_token_half)
                tok = 8 * (e // 2) + 2 * quad + e % 2
                vs = table[os, tok, 2]
                p = cute.math.exp2(s[e] - m_use, fastmath=True)
                lsum = lsum + p
                r = vs * inv
                if cutlass.const_expr((f0, f1)[h] != 1.0):
                    r = r * (f0, f1)[h]
                q = Float16(p * r)
                tOrP[first_row(e)] = q
                corr = corr + (p * table[os, tok, 3] - cs[h] * Float32(q))
            # ---- O += P' V ----------------------------------------------------------------------------------------
            warpgroup.fence()
            for kb in cutlass.range_constexpr(cute.size(tOrP, mode=[2])):
                cute.gemm(pv_mma, accO, tOrP[None, None, kb], tOrV[None, None, kb, os], accO)
            warpgroup.commit_group()
            warpgroup.wait_group(0)
            cute.arch.mbarrier_arrive(ops.empty + os)  # the slot is read: the producer may rebuild it
        self._rows_epilogue(thr, accO, m, sigma, lsum, corr, mOP, mLP, b, kvh, split * CONSUMERS + c, n_kvh,
                            thr_pv, i_row)

    @cute.jit
    def _rows_epilogue(self, thr: WarpgroupThread, accO: cute.Tensor, m, sigma, lsum, corr, mOP: cute.Tensor,
                       mLP: cute.Tensor, b, kvh, part, n_kvh, thr_pv, i_row):
        """The row's sums and offset corrections over its quad, then the partial output
        ``(acc sigma v_unit + corr) / sum`` and its LSE (base 2) into partial ``part``."""
        cfg = self.cfg
        for sh in cutlass.range_constexpr(2):
            lsum = lsum + cute.arch.shuffle_sync_bfly(lsum, 1 << sh)
            corr = corr + cute.arch.shuffle_sync_bfly(corr, 1 << sh)
        per = rows_per_warp(cfg)
        g = thr.lane // 4
        if g < per and i_row < cfg.rows:
            row = self.query_row(i_row, kvh, n_kvh)
            inv = Float32(0.0)
            if lsum != 0:  # a NaN sum is not empty: its output and LSE stay NaN
                inv = 1.0 / lsum
            unit = sigma * cfg.v_unit
            thr_c = thr_pv.partition_C(cute.make_identity_tensor((TILE, cfg.head_dim)))
            for e in cutlass.range_constexpr(cute.size(accO) // 2):
                _, ch = thr_c[first_row(e)]
                mOP[b, row, part, ch] = (accO[first_row(e)] * unit + corr) * inv
            if thr.quad == 0:
                lse = -Float32.inf
                if lsum != 0:
                    lse = nonempty_max(m) + cute.math.log2(lsum)
                mLP[b, row, part] = lse
