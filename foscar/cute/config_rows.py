"""Which formats and shapes the rows kernel (:mod:`foscar.cute.kernel_rows`: the query rows as the M of both
products) takes, and its static configuration. Plain Python, like :mod:`foscar.cute.config`: the host side
decides without importing cutlass-dsl."""
from __future__ import annotations

import functools
from dataclasses import replace

from .config import CONSUMERS, HEADS, MAX_COLS, SM90_SHARED_BYTES, TILE, Sm90Config, config_for

#: Whether ``foscar.decode`` runs the rows kernel where it takes the shape and the query rows of a KV head are
#: at least :data:`ROWS_M_FROM` (:func:`default_rows_m`)
ROWS_AS_M = True
#: The fewest query rows of a KV head (heads times the step's tokens) that the rows kernel runs by default:
#: up to 8 the N columns of ``S^T = K Q^T`` cost the tile step less than the 64 M rows it pads to
ROWS_M_FROM = 2 * HEADS + 1
#: The rows kernel's stages per consumer unless a launch asks (its operand slots take the room of a deeper ring)
ROWS_STAGES = 4
#: What the rows kernel takes beyond :func:`foscar.cute.config.config_for`
ROWS_LIMITS = ("the rows kernel takes token-wise K and V with one channel group (group size = head dim), head "
               f"dim 64/128, at most {MAX_COLS} query rows per KV head, affine codes and no rotation")


@functools.lru_cache(maxsize=256)
def rows_config(fmt, gqa: int, page: int, step: int = 1, stages: int | None = None) -> Sm90Config:
    """The rows kernel's configuration (:attr:`~foscar.cute.config.Sm90Config.rows_m`): :func:`config_for`'s
    with BF16 K operands and one tile a pass, or ``UnsupportedError`` naming what it does not take
    (:data:`ROWS_LIMITS`)."""
    from ..errors import UnsupportedError
    if (fmt.is_fp4 or fmt.k_axis != "token" or fmt.v_axis != "token" or fmt.group_size != fmt.head_dim
            or fmt.head_dim not in (64, 128) or fmt.rotation is not None):
        raise UnsupportedError(f"k_axis={fmt.k_axis!r}, v_axis={fmt.v_axis!r}, group_size={fmt.group_size}, "
                               f"head_dim={fmt.head_dim}, rotation={fmt.rotation!r}", ROWS_LIMITS)
    cfg = config_for(fmt, gqa, page, "bf16", 1, step, ROWS_STAGES if stages is None else stages)
    assert cfg.k_pivots[0] == cfg.k_pivots[1] and cfg.k_factors == (1.0, 1.0)  # BF16 K by injection
    return replace(cfg, rows_m=True, lazy_rescale=True)


def takes_rows(fmt, gqa: int, page: int, step: int = 1) -> bool:
    """Whether the rows kernel takes the format, GQA ratio, page size and query tokens per sequence."""
    from ..errors import InvalidArgumentError, UnsupportedError
    try:
        rows_config(fmt, gqa, page, step)
    except (UnsupportedError, InvalidArgumentError):
        return False
    return True


def default_rows_m(fmt, gqa: int, page: int, step: int = 1) -> bool:
    """Whether an untuned launch runs the rows kernel: :data:`ROWS_AS_M`, at least :data:`ROWS_M_FROM` query rows
    of a KV head, and a shape it takes."""
    return ROWS_AS_M and gqa * step >= ROWS_M_FROM and takes_rows(fmt, gqa, page, step)


def rows_fit(cfg: Sm90Config) -> bool:
    """Whether one CTA of the rows kernel fits an SM's shared memory: the stage ring (codes, ``(s', z')`` and
    two mbarriers a slot), Q (64 M rows), the operand slots (K, V^T, the token table: two per consumer), 1 KB for
    ``sum(Q)``, the barriers and alignment."""
    slot = 4 * (2 * cfg.tile_words + cfg.k_param_words + cfg.v_param_words) + 16
    operands = TILE * cfg.head_dim * 2 * (1 + 2 * 2 * CONSUMERS) + 2 * CONSUMERS * (16 * TILE + 8)
    return cfg.stages * CONSUMERS * slot + operands + 1024 <= SM90_SHARED_BYTES
