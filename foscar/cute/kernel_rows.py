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
from cutlass import BFloat16, Float16, Float32, Int32, Uint32
from cutlass.cute.nvgpu import OperandMajorMode, warpgroup
from cutlass.memory import SmemAllocator

from ..format import P_UNITS_START
from .config import CONSUMERS, RESCALE_HEADROOM, THREADS, TILE, Sm90Config, column_token, ws_registers
from .folds import grow_sigma, p_units_bound, power_of_two_reciprocal
from .kernel_v1 import FoldDecodeSm90WS, ring_phase, ring_slot
from .operands import build_k_registers, build_vt_registers
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
    channels) and V^T (channels x tokens), each K-major."""
    D = cfg.head_dim
    bf16 = warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.K_SW128, BFloat16)
    f16 = warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.K_SW128, Float16)
    return (cute.tile_to_shape(bf16, (TILE, D), (0, 1)), cute.tile_to_shape(bf16, (TILE, D), (0, 1)),
            cute.tile_to_shape(f16, (D, TILE), (0, 1)))


def rows_per_warp(cfg: Sm90Config) -> int:
    """Real rows of each warp's 16 M rows: ``cols / 4`` (8 at 32 columns, 4 at 16, 2 at 8)."""
    return cfg.cols // 4


def m_row(i: int, per: int) -> int:
    """The M row of query row ``i``."""
    return 16 * (i // per) + i % per


def first_row(e: int) -> int:
    """The accumulator (and A fragment) element of a thread's ``e``-th element of its first row: CuTe's ``m64nN``
    C fragment orders ``c + 2 r + 4 j`` (column ``8 j + 2 quad + c``, row ``+ 8 r``)."""
    return 4 * (e // 2) + e % 2


class RowsDecodeSm90(FoldDecodeSm90WS):
    """v1's producer with consumers that multiply ``S = Q K^T`` and ``O = P' V`` (module docstring)."""

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
            min_blocks_per_mp=self.ctas_per_sm, preferred_smem_carveout=100)

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
        sK = [alloc.allocate_tensor(BFloat16, sK_layout.outer, byte_alignment=1024, swizzle=sK_layout.inner)
              for _ in range(CONSUMERS)]
        sV = [alloc.allocate_tensor(Float16, sV_layout.outer, byte_alignment=1024, swizzle=sV_layout.inner)
              for _ in range(CONSUMERS)]
        if tidx == 0:
            for i in cutlass.range_constexpr(slots):
                cute.arch.mbarrier_init(ring.full + i, 1)
                cute.arch.mbarrier_init(ring.empty + i, THREADS)
        cute.arch.mbarrier_init_fence()
        n, t_lo, t_hi = self._split_tiles(mSEQ, b, split, n_splits)
        if role == 0:
            self._stage_q_rows(mQ, sQ, b, kvh, n_kvh, tidx)
        cute.arch.sync_threads()
        if role == 0:
            self._q_row_sums(sQ, sQsum, tidx)
        cute.arch.sync_threads()

        if role == 0:  # ---- producer: v1's -------------------------------------------------------------------
            cute.arch.setmaxregister_decrease(ws_registers(cfg, self.ctas_per_sm)[0])
            if tidx == 0:
                tma = ((atom_kc, tma_kc), (atom_vc, tma_vc), (atom_kp, tma_kp), (atom_vp, tma_vp))
                views = self._tma_views(tma, ring)
                for tile in cutlass.range(t_lo, t_hi, unroll=1):
                    self._issue_tile(tma, views, ring, mBT, b, kvh, t_lo, tile)
        for c in cutlass.range_constexpr(CONSUMERS):
            if role == c + 1:
                cute.arch.setmaxregister_increase(ws_registers(cfg, self.ctas_per_sm)[1])
                self._consume_rows(c, qk_mma, pv_mma, k_store, v_store, ring, sQ, sQsum, sK[c], sV[c], mOP, mLP,
                                   b, kvh, split, t_lo, t_hi, n, qk_scale, n_kvh)

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
    def _consume_rows(self, c: cutlass.Constexpr, qk_mma: cute.TiledMma, pv_mma: cute.TiledMma,
                      k_store: cute.TiledMma, v_store: cute.TiledMma, ring, sQ: cute.Tensor, sQsum: cute.Tensor,
                      sK: cute.Tensor, sV: cute.Tensor, mOP: cute.Tensor, mLP: cute.Tensor, b, kvh, split, t_lo,
                      t_hi, n, qk_scale: Float32, n_kvh):
        """Consumer warpgroup ``c``: tiles ``t_lo + c, t_lo + c + CONSUMERS, ...`` of the split, then its partial."""
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
        tSrK = thr_qk.make_fragment_B(thr_qk.partition_B(sK))
        accS = cute.make_rmem_tensor(thr_qk.partition_shape_C((TILE, TILE)), Float32)
        thr_pv = pv_mma.get_slice(ctid)
        tOrP = thr_pv.make_fragment_A(thr_pv.partition_shape_A((TILE, TILE)))
        tOrP.fill(0.0)  # the second row of each thread stays zero: padding
        tOrV = thr_pv.make_fragment_B(thr_pv.partition_B(sV))
        accO = cute.make_rmem_tensor(thr_pv.partition_shape_C((TILE, D)), Float32)
        accO.fill(0.0)
        thr_k = k_store.get_slice(ctid)
        tKr = thr_k.make_fragment_A(thr_k.partition_shape_A((TILE, D)))
        tKs = thr_k.partition_A(sK)
        thr_v = v_store.get_slice(ctid)
        tVr = thr_v.make_fragment_A(thr_v.partition_shape_A((D, TILE)))
        tVs = thr_v.partition_A(sV)
        kw = cute.make_rmem_tensor(cute.make_layout(cfg.k_words), Int32)
        vw = cute.make_rmem_tensor(cute.make_layout((cfg.mh, cfg.v_blocks)), Int32)
        regs = TileRegisters(kw, vw, None, None)

        op_scale = qk_scale * cfg.k_factors[0]
        f0, f1 = cfg.v_factors
        m = Float32(-Float32.inf)
        sigma = Float32(P_UNITS_START)
        lsum = Float32(0.0)
        corr = Float32(0.0)
        for tile in cutlass.range(t_lo + c, t_hi, CONSUMERS, unroll=1):
            k = (tile - t_lo) >> 1
            slot = ring_slot(c, k, cfg.stages)
            t0 = tile * TILE
            cute.arch.mbarrier_wait(ring.full + slot, ring_phase(k, cfg.stages))
            # ---- the tile's operands, built from its codes into shared memory ---------------------------------
            self._read_words(ring, slot, regs, thr)
            build_k_registers(cfg, cute.recast_tensor(tKr, Uint32), kw)
            cute.autovec_copy(tKr, tKs)
            build_vt_registers(cfg, cute.recast_tensor(tVr, Uint32), vw)
            cute.autovec_copy(tVr, tVs)
            cute.arch.fence_view_async_shared()
            cute.arch.barrier(barrier_id=thr.bar_id, number_of_threads=THREADS)
            # ---- S = Q K^T --------------------------------------------------------------------------------------
            accS.fill(0.0)
            warpgroup.fence()
            for kb in cutlass.range_constexpr(cute.size(tSrQ, mode=[2])):
                cute.gemm(qk_mma, accS, tSrQ[None, None, kb], tSrK[None, None, kb], accS)
            warpgroup.commit_group()
            warpgroup.wait_group(0)
            # ---- K's acc-fold per token column, the row's maximum and the tile's bound on the P' units ------
            s = []
            vpar = []
            mx = -Float32.inf
            ub = Float32(0.0)
            for e in cutlass.range_constexpr(16):  # element e: token 8 (e // 2) + 2 quad + e % 2 of the row
                tok = 8 * (e // 2) + 2 * quad + e % 2
                ks = ring.sKP[2 * tok, slot]
                kz = ring.sKP[2 * tok + 1, slot]
                vs = ring.sVP[2 * tok, slot]
                vz = ring.sVP[2 * tok + 1, slot]
                x = (accS[first_row(e)] - cq) * (ks * op_scale) + qsum * ((kz + cfg.k_mid * ks) * qk_scale)
                if t0 + tok >= n:  # past the sequence: no score, and no V (s', z') from whatever the page holds
                    x = -Float32.inf
                    vs = Float32(0.0)
                    vz = Float32(0.0)
                if cutlass.const_expr(cfg.step > 1):
                    if t0 + tok >= limit:
                        x = -Float32.inf
                s.append(x)
                vpar.append((vs, vz))
                mx = cute.arch.fmax(mx, x)
                ub = cute.arch.fmax(ub, p_units_bound(vs, vz))
            cute.arch.mbarrier_arrive(ring.empty + slot)  # the stage is read: the producer may refill it
            for sh in cutlass.range_constexpr(2):
                mx = cute.arch.fmax(mx, cute.arch.shuffle_sync_bfly(mx, 1 << sh))
                ub = cute.arch.fmax(ub, cute.arch.shuffle_sync_bfly(ub, 1 << sh))
            # ---- the lazy rescale: the running maximum and the units move only when the tile asks -------------
            sig_new = grow_sigma(sigma, ub)
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
                vs, vz = vpar[e]
                p = cute.math.exp2(s[e] - m_use, fastmath=True)
                lsum = lsum + p
                r = vs * inv
                if cutlass.const_expr((f0, f1)[h] != 1.0):
                    r = r * (f0, f1)[h]
                q = Float16(p * r)
                tOrP[first_row(e)] = q
                corr = corr + (p * (vz + cfg.v_mid * vs) - cs[h] * Float32(q))
            # ---- O += P' V ----------------------------------------------------------------------------------------
            warpgroup.fence()
            for kb in cutlass.range_constexpr(cute.size(tOrP, mode=[2])):
                cute.gemm(pv_mma, accO, tOrP[None, None, kb], tOrV[None, None, kb], accO)
            warpgroup.commit_group()
            warpgroup.wait_group(0)
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
