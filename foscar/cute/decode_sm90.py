"""Hopper (sm_90a) split-KV decode stage 1 in CuTe DSL (issue 4): every K/V axis combination with groups of
``g`` = 64 or 128 (a multiple of the 64-token tile; for a token-wise axis, ``g`` channels dividing the head
dim: one or two channel groups per token); INT2/INT4, head dim 64/128, up to 8 query heads per KV head,
paged caches.

Per 64-token KV tile, one warpgroup computes (:meth:`FoldDecodeSm90._tile_step`, shared by both
versions):

- ``S^T = K Q^T`` on ``wgmma.m64n8k16`` with A from registers: each thread builds its 32-bit A
  registers from the packed words of the cache (:mod:`foscar.cute.fragment`: one funnel shift and
  one ``lop3`` per register), Q^T (heads padded to 8) sits in shared memory;
- the acc-fold of token-wise K, centred on the pivot like :func:`foscar.decode_folded` (with two channel
  groups, one group-local partial each, scaled apart); channel-wise K:
  the operand-fold ``Q' = bf16(Q s')`` of the tile's token group, rebuilt in shared memory when the group
  changes, and the group's offset correction per head (:meth:`FoldDecodeSm90._fold_q`);
- online softmax (base 2) over the token axis: per column, shuffles across the lanes holding a
  column, then the four warps through shared memory;
- ``O^T = V^T P'^T``, FP16 operands: ``P' = P s'_V / sigma`` (``sigma`` the largest ``|s'_V|`` so far,
  a power of two) stored to shared memory as the B operand, V^T built in registers like K;
  the offset correction kept per element and folded into the accumulator every ``FLUSH`` tiles (with two
  channel groups: one ``P'``, ``sigma`` and correction per group, each group being one m64 half of V^T
  with its own B operand); channel-wise V: ``P~ = fp16(P)`` as the B operand, and the acc-fold of the tile's partial per channel
  (``s' (part - c sum P~) + mid sum P~``);
- the partial output and LSE, in the layout :mod:`foscar.triton.combine` merges.

v0 (:class:`FoldDecodeSm90`): one warpgroup per CTA (batch entry, KV head, KV split) loading the next
tile's words into registers while it computes one; four CTAs per SM. v1 (:class:`FoldDecodeSm90WS`): a
TMA producer warpgroup and two consumer warpgroups on alternating tiles, one or two CTAs per SM
(:data:`WS_REGISTERS`). Both are validated on the H200 for every combination above, clean under
compute-sanitizer, and compiled for TVM-FFI calls (:func:`compile_stage1`); measured in
``docs/results-h200.md``.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90
from cutlass import BFloat16, Float16, Float32, Int32, Int64, Uint32
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, warpgroup
from cutlass.cute.runtime import make_fake_stream
from cutlass.memory import SmemAllocator

from ..format import K_BLOCK_TOKENS, v_block_tokens, words_per_block

TILE = 64  # tokens per KV tile (wgmma M of S^T)
HEADS = 8  # query heads of one KV head, padded (wgmma N)
THREADS = 128
LOP_AND_OR = 0xEA  # lop3 LUT: (a & b) | c
FLUSH = 8
RED_SLOTS = 16  # per warp: 8 column maxima, the |s'_V| maximum, padding


@dataclass(frozen=True)
class Sm90Config:
    """Static configuration of one compiled kernel (the compile-cache key)."""

    bits: int
    head_dim: int
    page: int
    group: int  # the query heads of one KV head (G <= 8)
    k_pattern: int  # injection of K: BF16 bits PATTERN | q << K_SHL = q + beta_K
    k_shl: int
    k_pivot: float
    k_mid: float  # mid = z' + K_MID * s': the group's middle value
    v_pattern: int  # injection of V (FP16)
    v_shl: int
    v_pivot: float
    v_mid: float
    sink: int = 0  # the format's BF16 windows: the kernel derives each sequence's quantized length
    recent: int = 0
    k_channel: bool = False  # channel-wise K groups of `group_size` tokens (operand-fold into Q)
    group_size: int = 0
    v_channel: bool = False  # channel-wise V groups (acc-fold of each tile's PV partial)

    @property
    def kc(self) -> int:  # channel groups of a token-wise K (1 when channel-wise)
        return 1 if self.k_channel else self.head_dim // self.group_size

    @property
    def vc(self) -> int:  # channel groups of a token-wise V
        return 1 if self.v_channel else self.head_dim // self.group_size

    @property
    def par_words(self) -> int:  # per-thread (s', z') registers of a tile: K's, then V's (at 4 * kc)
        return 4 * self.kc + 4 * self.vc

    @property
    def flush(self) -> int:  # tokens quantized together (KVFormat.flush)
        return self.group_size if (self.k_channel or self.v_channel) else 1

    @property
    def v_param_words(self) -> int:
        return 2 * self.head_dim if self.v_channel else 2 * TILE * self.vc

    @property
    def v_param_rows(self) -> int:
        return max(1, self.page // self.group_size) if self.v_channel else self.page // TILE

    @property
    def acc_elems(self) -> int:  # O^T accumulator elements per thread
        return self.head_dim * HEADS // THREADS

    @property
    def k_param_words(self) -> int:  # floats of a tile's K (s', z'): per token and channel group, or the group's row
        return 2 * self.head_dim if self.k_channel else 2 * TILE * self.kc

    @property
    def k_param_rows(self) -> int:  # rows of K (s', z') per page: tiles, or token groups (at least one)
        return max(1, self.page // self.group_size) if self.k_channel else self.page // TILE

    @cute.jit
    def quantized_length(self, L):
        """``n_quant`` of a sequence of ``L`` tokens, as :meth:`foscar.KVFormat.split_length` computes it."""
        rest = L - cutlass.min(L, self.sink) - self.recent
        return cutlass.max(rest, 0) // self.flush * self.flush

    @property
    def k_words(self) -> int:  # per thread per tile
        return self.head_dim * self.bits // 64

    @property
    def tile_words(self) -> int:  # packed words of one tensor's 64-token tile (one KV head)
        return TILE * self.head_dim * self.bits // 32

    @property
    def v_blocks(self) -> int:  # V pack blocks per tile
        return TILE // v_block_tokens(self.bits)

    @property
    def mh(self) -> int:  # m64 halves of the head dim (V^T rows)
        return self.head_dim // 64


def _inject(w: Uint32, field: int, shl: int, bits: int, pattern: int) -> Uint32:
    """Two operands ``pattern | q << shl`` from the codes at bits ``field`` and ``field + 16`` of ``w``."""
    rot = (field - shl) % 32
    x = cute.arch.shf(w, w, rot, "r") if rot else w
    mask = (((1 << bits) - 1) << shl) * 0x00010001
    return cute.arch.lop3(x, Uint32(mask), Uint32(pattern * 0x00010001), LOP_AND_OR)


class FoldDecodeSm90:
    def __init__(self, cfg: Sm90Config):
        self.cfg = cfg

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mKC: cute.Tensor, mVC: cute.Tensor, mKP: cute.Tensor, mVP: cute.Tensor,
                 mBT: cute.Tensor, mSEQ: cute.Tensor, mOP: cute.Tensor, mLP: cute.Tensor, qk_scale: Float32,
                 num_splits: Int32, stream: cuda.CUstream):
        """Stage 1 over ``num_splits`` KV splits, launched on ``stream`` (torch's current stream: CUDA
        graphs capture it); ``mOP``/``mLP`` may hold more partials (the BF16 windows', written by another
        kernel)."""
        qk_mma, pv_mma, sQ_layout, sP_layout = self._mmas_and_layouts()
        batch = cute.size(mQ, mode=[0])
        kv_heads = cute.size(mKC, mode=[1])
        self.kernel(qk_mma, pv_mma, sQ_layout, sP_layout, mQ, mKC, mVC, mKP, mVP, mBT, mSEQ, mOP, mLP,
                    qk_scale).launch(grid=(kv_heads, batch, num_splits), block=(THREADS, 1, 1), stream=stream)

    @cute.kernel
    def kernel(self, qk_mma: cute.TiledMma, pv_mma: cute.TiledMma, sQ_layout: cute.ComposedLayout,
               sP_layout: cute.ComposedLayout, mQ: cute.Tensor, mKC: cute.Tensor, mVC: cute.Tensor,
               mKP: cute.Tensor, mVP: cute.Tensor, mBT: cute.Tensor, mSEQ: cute.Tensor, mOP: cute.Tensor,
               mLP: cute.Tensor, qk_scale: Float32):
        cfg = self.cfg
        D = cfg.head_dim
        tidx, _, _ = cute.arch.thread_idx()
        kvh, b, split = cute.arch.block_idx()
        n_splits = cute.arch.grid_dim()[2]
        warp = tidx // 32
        lane = tidx % 32
        quad = lane % 4  # this thread's head columns: 2*quad, 2*quad + 1
        row0 = 16 * warp + lane // 4  # this thread's token rows in a tile: row0, row0 + 8

        smem = SmemAllocator()
        sQ = smem.allocate_tensor(BFloat16, sQ_layout.outer, byte_alignment=1024, swizzle=sQ_layout.inner)
        sP = smem.allocate_tensor(Float16, sP_layout.outer, byte_alignment=1024, swizzle=sP_layout.inner)
        sP2 = sP  # token-wise V with two channel groups: the second group's P' (its own buffer then)
        if cutlass.const_expr(cfg.vc == 2):
            sP2 = smem.allocate_tensor(Float16, sP_layout.outer, byte_alignment=1024, swizzle=sP_layout.inner)
        sRed = smem.allocate_tensor(Float32, cute.make_layout((2, 4, RED_SLOTS)), byte_alignment=16)
        sSum = smem.allocate_tensor(Float32, cute.make_layout((4, HEADS)), byte_alignment=16)
        sQsum = smem.allocate_tensor(Float32, cute.make_layout((HEADS, cfg.kc)), byte_alignment=16)
        sQk = smem.allocate_tensor(BFloat16, sQ_layout.outer, byte_alignment=1024, swizzle=sQ_layout.inner)  # Q s'
        sKr = smem.allocate_tensor(Float32, cute.make_layout((4, HEADS)), byte_alignment=16)
        sKf = smem.allocate_tensor(Float32, cute.make_layout(HEADS), byte_alignment=16)

        # ---- Q^T (heads padded with zeros) and sum(Q) of the BF16 operand --------------------------
        self._load_q(mQ, sQ, b, kvh, tidx)
        cute.arch.sync_threads()
        self._q_sums(sQ, sQsum, tidx)
        cute.arch.fence_view_async_shared()
        cute.arch.sync_threads()
        qsum0 = sQsum[2 * quad]
        qsum1 = sQsum[2 * quad + 1]

        # ---- the split's tiles ------------------------------------------------------------------------
        n, t_lo, t_hi = self._split_tiles(mSEQ, b, split, n_splits)

        (thr_pv, tSrK, tSrK_u32, tSrQ, tSrQk, accS, tOrV, tOrV_u32, tOrP, tOrP2, accO, kw, vw, l_el, c_el,
         c_el2) = self._warpgroup_state(qk_mma, pv_mma, sQ, sQk, sP, sP2, tidx)
        m0 = -Float32.inf
        m1 = -Float32.inf
        sigma = Float32(1.0)
        sigma2 = Float32(1.0)
        kgroup = Int32(-1)  # channel-wise K: the token group whose Q' sits in sQk

        # software pipeline: tile i+1's words and parameters are loaded (into the *_n registers) before
        # tile i is computed, so their latency hides behind its math
        kw_n = cute.make_rmem_tensor(cute.make_layout(cfg.k_words), Int32)
        vw_n = cute.make_rmem_tensor(cute.make_layout((cfg.mh, cfg.v_blocks)), Int32)
        par = cute.make_rmem_tensor(cute.make_layout(cfg.par_words), Float32)  # K's (s', z'), then V's
        par_n = cute.make_rmem_tensor(cute.make_layout(cfg.par_words), Float32)
        vpar = cute.make_rmem_tensor(cute.make_layout(2 * cfg.acc_elems), Float32)  # channel-wise V
        vpar_n = cute.make_rmem_tensor(cute.make_layout(2 * cfg.acc_elems), Float32)
        thr_c = thr_pv.partition_C(cute.make_identity_tensor((D, HEADS)))
        if t_lo < t_hi:
            self._load_tile(mKC, mVC, mKP, mVP, mBT, b, kvh, t_lo, kw_n, vw_n, par_n, vpar_n, thr_c, warp, lane,
                            tidx, row0)
        qk_mma.set(warpgroup.Field.ACCUMULATE, True)
        pv_mma.set(warpgroup.Field.ACCUMULATE, True)
        for tile in cutlass.range(t_lo, t_hi, unroll=1):
            t0 = tile * TILE
            for i in cutlass.range_constexpr(cfg.k_words):
                kw[i] = kw_n[i]
            for vb in cutlass.range_constexpr(cfg.v_blocks):
                for mh in cutlass.range_constexpr(cfg.mh):
                    vw[mh, vb] = vw_n[mh, vb]
            for i in cutlass.range_constexpr(cfg.par_words):
                par[i] = par_n[i]
            if cutlass.const_expr(cfg.v_channel):
                for i in cutlass.range_constexpr(2 * cfg.acc_elems):
                    vpar[i] = vpar_n[i]
            if tile + 1 < t_hi:
                self._load_tile(mKC, mVC, mKP, mVP, mBT, b, kvh, tile + 1, kw_n, vw_n, par_n, vpar_n, thr_c, warp,
                                lane, tidx, row0)
            m0, m1, sigma, sigma2, kgroup = self._tile_step(
                tile, t0, t_lo, n, kw, vw, par, vpar, m0, m1, sigma, sigma2, kgroup, qk_mma, pv_mma, c_el2, tOrP2,
                tSrK, tSrK_u32, tSrQ, tSrQk, accS, tOrV, tOrV_u32, tOrP, accO, l_el, c_el, sRed, sSum, sP, sP2, sQ,
                sQk, sKr, sKf, sQsum, qsum0, qsum1, qk_scale, tidx, warp, lane, quad, row0, 1)

        self._epilogue(c_el, c_el2, accO, l_el, sSum, sigma, sigma2, m0, m1, thr_pv, mOP, mLP, b, kvh, split, warp, lane,
                       quad, 1)

    def _mmas_and_layouts(self):
        """Host side, both versions: the register-A tiled MMAs of ``S^T = K Q^T`` (BF16) and ``O^T = V^T P^T``
        (FP16), and the swizzled shared-memory layouts of Q^T and P^T."""
        qk_mma = sm90.make_trivial_tiled_mma(BFloat16, BFloat16, OperandMajorMode.K, OperandMajorMode.K, Float32,
                                             (1, 1, 1), (TILE, HEADS), warpgroup.OperandSource.RMEM)
        pv_mma = sm90.make_trivial_tiled_mma(Float16, Float16, OperandMajorMode.K, OperandMajorMode.K, Float32,
                                             (1, 1, 1), (TILE, HEADS), warpgroup.OperandSource.RMEM)
        q_atom = warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.K_SW128, BFloat16)
        sQ_layout = cute.tile_to_shape(q_atom, (HEADS, self.cfg.head_dim), (0, 1))
        p_atom = warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.K_SW128, Float16)
        sP_layout = cute.tile_to_shape(p_atom, (HEADS, TILE), (0, 1))
        return qk_mma, pv_mma, sQ_layout, sP_layout

    @cute.jit
    def _load_q(self, mQ: cute.Tensor, sQ: cute.Tensor, b, kvh, tidx):
        """Q^T of KV head ``kvh``'s query heads into shared memory (padded heads zero), by one warpgroup."""
        cfg = self.cfg
        D = cfg.head_dim
        G = cfg.group
        for h in cutlass.range_constexpr(HEADS):
            for d0 in cutlass.range_constexpr(D // THREADS if D >= THREADS else 1):
                d = d0 * THREADS + tidx
                if d < D:
                    val = BFloat16(0.0)
                    if h < G:
                        val = mQ[b, kvh * G + h, d]
                    sQ[h, d] = val

    @cute.jit
    def _split_tiles(self, mSEQ: cute.Tensor, b, split, n_splits):
        """``(n_quant, t_lo, t_hi)``: the quantized length of sequence ``b`` and the KV tiles of ``split``."""
        n = self.cfg.quantized_length(mSEQ[b])
        n_tiles = (n + TILE - 1) // TILE
        per = (n_tiles + n_splits - 1) // n_splits
        t_lo = split * per
        t_hi = cutlass.min(t_lo + per, n_tiles)
        return n, t_lo, t_hi

    def _warpgroup_state(self, qk_mma, pv_mma, sQ, sQk, sP, sP2, wtid):
        """One computing warpgroup's MMA fragments (thread ``wtid`` of it) and zeroed per-element state:
        ``(thr_pv, tSrK, tSrK_u32, tSrQ, tSrQk, accS, tOrV, tOrV_u32, tOrP, tOrP2, accO, kw, vw, l_el, c_el,
        c_el2)``."""
        cfg = self.cfg
        D = cfg.head_dim
        thr_qk = qk_mma.get_slice(wtid)
        tSrK = thr_qk.make_fragment_A(thr_qk.partition_shape_A((TILE, D)))
        tSrK_u32 = cute.recast_tensor(tSrK, Uint32)
        tSrQ = thr_qk.make_fragment_B(thr_qk.partition_B(sQ))
        tSrQk = thr_qk.make_fragment_B(thr_qk.partition_B(sQk))
        accS = cute.make_rmem_tensor(thr_qk.partition_shape_C((TILE, HEADS)), Float32)
        thr_pv = pv_mma.get_slice(wtid)
        tOrV = thr_pv.make_fragment_A(thr_pv.partition_shape_A((D, TILE)))
        tOrV_u32 = cute.recast_tensor(tOrV, Uint32)
        tOrP = thr_pv.make_fragment_B(thr_pv.partition_B(sP))
        tOrP2 = thr_pv.make_fragment_B(thr_pv.partition_B(sP2))
        accO = cute.make_rmem_tensor(thr_pv.partition_shape_C((D, HEADS)), Float32)
        accO.fill(0.0)
        kw = cute.make_rmem_tensor(cute.make_layout(cfg.k_words), Int32)
        vw = cute.make_rmem_tensor(cute.make_layout((cfg.mh, cfg.v_blocks)), Int32)
        l_el = cute.make_rmem_tensor(cute.make_layout(4), Float32)
        c_el = cute.make_rmem_tensor(cute.make_layout(4), Float32)
        c_el2 = cute.make_rmem_tensor(cute.make_layout(4), Float32)  # token-wise V, second channel group
        l_el.fill(0.0)
        c_el.fill(0.0)
        c_el2.fill(0.0)
        return thr_pv, tSrK, tSrK_u32, tSrQ, tSrQk, accS, tOrV, tOrV_u32, tOrP, tOrP2, accO, kw, vw, l_el, c_el, c_el2

    @cute.jit
    def _epilogue(self, c_el: cute.Tensor, c_el2: cute.Tensor, accO: cute.Tensor, l_el: cute.Tensor,
                  sSum: cute.Tensor, sigma: Float32, sigma2: Float32, m0: Float32, m1: Float32, thr_pv,
                  mOP: cute.Tensor, mLP: cute.Tensor, b, kvh, split, warp, lane, quad, bar_id: cutlass.Constexpr):
        """The last corrections, then the partial output ``acc / l`` and LSE (base 2) of one warpgroup's tiles
        into partial slot ``split`` (token-wise V with two channel groups: ``c_el2``, ``sigma2`` are the
        second group's)."""
        cfg = self.cfg
        D = cfg.head_dim
        G = cfg.group
        if cutlass.const_expr(cfg.vc == 2):
            self._flush(c_el, accO, sSum, sigma, warp, lane, quad, bar_id, 0)
            self._flush(c_el2, accO, sSum, sigma2, warp, lane, quad, bar_id, 1)
        else:
            self._flush(c_el, accO, sSum, sigma, warp, lane, quad, bar_id)
        l0, l1 = self._column_sums(l_el, sSum, warp, lane, quad, bar_id)
        # ---- the split's partial output and LSE (base 2) ---------------------------------------------------
        inv0 = Float32(0.0)
        inv1 = Float32(0.0)
        top = Float32(1.0) if cfg.vc == 2 else sigma  # two groups: each element takes its group's sigma below
        if l0 != 0:  # a NaN sum is not empty: its output and LSE stay NaN, never a dropped partial
            inv0 = top / l0
        if l1 != 0:
            inv1 = top / l1
        thr_c = thr_pv.partition_C(cute.make_identity_tensor((D, HEADS)))
        for e in cutlass.range_constexpr(cute.size(accO)):
            ch, h = thr_c[e]
            if h < G:
                if cutlass.const_expr(cfg.vc == 2):
                    mOP[b, kvh * G + h, split, ch] = (accO[e] * (sigma if e // 4 == 0 else sigma2)
                                                      * (inv0 if e % 2 == 0 else inv1))
                else:
                    mOP[b, kvh * G + h, split, ch] = accO[e] * (inv0 if e % 2 == 0 else inv1)
        if warp == 0 and lane < 4:
            lse0 = -Float32.inf
            lse1 = -Float32.inf
            if l0 != 0:
                lse0 = m0 + cute.math.log2(l0)
            if l1 != 0:
                lse1 = m1 + cute.math.log2(l1)
            if 2 * quad < G:
                mLP[b, kvh * G + 2 * quad, split] = lse0
            if 2 * quad + 1 < G:
                mLP[b, kvh * G + 2 * quad + 1, split] = lse1

    @cute.jit
    def _tile_step(self, tile, t0, t_lo, n, kw: cute.Tensor, vw: cute.Tensor, par: cute.Tensor, vpar: cute.Tensor,
                   m0: Float32,
                   m1: Float32, sigma: Float32, sigma2: Float32, kgroup: Int32, qk_mma: cute.TiledMma,
                   pv_mma: cute.TiledMma, c_el2: cute.Tensor, tOrP2: cute.Tensor,
                   tSrK: cute.Tensor, tSrK_u32: cute.Tensor, tSrQ: cute.Tensor, tSrQk: cute.Tensor, accS: cute.Tensor,
                   tOrV: cute.Tensor, tOrV_u32: cute.Tensor, tOrP: cute.Tensor, accO: cute.Tensor, l_el: cute.Tensor,
                   c_el: cute.Tensor, sRed: cute.Tensor, sSum: cute.Tensor, sP: cute.Tensor, sP2: cute.Tensor,
                   sQ: cute.Tensor,
                   sQk: cute.Tensor, sKr: cute.Tensor, sKf: cute.Tensor, sQsum: cute.Tensor, qsum0: Float32,
                   qsum1: Float32, qk_scale: Float32, ctid, warp, lane, quad, row0, bar_id: cutlass.Constexpr):
        """One KV tile for one warpgroup, from its packed words and ``(s', z')`` in registers (``kw``, ``vw``,
        ``par``): S^T = K Q^T with the acc-fold of token-wise K (or, channel-wise, the operand-fold
        ``Q' = Q s'`` of the tile's token group, rebuilt in ``sQk`` when the group changes, ``kgroup``),
        the online softmax (state ``m0, m1`` and ``l_el`` per element), P' = P s'_V / sigma to shared
        memory, O^T += V^T P'^T, and the offset corrections per element, folded into ``accO`` every
        ``FLUSH`` tiles; channel-wise V: the acc-fold of the tile's PV partial per channel, from ``vpar``
        (the group's ``(s', z')`` of this thread's accumulator channels). Returns ``(m0, m1, sigma,
        kgroup)``. ``bar_id``: the warpgroup's named barrier."""
        cfg = self.cfg
        per_word = 16 // cfg.bits
        nib = 4 // cfg.bits
        ks0, kz0, ks1, kz1 = par[0], par[1], par[2], par[3]
        vo = 4 * cfg.kc  # V's (s', z') after K's: row r, group c at vo + (r * vc + c) * 2
        vs0, vz0, vs1, vz1 = par[vo], par[vo + 1], par[vo + 2 * cfg.vc], par[vo + 2 * cfg.vc + 1]
        valid0 = t0 + row0 < n
        valid1 = t0 + row0 + 8 < n
        if not valid0:  # rows past the length: whatever the page holds there must not reach P'
            vs0 = Float32(0.0)
            vz0 = Float32(0.0)
        if not valid1:
            vs1 = Float32(0.0)
            vz1 = Float32(0.0)
        if cutlass.const_expr(cfg.vc == 2):  # token-wise V, the second channel group's (s', z') of both rows
            ws0 = par[vo + 2]
            wz0 = par[vo + 3]
            ws1 = par[vo + 6]
            wz1 = par[vo + 7]
            if not valid0:
                ws0 = Float32(0.0)
                wz0 = Float32(0.0)
            if not valid1:
                ws1 = Float32(0.0)
                wz1 = Float32(0.0)
        # ---- S^T = K Q^T: K built in registers -------------------------------------------------------
        for r in cutlass.range_constexpr(cute.size(tSrK_u32)):
            w = Uint32(kw[r // per_word])
            tSrK_u32[r] = _inject(w, cfg.bits * (r % per_word), cfg.k_shl, cfg.bits, cfg.k_pattern)
        if cutlass.const_expr(cfg.k_channel):  # operand-fold: Q' = bf16(Q s') of this token group
            grp = t0 // cfg.group_size
            if grp != kgroup:
                self._fold_q(sQ, sQk, sKr, sKf, ks0, kz0, ctid, warp, lane, bar_id)
                kgroup = grp
        accS.fill(0.0)  # the MMAs accumulate (ACCUMULATE is set once, by the caller: no state set in here)
        if cutlass.const_expr(cfg.kc == 2):  # token-wise K, 2 channel groups: the second group's partial
            accS2 = cute.make_rmem_tensor(accS.layout, Float32)
            accS2.fill(0.0)
        warpgroup.fence()
        n_kb = cute.size(tSrK, mode=[2])
        for kb in cutlass.range_constexpr(n_kb):
            if cutlass.const_expr(cfg.k_channel):
                cute.gemm(qk_mma, accS, tSrK[None, None, kb], tSrQk[None, None, kb], accS)
            elif cutlass.const_expr(cfg.kc == 2 and kb >= n_kb // 2):  # group-local partials: one per group
                cute.gemm(qk_mma, accS2, tSrK[None, None, kb], tSrQ[None, None, kb], accS2)
            else:
                cute.gemm(qk_mma, accS, tSrK[None, None, kb], tSrQ[None, None, kb], accS)
        warpgroup.commit_group()
        warpgroup.wait_group(0)
        # accS element e: column 2*quad + e % 2, row row0 + 8 * (e // 2)
        if cutlass.const_expr(cfg.k_channel):  # Q' y + the group's correction, then the softmax scale
            kc0 = sKf[2 * quad]
            kc1 = sKf[2 * quad + 1]
            s00 = (accS[0] + kc0) * qk_scale
            s01 = (accS[1] + kc1) * qk_scale
            s10 = (accS[2] + kc0) * qk_scale
            s11 = (accS[3] + kc1) * qk_scale
        elif cutlass.const_expr(cfg.kc == 2):  # acc-fold per channel group: each group-local partial scaled
            s00 = Float32(0.0)
            s01 = Float32(0.0)
            s10 = Float32(0.0)
            s11 = Float32(0.0)
            for c in cutlass.range_constexpr(2):
                acc_c = accS if c == 0 else accS2
                q0 = sQsum[2 * quad, c]
                q1 = sQsum[2 * quad + 1, c]
                ka0 = par[c * 2] * qk_scale  # row 0: (s', z') at (0 * kc + c) * 2
                ka1 = par[(2 + c) * 2] * qk_scale  # row 1
                ke0 = (par[c * 2 + 1] + cfg.k_mid * par[c * 2]) * qk_scale
                ke1 = (par[(2 + c) * 2 + 1] + cfg.k_mid * par[(2 + c) * 2]) * qk_scale
                s00 = s00 + (acc_c[0] - cfg.k_pivot * q0) * ka0 + q0 * ke0
                s01 = s01 + (acc_c[1] - cfg.k_pivot * q1) * ka0 + q1 * ke0
                s10 = s10 + (acc_c[2] - cfg.k_pivot * q0) * ka1 + q0 * ke1
                s11 = s11 + (acc_c[3] - cfg.k_pivot * q1) * ka1 + q1 * ke1
        else:  # acc-fold of token-wise K, centred: s' (part - c sum Q) + mid sum Q (scaled)
            a0 = ks0 * qk_scale
            a1 = ks1 * qk_scale
            e0 = (kz0 + cfg.k_mid * ks0) * qk_scale
            e1 = (kz1 + cfg.k_mid * ks1) * qk_scale
            s00 = (accS[0] - cfg.k_pivot * qsum0) * a0 + qsum0 * e0
            s01 = (accS[1] - cfg.k_pivot * qsum1) * a0 + qsum1 * e0
            s10 = (accS[2] - cfg.k_pivot * qsum0) * a1 + qsum0 * e1
            s11 = (accS[3] - cfg.k_pivot * qsum1) * a1 + qsum1 * e1
        if not valid0:
            s00 = -Float32.inf
            s01 = -Float32.inf
        if not valid1:
            s10 = -Float32.inf
            s11 = -Float32.inf
        # ---- column maxima and the tile's largest |s'_V|: lanes, then warps --------------------------
        mx0 = cute.arch.fmax(s00, s10)
        mx1 = cute.arch.fmax(s01, s11)
        vmx = cute.arch.fmax(cute.arch.fmax(vs0, -vs0), cute.arch.fmax(vs1, -vs1))
        for sh in cutlass.range_constexpr(3):
            mx0 = cute.arch.fmax(mx0, cute.arch.shuffle_sync_bfly(mx0, 4 << sh))
            mx1 = cute.arch.fmax(mx1, cute.arch.shuffle_sync_bfly(mx1, 4 << sh))
            vmx = cute.arch.fmax(vmx, cute.arch.shuffle_sync_bfly(vmx, 4 << sh))
        vmx = cute.arch.fmax(vmx, cute.arch.shuffle_sync_bfly(vmx, 1))
        vmx = cute.arch.fmax(vmx, cute.arch.shuffle_sync_bfly(vmx, 2))
        if cutlass.const_expr(cfg.vc == 2):
            wmx = cute.arch.fmax(cute.arch.fmax(ws0, -ws0), cute.arch.fmax(ws1, -ws1))
            for sh in cutlass.range_constexpr(5):
                wmx = cute.arch.fmax(wmx, cute.arch.shuffle_sync_bfly(wmx, 16 >> sh))
        buf = tile % 2
        if lane < 4:
            sRed[buf, warp, 2 * lane] = mx0
            sRed[buf, warp, 2 * lane + 1] = mx1
        if lane == 0:
            sRed[buf, warp, HEADS] = vmx
            if cutlass.const_expr(cfg.vc == 2):
                sRed[buf, warp, HEADS + 1] = wmx
        cute.arch.barrier(barrier_id=bar_id, number_of_threads=THREADS)
        tm0 = sRed[buf, 0, 2 * quad]
        tm1 = sRed[buf, 0, 2 * quad + 1]
        tv = sRed[buf, 0, HEADS]
        for wi in cutlass.range_constexpr(1, 4):
            tm0 = cute.arch.fmax(tm0, sRed[buf, wi, 2 * quad])
            tm1 = cute.arch.fmax(tm1, sRed[buf, wi, 2 * quad + 1])
            tv = cute.arch.fmax(tv, sRed[buf, wi, HEADS])
        mn0 = cute.arch.fmax(m0, tm0)
        mn1 = cute.arch.fmax(m1, tm1)
        al0 = cute.math.exp2(m0 - mn0, fastmath=True)
        al1 = cute.math.exp2(m1 - mn1, fastmath=True)
        m0 = mn0
        m1 = mn1
        # sigma: a power of two >= every |s'_V| so far (P <= 1 keeps P' = P s'/sigma within FP16)
        sig_new = sigma
        while sig_new < tv:
            sig_new = sig_new * 2.0
        sig_new2 = sigma2
        if cutlass.const_expr(cfg.vc == 2):  # the second group's sigma
            tv2 = sRed[buf, 0, HEADS + 1]
            for wi in cutlass.range_constexpr(1, 4):
                tv2 = cute.arch.fmax(tv2, sRed[buf, wi, HEADS + 1])
            while sig_new2 < tv2:
                sig_new2 = sig_new2 * 2.0
        p00 = cute.math.exp2(s00 - mn0, fastmath=True)
        p01 = cute.math.exp2(s01 - mn1, fastmath=True)
        p10 = cute.math.exp2(s10 - mn0, fastmath=True)
        p11 = cute.math.exp2(s11 - mn1, fastmath=True)
        l_el[0] = l_el[0] * al0 + p00
        l_el[1] = l_el[1] * al1 + p01
        l_el[2] = l_el[2] * al0 + p10
        l_el[3] = l_el[3] * al1 + p11
        if cutlass.const_expr(cfg.v_channel):
            # ---- acc-fold of channel-wise V (one token group per tile): P~ = fp16(P) is the B operand; the
            # tile's partial V^T P~^T, centred, is scaled per channel: s' (part - c sum P~) + mid sum P~
            q00 = Float16(p00)
            q01 = Float16(p01)
            q10 = Float16(p10)
            q11 = Float16(p11)
            sP[2 * quad, row0] = q00
            sP[2 * quad + 1, row0] = q01
            sP[2 * quad, row0 + 8] = q10
            sP[2 * quad + 1, row0 + 8] = q11
            ps0 = Float32(q00) + Float32(q10)  # column sums of the P~ the MMA consumes
            ps1 = Float32(q01) + Float32(q11)
            for sh in cutlass.range_constexpr(3):
                ps0 = ps0 + cute.arch.shuffle_sync_bfly(ps0, 4 << sh)
                ps1 = ps1 + cute.arch.shuffle_sync_bfly(ps1, 4 << sh)
            if lane < 4:
                sRed[buf, warp, HEADS + 2 * lane] = ps0
                sRed[buf, warp, HEADS + 2 * lane + 1] = ps1
            cute.arch.fence_view_async_shared()
            cute.arch.barrier(barrier_id=bar_id, number_of_threads=THREADS)
            psum0 = sRed[buf, 0, HEADS + 2 * quad]
            psum1 = sRed[buf, 0, HEADS + 2 * quad + 1]
            for wi in cutlass.range_constexpr(1, 4):
                psum0 = psum0 + sRed[buf, wi, HEADS + 2 * quad]
                psum1 = psum1 + sRed[buf, wi, HEADS + 2 * quad + 1]
            for r in cutlass.range_constexpr(cute.size(tOrV_u32)):
                j = r % 4
                mk = r // 4
                mh = mk % cfg.mh
                kb = mk // cfg.mh
                w = Uint32(vw[mh, kb // nib])
                tOrV_u32[r] = _inject(w, cfg.bits * (4 * (kb % nib) + j), cfg.v_shl, cfg.bits, cfg.v_pattern)
            accT = cute.make_rmem_tensor(accO.layout, Float32)
            accT.fill(0.0)
            warpgroup.fence()
            for kb in cutlass.range_constexpr(cute.size(tOrV, mode=[2])):
                cute.gemm(pv_mma, accT, tOrV[None, None, kb], tOrP[None, None, kb], accT)
            warpgroup.commit_group()
            warpgroup.wait_group(0)
            for e in cutlass.range_constexpr(cute.size(accO)):
                ps = psum0 if e % 2 == 0 else psum1
                vs_e = vpar[2 * e]
                accO[e] = (accO[e] * (al0 if e % 2 == 0 else al1) + (accT[e] - cfg.v_pivot * ps) * vs_e
                           + ps * (vpar[2 * e + 1] + cfg.v_mid * vs_e))
        elif cutlass.const_expr(cfg.vc == 2):
            # ---- token-wise V, two channel groups (the two m64 halves of V^T): P'_c = P s'_V[c] / sigma_c per
            # group, each the B operand of its half; corrections per element and group ------------------
            r0 = vs0 / sig_new
            r1 = vs1 / sig_new
            w0 = ws0 / sig_new2
            w1 = ws1 / sig_new2
            q00 = Float16(p00 * r0)
            q01 = Float16(p01 * r0)
            q10 = Float16(p10 * r1)
            q11 = Float16(p11 * r1)
            u00 = Float16(p00 * w0)
            u01 = Float16(p01 * w0)
            u10 = Float16(p10 * w1)
            u11 = Float16(p11 * w1)
            vm0 = vz0 + cfg.v_mid * vs0
            vm1 = vz1 + cfg.v_mid * vs1
            wm0 = wz0 + cfg.v_mid * ws0
            wm1 = wz1 + cfg.v_mid * ws1
            cs = cfg.v_pivot * sig_new
            cs2 = cfg.v_pivot * sig_new2
            c_el[0] = c_el[0] * al0 + (p00 * vm0 - cs * Float32(q00))
            c_el[1] = c_el[1] * al1 + (p01 * vm0 - cs * Float32(q01))
            c_el[2] = c_el[2] * al0 + (p10 * vm1 - cs * Float32(q10))
            c_el[3] = c_el[3] * al1 + (p11 * vm1 - cs * Float32(q11))
            c_el2[0] = c_el2[0] * al0 + (p00 * wm0 - cs2 * Float32(u00))
            c_el2[1] = c_el2[1] * al1 + (p01 * wm0 - cs2 * Float32(u01))
            c_el2[2] = c_el2[2] * al0 + (p10 * wm1 - cs2 * Float32(u10))
            c_el2[3] = c_el2[3] * al1 + (p11 * wm1 - cs2 * Float32(u11))
            sP[2 * quad, row0] = q00
            sP[2 * quad + 1, row0] = q01
            sP[2 * quad, row0 + 8] = q10
            sP[2 * quad + 1, row0 + 8] = q11
            sP2[2 * quad, row0] = u00
            sP2[2 * quad + 1, row0] = u01
            sP2[2 * quad, row0 + 8] = u10
            sP2[2 * quad + 1, row0 + 8] = u11
            cute.arch.fence_view_async_shared()
            cute.arch.barrier(barrier_id=bar_id, number_of_threads=THREADS)
            ratio = sigma / sig_new
            ratio2 = sigma2 / sig_new2
            for e in cutlass.range_constexpr(cute.size(accO)):  # element e: half e // 4, column 2 quad + e % 2
                accO[e] = accO[e] * ((al0 if e % 2 == 0 else al1) * (ratio if e // 4 == 0 else ratio2))
            sigma = sig_new
            sigma2 = sig_new2
            for r in cutlass.range_constexpr(cute.size(tOrV_u32)):
                j = r % 4
                mk = r // 4
                mh = mk % cfg.mh
                kb = mk // cfg.mh
                w = Uint32(vw[mh, kb // nib])
                tOrV_u32[r] = _inject(w, cfg.bits * (4 * (kb % nib) + j), cfg.v_shl, cfg.bits, cfg.v_pattern)
            warpgroup.fence()
            for half in cutlass.range_constexpr(2):  # each half with its own B: one (64 x 8) MMA chain each
                acc_h = accO[(None, half, None)]
                acc3 = cute.make_tensor(acc_h.iterator, cute.make_layout(((2, 2), 1, 1), stride=((1, 2), 0, 0)))
                for kb in cutlass.range_constexpr(cute.size(tOrV, mode=[2])):
                    a_h = tOrV[(None, half, kb)]
                    a2 = cute.make_tensor(a_h.iterator, cute.make_layout(((2, 2, 2), 1), stride=((1, 2, 4), 0)))
                    b_h = tOrP[(None, None, kb)] if half == 0 else tOrP2[(None, None, kb)]
                    cute.gemm(pv_mma, acc3, a2, b_h, acc3)
            warpgroup.commit_group()
            warpgroup.wait_group(0)
            if (tile - t_lo) % FLUSH == FLUSH - 1:
                self._flush(c_el, accO, sSum, sigma, warp, lane, quad, bar_id, 0)
                self._flush(c_el2, accO, sSum, sigma2, warp, lane, quad, bar_id, 1)
        else:
            # ---- P' = P s'_V / sigma (FP16) to shared memory, the correction per element -----------------
            r0 = vs0 / sig_new
            r1 = vs1 / sig_new
            q00 = Float16(p00 * r0)
            q01 = Float16(p01 * r0)
            q10 = Float16(p10 * r1)
            q11 = Float16(p11 * r1)
            vm0 = vz0 + cfg.v_mid * vs0
            vm1 = vz1 + cfg.v_mid * vs1
            cs = cfg.v_pivot * sig_new
            c_el[0] = c_el[0] * al0 + (p00 * vm0 - cs * Float32(q00))
            c_el[1] = c_el[1] * al1 + (p01 * vm0 - cs * Float32(q01))
            c_el[2] = c_el[2] * al0 + (p10 * vm1 - cs * Float32(q10))
            c_el[3] = c_el[3] * al1 + (p11 * vm1 - cs * Float32(q11))
            sP[2 * quad, row0] = q00
            sP[2 * quad + 1, row0] = q01
            sP[2 * quad, row0 + 8] = q10
            sP[2 * quad + 1, row0 + 8] = q11
            cute.arch.fence_view_async_shared()
            cute.arch.barrier(barrier_id=bar_id, number_of_threads=THREADS)
            # ---- O^T = V^T P'^T (acc in units of sigma), V^T built in registers ----------------------------
            ratio = sigma / sig_new
            for e in cutlass.range_constexpr(cute.size(accO)):
                accO[e] = accO[e] * ((al0 if e % 2 == 0 else al1) * ratio)
            sigma = sig_new
            for r in cutlass.range_constexpr(cute.size(tOrV_u32)):
                j = r % 4
                mk = r // 4
                mh = mk % cfg.mh
                kb = mk // cfg.mh
                w = Uint32(vw[mh, kb // nib])
                tOrV_u32[r] = _inject(w, cfg.bits * (4 * (kb % nib) + j), cfg.v_shl, cfg.bits, cfg.v_pattern)
            warpgroup.fence()
            for kb in cutlass.range_constexpr(cute.size(tOrV, mode=[2])):
                cute.gemm(pv_mma, accO, tOrV[None, None, kb], tOrP[None, None, kb], accO)
            warpgroup.commit_group()
            warpgroup.wait_group(0)
            if (tile - t_lo) % FLUSH == FLUSH - 1:
                self._flush(c_el, accO, sSum, sigma, warp, lane, quad, bar_id)
        return m0, m1, sigma, sigma2, kgroup

    @cute.jit
    def _q_sums(self, sQ: cute.Tensor, sQsum: cute.Tensor, tidx):
        """``sum(Q)`` of the BF16 operand per head and channel group of a token-wise K (``sQsum[h, c]``):
        the acc-fold's offset term."""
        cfg = self.cfg
        D = cfg.head_dim
        if cutlass.const_expr(cfg.kc == 1):
            if tidx < HEADS:
                acc_q = Float32(0.0)
                for d in cutlass.range(D, unroll=8):
                    acc_q += Float32(sQ[tidx, d])
                sQsum[tidx] = acc_q
        else:
            width = D // cfg.kc
            if tidx < HEADS * cfg.kc:
                h = tidx % HEADS
                c = tidx // HEADS
                acc_q = Float32(0.0)
                for d in cutlass.range(width, unroll=8):
                    acc_q += Float32(sQ[h, c * width + d])
                sQsum[h, c] = acc_q

    @cute.jit
    def _fold_q(self, sQ: cute.Tensor, sQk: cute.Tensor, sKr: cute.Tensor, sKf: cute.Tensor, s_d: Float32,
                z_d: Float32, ctid, warp, lane, bar_id: cutlass.Constexpr):
        """Channel-wise K, at a token group's first tile: ``Q' = bf16(Q s')`` into ``sQk`` (the QK product's B
        operand) and the group's offset correction per head, ``sum_d Q mid - c sum_d Q'`` (centred on the
        pivot ``c``, from the BF16 ``Q'`` the MMA consumes), into ``sKf``. Thread ``ctid`` holds channel
        ``ctid % D``'s ``(s', z')`` and handles its ``HEADS * D / 128`` elements of ``Q``."""
        cfg = self.cfg
        D = cfg.head_dim
        per = HEADS * D // THREADS  # heads per thread: 8 (D = 128) or 4 (D = 64)
        d = ctid % D
        h0 = (ctid // D) * per
        mid = z_d + cfg.k_mid * s_d
        part = cute.make_rmem_tensor(cute.make_layout(per), Float32)
        cute.arch.barrier(barrier_id=bar_id, number_of_threads=THREADS)  # earlier readers of sQk, sKf are done
        for i in cutlass.range_constexpr(per):
            qv = Float32(sQ[h0 + i, d])
            qs = BFloat16(qv * s_d)
            sQk[h0 + i, d] = qs
            part[i] = qv * mid - cfg.k_pivot * Float32(qs)
        for i in cutlass.range_constexpr(per):  # sum over the warp's 32 channels
            v = part[i]
            for sh in cutlass.range_constexpr(5):
                v = v + cute.arch.shuffle_sync_bfly(v, 16 >> sh)
            part[i] = v
        if lane == 0:
            for i in cutlass.range_constexpr(per):
                sKr[warp, i] = part[i]
        cute.arch.barrier(barrier_id=bar_id, number_of_threads=THREADS)
        if ctid < HEADS:  # head h: the warps holding its channels (all four at D = 128; two at D = 64)
            warps = D // 32
            first = (ctid // per) * warps
            acc = Float32(0.0)
            for w in cutlass.range_constexpr(warps):
                acc = acc + sKr[first + w, ctid % per]
            sKf[ctid] = acc
        cute.arch.fence_view_async_shared()  # sQk is read by the wgmma (async proxy)
        cute.arch.barrier(barrier_id=bar_id, number_of_threads=THREADS)

    @cute.jit
    def _load_tile(self, mKC: cute.Tensor, mVC: cute.Tensor, mKP: cute.Tensor, mVP: cute.Tensor, mBT: cute.Tensor,
                   b, kvh, tile, kw: cute.Tensor, vw: cute.Tensor, par: cute.Tensor, vpar: cute.Tensor,
                   thr_c: cute.Tensor, warp, lane, tidx, row0):
        """This thread's packed words of KV tile ``tile`` (:mod:`foscar.cute.fragment`) and the ``(s', z')``
        of its two token rows, into registers."""
        cfg = self.cfg
        D = cfg.head_dim
        t0 = tile * TILE
        page = mBT[b, t0 // cfg.page]
        off = t0 % cfg.page
        kwpb = words_per_block(cfg.bits, D, "k")
        vwpb = words_per_block(cfg.bits, D, "v")
        kbase = (off // K_BLOCK_TOKENS + warp) * kwpb + lane * cfg.k_words
        for i in cutlass.range_constexpr(cfg.k_words):
            kw[i] = mKC[page, kvh, kbase + i]
        vbase = (off // v_block_tokens(cfg.bits)) * vwpb + tidx * cfg.mh
        for vb in cutlass.range_constexpr(cfg.v_blocks):
            for mh in cutlass.range_constexpr(cfg.mh):
                vw[mh, vb] = mVC[page, kvh, vbase + vb * vwpb + mh]
        for r in cutlass.range_constexpr(2):
            for j in cutlass.range_constexpr(2):
                if cutlass.const_expr(cfg.k_channel):  # the group's (s', z') of this thread's channel
                    if cutlass.const_expr(r == 0):
                        row = off // cfg.group_size if cfg.page >= cfg.group_size else 0
                        par[j] = mKP[page, kvh, row, tidx % D, j]
                else:
                    for c in cutlass.range_constexpr(cfg.kc):
                        par[(r * cfg.kc + c) * 2 + j] = mKP[page, kvh, off + row0 + 8 * r, c, j]
                for c in cutlass.range_constexpr(cfg.vc):
                    if cutlass.const_expr(cfg.v_channel):
                        par[4 * cfg.kc + (r * cfg.vc + c) * 2 + j] = Float32(0.0)  # no per-token V scale
                    else:
                        par[4 * cfg.kc + (r * cfg.vc + c) * 2 + j] = mVP[page, kvh, off + row0 + 8 * r, c, j]
        if cutlass.const_expr(cfg.v_channel):  # the group's (s', z') of this thread's accumulator channels
            vrow = off // cfg.group_size if cfg.page >= cfg.group_size else 0
            for e in cutlass.range_constexpr(cfg.acc_elems):
                ch, _ = thr_c[e]
                for j in cutlass.range_constexpr(2):
                    vpar[2 * e + j] = mVP[page, kvh, vrow, ch, j]

    @cute.jit
    def _column_sums(self, el: cute.Tensor, sSum: cute.Tensor, warp, lane, quad, bar_id: cutlass.Constexpr):
        """Sums over a tile's 64 token rows of per-element values ``el`` (element e: column 2*quad + e%2):
        lanes sharing the columns, then the four warps through shared memory."""
        c0 = el[0] + el[2]
        c1 = el[1] + el[3]
        for sh in cutlass.range_constexpr(3):
            c0 = c0 + cute.arch.shuffle_sync_bfly(c0, 4 << sh)
            c1 = c1 + cute.arch.shuffle_sync_bfly(c1, 4 << sh)
        cute.arch.barrier(barrier_id=bar_id, number_of_threads=THREADS)  # earlier readers of sSum are done
        if lane < 4:
            sSum[warp, 2 * lane] = c0
            sSum[warp, 2 * lane + 1] = c1
        cute.arch.barrier(barrier_id=bar_id, number_of_threads=THREADS)
        t0 = sSum[0, 2 * quad] + sSum[1, 2 * quad] + sSum[2, 2 * quad] + sSum[3, 2 * quad]
        t1 = sSum[0, 2 * quad + 1] + sSum[1, 2 * quad + 1] + sSum[2, 2 * quad + 1] + sSum[3, 2 * quad + 1]
        return t0, t1

    @cute.jit
    def _flush(self, c_el: cute.Tensor, accO: cute.Tensor, sSum: cute.Tensor, sigma: Float32, warp, lane, quad,
               bar_id: cutlass.Constexpr, half: cutlass.Constexpr = -1):
        """The offset corrections gathered per element join the accumulator (units of sigma): all of it, or
        (token-wise V with two channel groups) the m64 half ``half`` whose channels are one group."""
        c0, c1 = self._column_sums(c_el, sSum, warp, lane, quad, bar_id)
        for e in cutlass.range_constexpr(cute.size(accO)):
            if cutlass.const_expr(half < 0 or e // 4 == half):
                accO[e] = accO[e] + (c0 if e % 2 == 0 else c1) / sigma
        c_el.fill(0.0)


STAGES = 4  # shared-memory stages per consumer warpgroup (v1)
CONSUMERS = 2  # consumer warpgroups per CTA (v1), on alternating KV tiles
#: v1's register budgets by CTAs resident per SM: (producer, consumer) registers a thread after setmaxnreg.
#: One CTA: the register file goes to two consumers. Two CTAs (four consumer warpgroups per SM, as many as
#: v0 runs): launched at 80 a thread (65,536 / 768, rounded down to 8), the producer gives 56 back and
#: each consumer takes 24 (128 x 56 >= 256 x 24).
WS_REGISTERS = {1: (40, 232), 2: (24, 104)}


class FoldDecodeSm90WS(FoldDecodeSm90):
    """v1: warp-specialized. Warpgroup 0 is the producer: one thread walks the split's KV tiles through the
    page table and issues TMA copies (``cp.async.bulk.tensor``) of each tile's packed K and V words and
    its ``(s', z')`` into a ``STAGES``-deep shared-memory ring per consumer, each stage guarded by a full
    and an empty mbarrier (exact transaction bytes). Warpgroups 1 and 2 are the consumers, on alternating
    tiles: each waits for its stage, copies its words and parameters into registers, frees the stage and
    runs v0's tile step (:meth:`FoldDecodeSm90._tile_step`) with its own online-softmax state and
    accumulators. Each consumer writes its own partial (``split * CONSUMERS + c``); the LSE combine merges
    them with the other splits'. ``setmaxnreg`` moves registers from the producer to the consumers."""

    def __init__(self, cfg: Sm90Config, ctas_per_sm: int = 1):
        super().__init__(cfg)
        self.ctas_per_sm = ctas_per_sm

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mKC: cute.Tensor, mVC: cute.Tensor, mKP: cute.Tensor, mVP: cute.Tensor,
                 mBT: cute.Tensor, mSEQ: cute.Tensor, mOP: cute.Tensor, mLP: cute.Tensor, qk_scale: Float32,
                 num_splits: Int32, stream: cuda.CUstream):
        cfg = self.cfg
        qk_mma, pv_mma, sQ_layout, sP_layout = self._mmas_and_layouts()
        # TMA views of the pools: a tile's words (chunk, split into CI x CO boxes of <= 256) and its
        # (s', z') (TILE x 2 floats), by (tile in page, KV head, page)
        chunk = cfg.tile_words
        ci = min(chunk, 256)
        co = chunk // ci
        tpp = cfg.page // TILE
        words = cute.make_layout((ci, co), stride=(1, ci))
        atoms = []
        for m in (mKC, mVC):
            g = cute.make_tensor(m.iterator, cute.make_layout(
                (ci, co, tpp, cute.size(m, mode=[1]), cute.size(m, mode=[0])),
                stride=(1, ci, chunk, m.stride[1], m.stride[0])))
            atoms.append(cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), g, words, (ci, co)))
        for m, width, rows in ((mKP, cfg.k_param_words, cfg.k_param_rows), (mVP, cfg.v_param_words, cfg.v_param_rows)):
            # per tile: its tokens' (s', z'); channel-wise K: the rows of token groups, one per group
            g = cute.make_tensor(m.iterator, cute.make_layout(
                (width, rows, cute.size(m, mode=[1]), cute.size(m, mode=[0])),
                stride=(1, width, m.stride[1], m.stride[0])))
            atoms.append(cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), g, cute.make_layout(width),
                                                     (width,)))
        batch = cute.size(mQ, mode=[0])
        kv_heads = cute.size(mKC, mode=[1])
        self.ws_kernel(qk_mma, pv_mma, sQ_layout, sP_layout, atoms[0][0], atoms[0][1], atoms[1][0], atoms[1][1],
                       atoms[2][0], atoms[2][1], atoms[3][0], atoms[3][1], mQ, mBT, mSEQ, mOP, mLP,
                       qk_scale).launch(grid=(kv_heads, batch, num_splits), block=(THREADS * (1 + CONSUMERS), 1, 1),
                                        stream=stream, min_blocks_per_mp=self.ctas_per_sm,
                                        preferred_smem_carveout=100)  # all of the SM's shared memory

    @cute.kernel
    def ws_kernel(self, qk_mma: cute.TiledMma, pv_mma: cute.TiledMma, sQ_layout: cute.ComposedLayout,
                  sP_layout: cute.ComposedLayout, atom_kc: cute.CopyAtom, tma_kc: cute.Tensor, atom_vc: cute.CopyAtom,
                  tma_vc: cute.Tensor, atom_kp: cute.CopyAtom, tma_kp: cute.Tensor, atom_vp: cute.CopyAtom,
                  tma_vp: cute.Tensor, mQ: cute.Tensor, mBT: cute.Tensor, mSEQ: cute.Tensor, mOP: cute.Tensor,
                  mLP: cute.Tensor, qk_scale: Float32):
        cfg = self.cfg
        chunk = cfg.tile_words
        ci = min(chunk, 256)
        co = chunk // ci
        slots = STAGES * CONSUMERS
        tidx, _, _ = cute.arch.thread_idx()
        kvh, b, split = cute.arch.block_idx()
        n_splits = cute.arch.grid_dim()[2]
        wg = cute.arch.make_warp_uniform(tidx // THREADS)
        qk_mma.set(warpgroup.Field.ACCUMULATE, True)  # set once, before any branch (the tile step zeroes accS)
        pv_mma.set(warpgroup.Field.ACCUMULATE, True)

        smem = SmemAllocator()
        sK = smem.allocate_tensor(Int32, cute.make_layout(((ci, co), slots), stride=((1, ci), chunk)),
                                  byte_alignment=128)
        sV = smem.allocate_tensor(Int32, cute.make_layout(((ci, co), slots), stride=((1, ci), chunk)),
                                  byte_alignment=128)
        sKP = smem.allocate_tensor(Float32, cute.make_layout((cfg.k_param_words, slots)), byte_alignment=128)
        sVP = smem.allocate_tensor(Float32, cute.make_layout((cfg.v_param_words, slots)), byte_alignment=128)
        full = smem.allocate_array(Int64, slots)
        empty = smem.allocate_array(Int64, slots)
        sQ = smem.allocate_tensor(BFloat16, sQ_layout.outer, byte_alignment=1024, swizzle=sQ_layout.inner)
        sQsum = smem.allocate_tensor(Float32, cute.make_layout((HEADS, cfg.kc)), byte_alignment=16)
        sP0 = smem.allocate_tensor(Float16, sP_layout.outer, byte_alignment=1024, swizzle=sP_layout.inner)
        sP1 = smem.allocate_tensor(Float16, sP_layout.outer, byte_alignment=1024, swizzle=sP_layout.inner)
        sP0b = sP0  # token-wise V with two channel groups: each consumer's second P' buffer
        sP1b = sP1
        if cutlass.const_expr(cfg.vc == 2):
            sP0b = smem.allocate_tensor(Float16, sP_layout.outer, byte_alignment=1024, swizzle=sP_layout.inner)
            sP1b = smem.allocate_tensor(Float16, sP_layout.outer, byte_alignment=1024, swizzle=sP_layout.inner)
        sRed0 = smem.allocate_tensor(Float32, cute.make_layout((2, 4, RED_SLOTS)), byte_alignment=16)
        sRed1 = smem.allocate_tensor(Float32, cute.make_layout((2, 4, RED_SLOTS)), byte_alignment=16)
        sSum0 = smem.allocate_tensor(Float32, cute.make_layout((4, HEADS)), byte_alignment=16)
        sSum1 = smem.allocate_tensor(Float32, cute.make_layout((4, HEADS)), byte_alignment=16)
        sQk0 = smem.allocate_tensor(BFloat16, sQ_layout.outer, byte_alignment=1024, swizzle=sQ_layout.inner)
        sQk1 = smem.allocate_tensor(BFloat16, sQ_layout.outer, byte_alignment=1024, swizzle=sQ_layout.inner)
        sKr0 = smem.allocate_tensor(Float32, cute.make_layout((4, HEADS)), byte_alignment=16)
        sKr1 = smem.allocate_tensor(Float32, cute.make_layout((4, HEADS)), byte_alignment=16)
        sKf0 = smem.allocate_tensor(Float32, cute.make_layout(HEADS), byte_alignment=16)
        sKf1 = smem.allocate_tensor(Float32, cute.make_layout(HEADS), byte_alignment=16)

        if tidx == 0:
            for i in cutlass.range_constexpr(slots):
                cute.arch.mbarrier_init(full + i, 1)
                cute.arch.mbarrier_init(empty + i, THREADS)
        cute.arch.mbarrier_init_fence()
        # ---- Q^T (heads padded with zeros) and sum(Q), by the producer warpgroup -------------------------
        if wg == 0:
            self._load_q(mQ, sQ, b, kvh, tidx)
        cute.arch.sync_threads()
        self._q_sums(sQ, sQsum, tidx)
        cute.arch.fence_view_async_shared()
        cute.arch.sync_threads()

        n, t_lo, t_hi = self._split_tiles(mSEQ, b, split, n_splits)
        if wg == 0:  # ---- producer ----------------------------------------------------------------------
            cute.arch.setmaxregister_decrease(WS_REGISTERS[self.ctas_per_sm][0])
            gKC = cute.local_tile(tma_kc, (ci, co), (0, 0, None, None, None))
            gVC = cute.local_tile(tma_vc, (ci, co), (0, 0, None, None, None))
            gKP = cute.local_tile(tma_kp, (cfg.k_param_words,), (0, None, None, None))
            gVP = cute.local_tile(tma_vp, (cfg.v_param_words,), (0, None, None, None))
            one = cute.make_layout(1)
            tKs, tKg = cpasync.tma_partition(atom_kc, 0, one, sK, cute.group_modes(gKC, 0, 2))
            tVs, tVg = cpasync.tma_partition(atom_vc, 0, one, sV, cute.group_modes(gVC, 0, 2))
            tKPs, tKPg = cpasync.tma_partition(atom_kp, 0, one, sKP, cute.group_modes(gKP, 0, 1))
            tVPs, tVPg = cpasync.tma_partition(atom_vp, 0, one, sVP, cute.group_modes(gVP, 0, 1))
            if tidx == 0:
                for tile in cutlass.range(t_lo, t_hi, unroll=1):
                    i = tile - t_lo
                    k = i // CONSUMERS
                    slot = (i % CONSUMERS) * STAGES + k % STAGES
                    cute.arch.mbarrier_wait(empty + slot, ((k // STAGES) % 2) ^ 1)  # a fresh stage passes
                    cute.arch.mbarrier_arrive_and_expect_tx(full + slot,
                                                            (2 * chunk + cfg.k_param_words + cfg.v_param_words) * 4)
                    t0 = tile * TILE
                    page = mBT[b, t0 // cfg.page]
                    tip = (t0 % cfg.page) // TILE
                    grow = (t0 % cfg.page) // cfg.group_size if cfg.page >= cfg.group_size else 0
                    krow = grow if cfg.k_channel else tip  # the tile's (s', z') row: channel-wise, its group's
                    vrow = grow if cfg.v_channel else tip
                    cute.copy(atom_kc, tKg[(None, tip, kvh, page)], tKs[(None, slot)], tma_bar_ptr=full + slot)
                    cute.copy(atom_vc, tVg[(None, tip, kvh, page)], tVs[(None, slot)], tma_bar_ptr=full + slot)
                    cute.copy(atom_kp, tKPg[(None, krow, kvh, page)], tKPs[(None, slot)], tma_bar_ptr=full + slot)
                    cute.copy(atom_vp, tVPg[(None, vrow, kvh, page)], tVPs[(None, slot)], tma_bar_ptr=full + slot)
        for c in cutlass.range_constexpr(CONSUMERS):  # ---- consumers (one code path each: static buffers) --
            if wg == c + 1:
                cute.arch.setmaxregister_increase(WS_REGISTERS[self.ctas_per_sm][1])
                self._consume(c, qk_mma, pv_mma, sK, sV, sKP, sVP, full, empty, sQ, sQsum,
                              sP0 if c == 0 else sP1, sP0b if c == 0 else sP1b,
                              sRed0 if c == 0 else sRed1, sSum0 if c == 0 else sSum1,
                              sQk0 if c == 0 else sQk1, sKr0 if c == 0 else sKr1, sKf0 if c == 0 else sKf1,
                              mOP, mLP, b, kvh, split, t_lo, t_hi, n, qk_scale)

    @cute.jit
    def _consume(self, c: cutlass.Constexpr, qk_mma: cute.TiledMma, pv_mma: cute.TiledMma, sK: cute.Tensor,
                 sV: cute.Tensor, sKP: cute.Tensor, sVP: cute.Tensor, full, empty, sQ: cute.Tensor,
                 sQsum: cute.Tensor, sP: cute.Tensor, sP2: cute.Tensor, sRed: cute.Tensor, sSum: cute.Tensor,
                 sQk: cute.Tensor,
                 sKr: cute.Tensor, sKf: cute.Tensor, mOP: cute.Tensor, mLP: cute.Tensor, b, kvh, split, t_lo, t_hi, n,
                 qk_scale: Float32):
        """Consumer warpgroup ``c``: tiles ``t_lo + c, t_lo + c + CONSUMERS, ...`` from its stage ring."""
        cfg = self.cfg
        D = cfg.head_dim
        tidx, _, _ = cute.arch.thread_idx()
        ctid = tidx - THREADS * (c + 1)
        warp = ctid // 32
        lane = ctid % 32
        quad = lane % 4
        row0 = 16 * warp + lane // 4
        qsum0 = sQsum[2 * quad]
        qsum1 = sQsum[2 * quad + 1]
        (thr_pv, tSrK, tSrK_u32, tSrQ, tSrQk, accS, tOrV, tOrV_u32, tOrP, tOrP2, accO, kw, vw, l_el, c_el,
         c_el2) = self._warpgroup_state(qk_mma, pv_mma, sQ, sQk, sP, sP2, ctid)
        par = cute.make_rmem_tensor(cute.make_layout(cfg.par_words), Float32)
        vpar = cute.make_rmem_tensor(cute.make_layout(2 * cfg.acc_elems), Float32)  # channel-wise V
        thr_c = thr_pv.partition_C(cute.make_identity_tensor((D, HEADS)))
        m0 = -Float32.inf
        m1 = -Float32.inf
        sigma = Float32(1.0)
        sigma2 = Float32(1.0)
        kgroup = Int32(-1)
        kwpb = words_per_block(cfg.bits, D, "k")
        vwpb = words_per_block(cfg.bits, D, "v")
        for tile in cutlass.range(t_lo + c, t_hi, CONSUMERS, unroll=1):
            k = (tile - t_lo) // CONSUMERS
            slot = c * STAGES + k % STAGES
            cute.arch.mbarrier_wait(full + slot, (k // STAGES) % 2)
            kbase = warp * kwpb + lane * cfg.k_words  # this thread's words (foscar.cute.fragment)
            for i in cutlass.range_constexpr(cfg.k_words):
                kw[i] = sK[(kbase + i, slot)]
            for vb in cutlass.range_constexpr(cfg.v_blocks):
                for mh in cutlass.range_constexpr(cfg.mh):
                    vw[mh, vb] = sV[(vb * vwpb + ctid * cfg.mh + mh, slot)]
            for r in cutlass.range_constexpr(2):
                for j in cutlass.range_constexpr(2):
                    if cutlass.const_expr(cfg.k_channel):  # this thread's channel of the group's row
                        if cutlass.const_expr(r == 0):
                            par[j] = sKP[2 * (ctid % D) + j, slot]
                    else:
                        for cc in cutlass.range_constexpr(cfg.kc):
                            par[(r * cfg.kc + cc) * 2 + j] = sKP[((row0 + 8 * r) * cfg.kc + cc) * 2 + j, slot]
                    for cc in cutlass.range_constexpr(cfg.vc):
                        if cutlass.const_expr(cfg.v_channel):
                            par[4 * cfg.kc + (r * cfg.vc + cc) * 2 + j] = Float32(0.0)  # no per-token V scale
                        else:
                            par[4 * cfg.kc + (r * cfg.vc + cc) * 2 + j] = sVP[((row0 + 8 * r) * cfg.vc + cc) * 2 + j,
                                                                              slot]
            if cutlass.const_expr(cfg.v_channel):  # the group's (s', z') of this thread's accumulator channels
                for e in cutlass.range_constexpr(cfg.acc_elems):
                    ch, _ = thr_c[e]
                    for j in cutlass.range_constexpr(2):
                        vpar[2 * e + j] = sVP[2 * ch + j, slot]
            cute.arch.mbarrier_arrive(empty + slot)  # the stage is in registers: the producer may refill it
            m0, m1, sigma, sigma2, kgroup = self._tile_step(
                k, tile * TILE, 0, n, kw, vw, par, vpar, m0, m1, sigma, sigma2, kgroup, qk_mma, pv_mma, c_el2, tOrP2,
                tSrK, tSrK_u32, tSrQ, tSrQk, accS, tOrV, tOrV_u32, tOrP, accO, l_el, c_el, sRed, sSum, sP, sP2, sQ, sQk,
                sKr, sKf, sQsum, qsum0, qsum1, qk_scale, ctid, warp, lane, quad, row0, 1 + c)
        self._epilogue(c_el, c_el2, accO, l_el, sSum, sigma, sigma2, m0, m1, thr_pv, mOP, mLP, b, kvh,
                       split * CONSUMERS + c, warp, lane, quad, 1 + c)


@functools.lru_cache(maxsize=256)  # host time per call
def config_for(fmt, group: int, page: int) -> Sm90Config:
    """The static configuration for a cache format (``KVFormat``), GQA ratio and page size; the injection
    constants are the Triton kernels' (:func:`foscar.format.injection_constants`): one home."""
    import torch

    from ..errors import UnsupportedError
    from ..format import operand_for
    from ..format import injection_constants as _injection_args
    g = fmt.group_size
    if g % TILE or ("token" in (fmt.k_axis, fmt.v_axis) and fmt.head_dim % g):
        raise UnsupportedError(f"k_axis={fmt.k_axis!r}, v_axis={fmt.v_axis!r}, group_size={g}",
                               "the CuTe kernels need g a multiple of 64 (channels of a token-wise axis, tokens of "
                               "a channel-wise one), dividing the head dim for a token-wise axis")
    if fmt.head_dim not in (64, 128) or group > HEADS or page % TILE or fmt.mapping != "bf16":
        raise UnsupportedError(f"head_dim={fmt.head_dim}, G={group}, page={page}, mapping={fmt.mapping!r}",
                               "the CuTe kernels need head_dim 64/128, G <= 8, pages of 64k tokens, bf16")
    k = _injection_args("K", operand_for(torch.bfloat16, fmt.bits), fmt)
    v = _injection_args("V", operand_for(torch.float16, fmt.bits), fmt)
    return Sm90Config(fmt.bits, fmt.head_dim, page, group, k["K_PATTERN"], k["K_SHL"], float(k["K_PIVOT"]),
                      float(k["K_MID"]), v["V_PATTERN"], v["V_SHL"], float(v["V_PIVOT"]), float(v["V_MID"]),
                      fmt.sink, fmt.recent, fmt.k_axis == "channel", fmt.group_size, fmt.v_axis == "channel")


#: The stage-1 arguments, in order (``__call__``'s tensors): (name, element type, rank). Every tensor has
#: a dynamic shape and strides, unit stride in its last dim, and a 16-byte aligned base (TMA and
#: vector loads): one compile serves every batch, length and pool size.
STAGE1_TENSORS = (("q", BFloat16, 3), ("k_codes", Int32, 3), ("v_codes", Int32, 3), ("k_params", Float32, 5),
                  ("v_params", Float32, 5), ("block_table", Int32, 2), ("seq_lens", Int32, 1),
                  ("partial_out", Float32, 4), ("partial_lse", Float32, 3))
ALIGN = 16


def _placeholder(dtype, rank: int):
    """A symbolic tensor of ``rank`` dims: dynamic extents and strides, the last stride 1."""
    from cutlass.cute.runtime import make_fake_tensor
    return make_fake_tensor(dtype, tuple(cute.sym_int() for _ in range(rank)),
                            tuple(cute.sym_int64() for _ in range(rank - 1)) + (1,), assumed_align=ALIGN)


def compile_stage1(cfg: Sm90Config, *, keep_ptx: bool = False, warp_specialized: bool = False,
                   ctas_per_sm: int = 1):
    """Compile the kernel for ``cfg`` (on any machine: set ``CUTE_DSL_ARCH=sm_90a`` without a GPU): v0, or
    v1 (``warp_specialized``: TMA producer and two consumer warpgroups; ``ctas_per_sm`` of them resident,
    1 or 2, :data:`WS_REGISTERS`). The function is compiled for TVM-FFI (apache-tvm-ffi): it takes torch
    tensors as they are (:data:`STAGE1_TENSORS`, checked against the placeholders' dtypes, ranks, unit
    strides and alignment by the call itself), then ``qk_scale`` (float) and ``num_splits`` (int), and
    launches on torch's current stream (CUDA graphs capture it). Host time of a call: a few
    microseconds, where wrapping each tensor with ``from_dlpack`` took tens."""
    if ctas_per_sm not in WS_REGISTERS:
        raise ValueError(f"ctas_per_sm: expected one of {sorted(WS_REGISTERS)}, got {ctas_per_sm!r}")
    options = (cute.KeepPTX, cute.EnableTVMFFI) if keep_ptx else (cute.EnableTVMFFI,)
    kernel = FoldDecodeSm90WS(cfg, ctas_per_sm) if warp_specialized else FoldDecodeSm90(cfg)
    args = [_placeholder(dtype, rank) for _, dtype, rank in STAGE1_TENSORS]
    return cute.compile[options](kernel, *args, Float32(1.0), Int32(1),
                                 make_fake_stream(use_tvm_ffi_env_stream=True))
