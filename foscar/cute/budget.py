"""The shared memory of a v1 CTA: what its stage ring, Q and P' take (:func:`shared_bytes`), whether
the CTAs resident on an SM hold it (:func:`fits_shared_memory`), and the deepest ring they hold where a launch names no
stages (:func:`default_ring`)."""
from __future__ import annotations

from .config import CONSUMERS, STAGE_CHOICES, TILE, WS_REGISTERS, Sm90Config, as_run, config_for, consumers_for

SM90_SHARED_BYTES = 227 * 1024  #: shared memory one sm_90 SM gives its resident CTAs


def shared_bytes(cfg: Sm90Config, consumers: int = CONSUMERS) -> int:
    """An upper estimate of one v1 CTA's shared memory (``consumers`` of them): the stage ring (codes, ``(s', z')``,
    two mbarriers a slot), Q, channel-wise K each consumer's two ``Q s'``, P' (two with a second V channel group), the
    partials a cluster merges (:mod:`foscar.cute.cluster`), and 8 KB for the reductions, sums and alignment."""
    slot = 4 * (2 * cfg.tile_words + cfg.k_param_words + cfg.v_param_words) + 16
    q_bytes = cfg.cols * cfg.head_dim * 2 * (1 + 2 * consumers if cfg.k_channel and not cfg.producer_fold else 1)
    if cfg.producer_fold:  # each slot's parameters' barrier; the Q' buffers with their corrections, 1 KB aligned
        from .producer_fold import fold_buffer_bytes, fold_buffers
        slot += 8
        q_bytes += fold_buffers(cfg, consumers) * fold_buffer_bytes(cfg) + 1024
    p_bytes = consumers * cfg.vc * TILE * cfg.p_tiles * cfg.cols * 2
    if cfg.fp4_mx:  # each consumer's V scale bits, two buffers of 16 bits a (token, block) of a pass
        p_bytes += consumers * 4 * cfg.fp4_blocks * TILE * cfg.tiles_per_pass
    if cfg.cluster:
        p_bytes += consumers * cfg.cols * (cfg.head_dim + 1) * 4 + 16  # and the merge's two mbarriers
    return cfg.stages * consumers * slot + q_bytes + p_bytes + 8 * 1024


def fits_shared_memory(cfg: Sm90Config, ctas_per_sm: int) -> bool:
    """Whether ``ctas_per_sm`` v1 CTAs of ``cfg`` fit one SM's shared memory (:func:`shared_bytes`)."""
    cfg = as_run(cfg, ctas_per_sm)
    return ctas_per_sm * shared_bytes(cfg, consumers_for(cfg, ctas_per_sm)) <= SM90_SHARED_BYTES


def default_ring(fmt, gqa: int, page: int, k_operand: str = "bf16", tiles_per_pass: int = 1, step: int = 1,
                 ctas_per_sm: int = 2, tail: int = 0) -> Sm90Config:
    """:func:`config_for`'s configuration at the format's default stages, or at the deepest choice below them
    that ``ctas_per_sm`` v1 CTAs of an SM hold (:func:`fits_shared_memory`; the fewest where none does): what a
    launch that names no stages runs, so that a ring never costs the SM a resident CTA (INT2 channel-wise K and
    V at two CTAs an SM: 4 stages, not 8)."""
    if ctas_per_sm not in WS_REGISTERS:
        from ..errors import InvalidArgumentError
        raise InvalidArgumentError("ctas_per_sm", f"one of {sorted(WS_REGISTERS)}", ctas_per_sm)
    cfg = config_for(fmt, gqa, page, k_operand, tiles_per_pass, step, tail=tail)
    for n in sorted((n for n in STAGE_CHOICES if n < cfg.stages), reverse=True):
        if fits_shared_memory(cfg, ctas_per_sm):
            break
        cfg = config_for(fmt, gqa, page, k_operand, tiles_per_pass, step, n, tail)
    return cfg
