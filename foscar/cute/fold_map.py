"""Channel-wise K's operand-fold map (:func:`foscar.cute.folds.fold_q`, :func:`foscar.cute.fold_terms.fold_q_terms`):
which thread builds which channels of ``Q'`` (BF16, or its E4M3 terms), where it reads their ``(s', z')``, and
which of the two ``Q'`` buffers a tile takes. Plain Python (the host tests check the map without a GPU).
"""
from __future__ import annotations

from .config import TILE, THREADS

#: The channels of ``Q'`` one thread builds per query row, in pairs (one 32-bit word of a BF16 row)
#: :func:`fold_channel` spreads over the row, so that a row's ``D / 8`` builders are lanes of one warp and their
#: ``(s', z')`` reads are consecutive 16-byte words
FOLD_CHANNELS = 8
FOLD_PAIRS = FOLD_CHANNELS // 2


def fold_chunk(head_dim: int, t, j: int, threads: int = THREADS):
    """Channel-wise K's ``Q'`` (:func:`foscar.cute.folds.fold_q`) built by ``threads`` threads (whole warps):
    ``(row, c)``, the query row of thread ``t``'s ``j``-th share and its place ``c`` among the row's ``head_dim /
    8`` builders (its channels: :func:`fold_channel`). A row's builders are consecutive lanes of one warp (its
    offset correction is their butterfly sum); a warp's rows are ``warps`` apart, so that its two rows of a
    128-byte swizzled Q^T (head dim 128) sit in opposite halves of the banks. ``threads / (head_dim / 8)`` rows
    are built at once; a row past the kernel's columns is no share."""
    lanes = head_dim // FOLD_CHANNELS
    warps = threads // 32
    lane = t % 32
    return t // 32 + warps * (lane // lanes) + j * (threads // lanes), lane % lanes


def fold_channel(head_dim: int, c, i: int):
    """The ``i``-th channel (``i < FOLD_CHANNELS``) that builder ``c`` of a row folds (:func:`fold_chunk`):
    pair ``i // 2`` is the row's pair ``c + (head_dim / 8) (i // 2)``, so that the builders' ``(s', z')`` of one
    pair (16 bytes each) are consecutive in the group's row and their Q words consecutive in the row."""
    return 2 * (c + (head_dim // FOLD_CHANNELS) * (i // 2)) + i % 2


def fold_param(head_dim: int, c, i: int):
    """The index in a token group's ``(s', z')`` row (channel ``d``: ``s'`` at ``2 d``, ``z'`` at ``2 d + 1``) of
    the ``i``-th float builder ``c`` reads (``i < 2 FOLD_CHANNELS``: :func:`fold_channel` ``i // 2``'s, ``s'``
    at even ``i``)."""
    return 2 * fold_channel(head_dim, c, i // 2) + i % 2


def fold_chunks(cfg, threads: int = THREADS) -> int:
    """The chunks of ``Q'`` each of ``threads`` threads builds (:func:`fold_chunk`, some past the columns)."""
    sets = threads // (cfg.head_dim // FOLD_CHANNELS)
    return (cfg.cols + sets - 1) // sets


def k_fold_buffer(cfg, t0, consumers: int):
    """Channel-wise K: which of the two ``Q'`` buffers the tile at token ``t0`` takes, for a warpgroup that
    computes runs of :attr:`~foscar.cute.config.Sm90Config.tile_run` tiles, one in every ``consumers`` (v0: 1, v1: :data:`~foscar.cute.config.CONSUMERS`)
    from a run-aligned split start: the token groups it visits alternate between the buffers, so that a fold
    writes the buffer its MMAs read two folds before (behind the barrier of the fold between), never the one the
    last fold filled."""
    span = max(cfg.group_size, consumers * cfg.tile_run * TILE)
    if span & (span - 1) == 0:  # a power of two: a shift (t0 >= 0), not a signed division
        return (t0 >> (span.bit_length() - 1)) & 1
    return (t0 // span) & 1


#: E4M3 terms of ``Q'`` (:func:`foscar.cute.fold_terms.fold_q_terms`): the contraction indices one thread builds per
#: query row, one 32-bit word of each term's column
TERM_CHANNELS = 4


def term_chunk(head_dim: int, t):
    """E4M3 terms of ``Q'``: ``(row, k)`` of thread ``t``, which builds contraction indices ``4 k .. 4 k + 3`` of
    query row ``row`` (:func:`term_channels`); a row's ``head_dim / 4`` builders are consecutive lanes of one
    warp (its butterflies stay in the warp)."""
    lanes = head_dim // TERM_CHANNELS
    return t // lanes, t % lanes


def term_channels(bits: int, k):
    """``(d, off)``: the channels at contraction indices ``4 k + v`` of the E4M3 fragment
    (:func:`foscar.e4m3.contraction_order`) are ``d, d + off, d + 1, d + off + 1`` for ``v = 0..3`` (``d``
    even, ``off`` 16 at INT2 and 8 at INT4): two BF16 words of Q and two 16-byte ``(s', z')`` pairs."""
    blk, a = k // 8, k % 4
    if bits == 4:
        return 32 * blk + 16 * ((k % 8) // 4) + 2 * a, 8
    return 32 * blk + 8 * ((k % 8) // 4) + 2 * a, 16
