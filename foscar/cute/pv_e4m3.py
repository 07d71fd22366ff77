"""E4M3 operands of ``O^T = V^T P'^T`` (``Sm90Config.v_e4m3``): V^T by bit placement from the packed words,
P' as two E4M3 terms in the N columns, the product promoted to FP32 every pass.

- **V^T.** Register ``r`` of the ``(head_dim, 64)`` A fragment of ``wgmma.m64n8k32`` (its Uint32 view) is
  ``(vw[mh, vb] >> bits*i) & mask`` (:func:`v_register_source_e4m3`): the thread's word of V block ``vb``
  and m64 half ``mh``, each byte the E4M3 value ``q 2^-9`` of one code. The rows are the channels as they
  stand; contraction index ``kappa`` holds token ``contraction_order[kappa]`` of the tile
  (:mod:`foscar.e4m3`), so P' is stored at :func:`token_kappa` of each token.
- **P' terms.** ``B = P s' S / sigma`` with ``S = 2^8`` (:data:`P_SCALE`; ``|B| <= 256``: ``P <= 1`` and
  ``sigma >= |s'|``), split as ``hi = e4m3(B)``, ``lo = e4m3((B - hi) 16)``: ``hi`` of head ``h`` in column
  ``h``, ``lo`` in column ``4 + h`` (:data:`P_LO_COLUMN`), for the four heads of a pass. The MMA's
  ``sum_t B_t y_t`` is ``acc[h] + acc[4 + h] / 16`` (one shuffle, :func:`add_p_terms`), in FP32 registers
  fresh each pass, then added to the output accumulator times ``FACTOR / S``.
- **The fold.** With ``y`` the operand and the cache's scale ``s' FACTOR`` on it
  (:func:`foscar.format.fold_constants`), a pass adds ``(FACTOR / S) (sum B y - PIVOT sum B) + sum P mid /
  sigma`` in units of ``sigma``: the offset correction takes the ``B`` the MMA consumed (``hi + lo / 16``).
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float8E4M3FN, Float32, Uint32

from ..e4m3 import PLACEMENT_MASK
from .config import THREADS, TILE
from .folds import OutputAccumulator, power_of_two_reciprocal

P_SCALE = 256.0  #: S: ``B = P s' S / sigma`` is at most 256 in magnitude, within E4M3's 448
P_LO_COLUMN = 4  #: the N column of head ``h``'s ``lo`` term is ``h + 4``


def v_register_source_e4m3(bits: int, head_dim: int, r: int) -> tuple[int, int, int]:
    """``(vb, mh, shift)``: E4M3 V^T register ``r`` of a thread (the Uint32 view of the ``(head_dim, 64)`` A
    fragment, ``r = 4 (mh + halves kb) + j``) is ``(vw[mh, vb] >> shift) & mask``: tile register
    ``e = 4 kb + j`` of m64 half ``mh`` (:func:`foscar.e4m3.tile_registers`), from the word of V block
    ``e // (8 / bits)``, shift ``bits * (e % (8 / bits))``."""
    halves = head_dim // 64
    j, mk = r % 4, r // 4
    mh, kb = mk % halves, mk // halves
    e = 4 * kb + j
    per_word = 8 // bits
    return e // per_word, mh, bits * (e % per_word)


@cute.jit
def build_vt_registers_e4m3(cfg, regs: cute.Tensor, vw: cute.Tensor):
    """V^T's E4M3 A registers (``regs``: the Uint32 view of the O^T product's A fragment) from this thread's
    words of the tile (``vw[mh, vb]``, loaded at :func:`foscar.cute.fragment.v_word`)."""
    mask = Uint32(PLACEMENT_MASK[cfg.bits])
    for r in cutlass.range_constexpr(cute.size(regs)):
        vb, mh, sh = v_register_source_e4m3(cfg.bits, cfg.head_dim, r)
        w = Uint32(vw[mh, vb])
        x = w >> sh if sh else w
        regs[r] = x & mask


def token_kappa(bits: int, t):
    """The contraction index that holds token ``t`` of a tile (``t`` in 0..63, run-time): the inverse of
    :func:`foscar.e4m3.contraction_order` within each block of 32 tokens."""
    blk = t // 32
    u = t % 32
    if bits == 4:  # u = 16 h + 8 (v % 2) + 2 a + v // 2
        h = u // 16
        v = 2 * (u % 2) + (u % 16) // 8
    else:  # u = 16 (v % 2) + 8 h + 2 a + v // 2
        h = (u % 16) // 8
        v = 2 * (u % 2) + u // 16
    a = (u % 8) // 2
    return 32 * blk + 16 * h + 4 * a + v


@cute.jit
def v_operand_fold_e4m3(cfg, wg, out: OutputAccumulator, v: list, p: list, al: tuple, sigma: list):
    """Token-wise V, one channel group, E4M3 operands: ``B = P s' S / sigma`` as two E4M3 terms into the
    pass's P' buffer (this thread's heads ``col0``, ``col0 + 1`` of its tile ``half``, tokens at
    :func:`token_kappa`), the offset correction of each element (``P mid - sigma (FACTOR / S) PIVOT B``,
    ``B`` as consumed) gathered into ``out.corr[0]``; then the fence and barrier the wgmma reads need."""
    thr = wg.thr
    sP = wg.smem.sP[0]
    inv = power_of_two_reciprocal(sigma[0]) * P_SCALE  # a power of two: exact
    rows = (v[0][0] * inv, v[0][2] * inv)
    mid = (v[0][1] + cfg.v_mid * v[0][0], v[0][3] + cfg.v_mid * v[0][2])
    cs = cfg.v_pivot * (cfg.v_factor / P_SCALE) * sigma[0]
    base = TILE * thr.half
    kap = (base + token_kappa(cfg.bits, thr.row0), base + token_kappa(cfg.bits, thr.row0 + 8))
    c = out.corr[0]
    for e in cutlass.range_constexpr(4):  # element e: row e // 2, head col0 + e % 2
        b = p[e] * rows[e // 2]
        hi = b.to(Float8E4M3FN)
        hif = hi.to(Float32)
        lo = ((b - hif) * 16.0).to(Float8E4M3FN)
        consumed = hif + lo.to(Float32) * 0.0625
        c[e] = c[e] * al[e % 2] + (p[e] * mid[e // 2] - cs * consumed)
        col = thr.col0 + e % 2
        sP[col, kap[e // 2]] = hi
        sP[P_LO_COLUMN + col, kap[e // 2]] = lo
    cute.arch.fence_view_async_shared()
    cute.arch.barrier(barrier_id=thr.bar_id, number_of_threads=THREADS)


@cute.jit
def add_p_terms(cfg, out: OutputAccumulator, accT: cute.Tensor):
    """The pass's product into the output accumulator: ``acc += (FACTOR / S) (hi + lo / 16)``, each head's
    ``lo`` from the lane two quads over (quads 0 and 1 hold the heads; every lane takes part)."""
    accO = out.acc
    k = cfg.v_factor / P_SCALE
    for e in cutlass.range_constexpr(cute.size(accO)):
        lo = cute.arch.shuffle_sync_bfly(accT[e], 2)
        accO[e] = accO[e] + (accT[e] + lo * 0.0625) * k
