"""Overlapped passes of one consumer (``Sm90Config.overlap``, v1): two of its tiles, ``A`` and ``B``, a pass, each
with its own softmax step, the tensor core kept busy under the softmax.

A one-tile pass runs its steps in a chain: K built, ``S^T = K Q^T``, a wait, the online softmax, ``O^T += V^T
P'^T``, a wait. At 16 and 32 columns the softmax is most of a tile's instructions, and the waits leave the warps idle
while the tensor core works. An overlapped pass issues both tiles' QK products (B's K in A registers of its own,
:attr:`~foscar.cute.warpgroup.Fragments.tSrK_b`, its scores in ``accS_b``), waits for A's only, runs A's softmax
while B's product completes, issues A's PV product and runs B's softmax while that one completes (B's ``P'`` in the
pass's second tile of the B operand); then B's PV product. The online softmax sees A, then B, as one-tile passes do:
the same arithmetic. Each accumulator's first QK MMA overwrites it (the zeroing atom, ``Warpgroup.qk_mma0``): zeros
moved into B's accumulator while A's product is in flight would make ptxas wait for A's product there. Token-wise K
and V of one channel group, the lazy rescale (:mod:`foscar.cute.lazy`; its rare rescale waits for A's PV product).
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import warpgroup

from .config import CORRECTION_TILES, TILE
from .folds import fold_corrections
from .lazy import lazy_softmax
from .operands import build_vt_registers
from .pair import second_tile_start, wait_pass
from .ring import StageRing
from .warpgroup import RunningState, TileRegisters, Warpgroup, WarpgroupThread, tile_scales


@cute.jit
def consume_overlapped(kern, wg: Warpgroup, ring: StageRing, regs: TileRegisters, regs_b: TileRegisters, state,
                       thr_c: cute.Tensor, thr: WarpgroupThread, c, k, tile, tile_b, t_hi, n) -> RunningState:
    """v1 consumer ``c``'s overlapped pass over its ``k``-th tile (``tile``, ``k`` even) and its next (``tile_b``; none
    past ``t_hi``: its rows masked, tile A's words again): both stages into registers and freed, then
    :func:`overlap_step`. Returns the new state."""
    has_b = tile_b < t_hi
    slot, slot_b = wait_pass(ring, c, k, has_b, kern.cfg.stages)
    kern._read_words(ring, slot, regs, thr)
    kern._read_params(ring, slot, regs, thr_c, thr)
    kern._read_words(ring, slot_b, regs_b, thr)
    kern._read_params(ring, slot_b, regs_b, thr_c, thr)
    kern._release_pair(ring, slot, slot_b, has_b)
    return overlap_step(kern, wg, regs, regs_b, state, k, tile * TILE, second_tile_start(tile_b, t_hi, n))


@cute.jit
def overlap_step(kern, wg: Warpgroup, regs: TileRegisters, regs_b: TileRegisters, state: RunningState, step, t0,
                 t0_b) -> RunningState:
    """One overlapped pass over tiles A (words and ``(s', z')`` in ``regs``, starting at token ``t0``) and B
    (``regs_b``, ``t0_b``; the sequence's length or more where the consumer has no tile B: its rows are masked).
    ``step``: tile A's index in the consumer's sequence (even; B's is ``step + 1``). Returns the new state."""
    cfg = kern.cfg
    frags = wg.frags
    thr = wg.thr
    sc_a = tile_scales(cfg, regs.par, t0, thr.row0, wg.n)
    sc_b = tile_scales(cfg, regs_b.par, t0_b, thr.row0, wg.n)
    parts_a, steps_a = kern._qk(wg, regs, sc_a, t0, None, wait=False)
    parts_b, steps_b = kern._qk(wg, regs_b, sc_b, t0_b, frags.accS_b, wait=False, second=True)
    # ---- tile A: its scores while B's product completes ------------------------------------------------
    warpgroup.wait_group(1)
    parts_a = kern._qk_finish(wg, parts_a, steps_a)
    s_a = kern._scores(wg, regs, sc_a, parts_a, t0, mu=state.softmax.m)
    if cutlass.const_expr(cfg.mask_branch):
        s_a, sc_a = kern._mask_branch(wg, sc_a, s_a, t0, t0)
    softmax, out = lazy_softmax(cfg, wg, state, sc_a, s_a, step)
    build_vt_registers(cfg, frags.tOrV_u32, regs.vw)
    kern._pv(wg, out, 0, wait=False)
    # ---- tile B: its scores while A's PV product completes ---------------------------------------------
    warpgroup.wait_group(1)
    parts_b = kern._qk_finish(wg, parts_b, steps_b)
    s_b = kern._scores(wg, regs_b, sc_b, parts_b, t0_b, mu=softmax.m)
    if cutlass.const_expr(cfg.mask_branch):
        s_b, sc_b = kern._mask_branch(wg, sc_b, s_b, t0_b, t0_b)
    softmax, out = lazy_softmax(cfg, wg, RunningState(softmax, out, state.kgroup), sc_b, s_b, step + 1, first=TILE,
                                pv_in_flight=True)
    warpgroup.wait_group(0)  # A's PV product read V^T's registers: B's are built into them
    build_vt_registers(cfg, frags.tOrV_u32, regs_b.vw)
    kern._pv(wg, out, cute.size(frags.tOrV, mode=[2]))
    passes = CORRECTION_TILES // 2
    if (step >> 1) & (passes - 1) == passes - 1:  # the pass's index % passes (a power of two)
        fold_corrections(cfg, out, wg.smem.sSum, thr)
    return RunningState(softmax, out, state.kgroup)
