"""v1's stage ring: where the producer puts a split's tiles and where each consumer finds them
(:class:`~foscar.cute.kernel_v1.FoldDecodeSm90WS`). Each consumer has ``stages`` slots; consumers take alternating
tiles, or alternating runs of two tiles of one token group (``Sm90Config.tile_run``), and with two tiles a softmax
pass the consumer's next two (:func:`pass_tiles`). The index functions take DSL values while the kernel is traced
and Python ints on the host (the tests check the orders against each other); :class:`StageRing` holds the ring's
shared-memory tensors.
"""
from __future__ import annotations


def ring_slot(c, k, stages: int):
    """The slot of consumer ``c``'s ``k``-th tile (``k >= 0``) in a ring of ``stages`` (a power of two) per
    consumer: ``c * stages + k % stages`` as a mask (a signed ``%`` costs the loop a sign fix of a dozen
    uniform instructions)."""
    assert stages & (stages - 1) == 0
    return c * stages + (k & (stages - 1))


def ring_tile(i, run: int, consumers: int = 2):
    """``(consumer, k)`` of a split's ``i``-th tile (``i >= 0``): runs of ``run`` consecutive tiles (1 or 2,
    :attr:`~foscar.cute.config.Sm90Config.tile_run`; 2 with two consumers only) go to the ``consumers`` in turn,
    ``k`` the tile's place in its consumer's sequence."""
    assert run in (1, 2) and (run == 1 or consumers == 2)
    if consumers == 3:
        return i % 3, i // 3
    if run == 1:
        return i & 1, i >> 1
    return (i >> 1) & 1, ((i >> 2) << 1) | (i & 1)


def run_tile(c, k, run: int):
    """The split's tile index ``i`` of consumer ``c``'s ``k``-th tile: :func:`ring_tile`'s inverse."""
    assert run in (1, 2)
    if run == 1:
        return (k << 1) + c
    return ((k >> 1) << 2) + (c << 1) + (k & 1)


def pass_tiles(i, run: int, consumers: int = 2):
    """Two tiles a pass: ``(k, i_b)`` of the pass whose tile A is the split's ``i``-th tile (``i = run c + 2 n j`` for
    consumer ``c``'s ``j``-th pass, ``n`` consumers): tile A's place ``k`` (even) in its consumer's sequence, tile B
    the ``i_b``-th (the consumer's next: ``k + 1``, :func:`ring_tile`); runs of two keep both in one token group."""
    assert run in (1, 2) and (run == 1 or consumers == 2)
    if consumers == 3:
        return i // 3, i + 3
    if run == 1:
        return i >> 1, i + 2
    return (i >> 2) << 1, i + 1


def split_tiles_each(n_tiles, n_splits, run: int):
    """The tiles of each of ``n_splits`` splits of ``n_tiles`` (the last split takes what is left): equal runs, each
    a multiple of ``run`` tiles (:attr:`~foscar.cute.config.Sm90Config.tile_run`), so that no run of two crosses a
    split."""
    per = (n_tiles + n_splits - 1) // n_splits
    if run > 1:
        per = (per + run - 1) // run * run
    return per


def run_bound(n):
    """A bound of the ``k`` of either consumer's tiles of a split of ``n`` tiles (none where ``n <= 0``) in runs of
    two (:func:`ring_tile`): the loop runs to it and skips the ``k`` whose tile is past the split's end (the exact
    count, a clamp of ``n % 4``, left the tile loop a spilled register)."""
    return (n + 3) >> 1


def fold_buffer(slot, tiles_per_pass: int):
    """Where the producer folds ``Q'`` (:attr:`~foscar.cute.config.Sm90Config.producer_fold`): the ``Q'`` buffer of
    the tile in ring slot ``slot``, one a slot, or with two tiles a pass one a pass (tile A's slot, even)."""
    return slot >> (tiles_per_pass - 1)


def ring_phase(k, stages: int):
    """The mbarrier phase of a consumer's ``k``-th tile (``k >= 0``): ``(k // stages) % 2``."""
    return (k >> (stages.bit_length() - 1)) & 1


class StageRing:
    """The shared-memory stages of both consumers (slot :func:`ring_slot` ``(c, k)`` holds consumer ``c``'s
    ``k``-th tile): packed K and V words (``sK``, ``sV``), their ``(s', z')`` (``sKP``, ``sVP``), and the
    full and empty mbarriers of each slot."""

    def __init__(self, sK, sV, sKP, sVP, full, empty, kpar=None, sQk=None, sKf=None):
        self.kpar = kpar  # producer_fold: each slot's barrier of its K (s', z') copy
        self.sQk = sQk  # producer_fold: each slot's Q' and its offset corrections
        self.sKf = sKf
        self.sK = sK
        self.sV = sV
        self.sKP = sKP
        self.sVP = sVP
        self.full = full
        self.empty = empty
