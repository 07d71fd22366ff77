"""Channel-wise K's ``Q'`` folded by v1's producer warpgroup (:attr:`~foscar.cute.config.Sm90Config.producer_fold`):
warp ``c + 1`` of the producer folds consumer ``c``'s stages, in the order that consumer takes them, while the
producer's first warp issues the copies. A stage's ``Q'`` (:func:`foscar.cute.folds.fold_q`, E4M3 terms
:func:`foscar.cute.fold_terms.fold_q_terms`) goes to its own buffer of the ring (:func:`~foscar.cute.ring.fold_buffer`:
one a pass where two tiles a pass share tile A's), each warp folding its consumer's next stage while the other
folds its own: one fold warp a consumer keeps each ring's barrier phases in order (a consumer's stages are waited
for, folded and published by one warp, as that consumer waits for them).
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute

from .fold_terms import fold_q_terms, fold_terms_padding, fold_turns
from .folds import q_fold
from .operands import qk_element_type
from .ring import StageRing, fold_buffer, ring_phase, ring_slot, run_bound, run_tile


def fold_buffers(cfg, consumers: int) -> int:
    """The ring's ``Q'`` buffers: one a slot, or one a pass with two tiles a pass
    (:func:`~foscar.cute.ring.fold_buffer`)."""
    return cfg.stages * consumers // cfg.tiles_per_pass


def fold_buffer_bytes(cfg) -> int:
    """One ``Q'`` buffer's bytes with its row corrections (and E4M3 terms' ``2^-e``): the QK product's B operand in
    its element's bytes (:func:`~foscar.cute.operands.qk_element_type`)."""
    return cfg.qk_cols * cfg.head_dim * qk_element_type(cfg).width // 8 + 4 * cfg.cols * (2 if cfg.k_e4m3 else 1)


@cute.jit
def fold_stages(cfg, ring: StageRing, sQ: cute.Tensor, c, lane, t_lo, t_hi, source):
    """Fold warp ``c`` (``lane`` its thread): consumer ``c``'s stages over tiles ``[t_lo, t_hi)``, each once its K
    ``(s', z')`` has landed (the slot's ``kpar`` barrier), every stage where one tile is a pass, else each pass's tile
    A's; then a fence for the wgmma's proxy and the warp's arrival on the stage's full barrier. First the fixed
    parts of consumer ``c``'s buffers (E4M3 terms' padding), ordered before the consumer's reads by the same
    fences and arrivals. ``source(slot, t)``: where thread ``t`` of a fold reads the ``(s', z')`` of stage ``slot``."""
    n = fold_buffers(cfg, 1)  # a consumer's buffers
    if cutlass.const_expr(cfg.k_e4m3):
        fold_terms_padding(cfg, lane, 32, ring.sQk, ring.sKf, c * n, n)
    for k in cutlass.range(0, run_bound(t_hi - t_lo), cfg.tiles_per_pass, unroll=1):  # the consumer's k-th tile
        tile = t_lo + run_tile(c, k, cfg.tile_run)
        if tile < t_hi:
            slot = ring_slot(c, k, cfg.stages)
            cute.arch.mbarrier_wait(ring.kpar + slot, ring_phase(k, cfg.stages))
            buf = fold_buffer(slot, cfg.tiles_per_pass)
            if cutlass.const_expr(cfg.k_e4m3 and not cfg.fold_unrolled):  # a row a turn at run time: one row's
                for j in cutlass.range(fold_turns(cfg, 32), unroll=1):  # registers live
                    fold_q_terms(cfg, lane, 32, sQ, ring.sQk, ring.sKf, buf, source(slot, lane), j)
            else:  # every row unrolled
                q_fold(cfg)(cfg, lane, 32, sQ, ring.sQk, ring.sKf, buf, source(slot, lane))
            cute.arch.fence_view_async_shared()  # the wgmma reads Q' through the async proxy
            cute.arch.sync_warp()
            if lane == 0:
                cute.arch.mbarrier_arrive(ring.full + slot)
