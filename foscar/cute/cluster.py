"""The split merge inside stage 1 (:attr:`~foscar.cute.config.Sm90Config.cluster`, :data:`~foscar.cute.config.
CLUSTER_MERGE`): the splits of one (sequence, KV head) are one thread-block cluster. Each CTA's consumer warpgroups
leave their partials (the output divided by its sum, and the base-2 LSE) in its own shared memory; each CTA then
merges its slice of the head dim (``D / cluster`` channels) of every query row from all the cluster's partials, read
through distributed shared memory, into the output, and CTA 0 writes the LSE: what the combine
(:mod:`foscar.cute.combine`) computes from memory, with no partial leaving the SMs and no second launch.

The consumers alone synchronize the merge, through two mbarriers in each CTA's shared memory (:func:`allocate`) that
every CTA of the cluster arrives on remotely: ``ready`` once its partials are written, ``done`` once it has read its
peers'. A CTA reads its peers' partials past its own ``ready`` and leaves past its own ``done`` (its shared memory
alive while peers read it). The barriers' initialisation is the one cluster barrier: every thread arrives as the
prologue ends (:func:`announce`), and the consumers wait on it before their first remote arrival; the producer
warpgroup takes no other part. The merge's arithmetic is the combine's: empty partials (``lse = -inf``) weigh 0
whatever their output holds; all empty, ``out = 0`` and ``lse = -inf``; a NaN or ``+inf`` LSE, or a NaN output of a
partial that weighs, makes the output and LSE NaN.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int64
from cutlass._mlir.dialects import nvvm

from .config import THREADS, Sm90Config
from .softmax import merged_lse, merged_output, raise_running_maximum

MEM_SCOPE_CLUSTER = nvvm.MemScopeKind.CLUSTER  #: remote arrivals that hand data over: cluster scope


def allocate(alloc, cfg: Sm90Config, consumers: int) -> tuple:
    """This CTA's partials: outputs ``[1, cols, consumers, D]`` and LSEs ``[1, cols, consumers]`` (float32), indexed
    as stage 1's partials in memory are (batch entry 0, the KV head's row, the consumer for the split), so that the
    epilogue (:meth:`foscar.cute.warpgroup.TileKernel._epilogue`) writes either; then the merge's two mbarriers,
    ``ready`` and ``done`` (:func:`init`)."""
    D = cfg.head_dim
    part = alloc.allocate_tensor(Float32, cute.make_layout((1, cfg.cols, consumers, D),
                                                           stride=(0, consumers * D, D, 1)), byte_alignment=16)
    lse = alloc.allocate_tensor(Float32, cute.make_layout((1, cfg.cols, consumers), stride=(0, consumers, 1)),
                                byte_alignment=16)
    bars = alloc.allocate_array(Int64, 2)
    return part, lse, bars


@cute.jit
def init(cfg: Sm90Config, bars):
    """By one thread, with the ring's barriers (before their fence): ``ready`` and ``done`` each expect one arrival
    from every CTA of the cluster."""
    cute.arch.mbarrier_init(bars, cfg.cluster)
    cute.arch.mbarrier_init(bars + 1, cfg.cluster)


@cute.jit
def announce():
    """By every thread of the CTA, past the barriers' initialisation and its fence: the cluster barrier the consumers
    wait on before their first remote arrival (:func:`merge`), so that no peer arrives on a barrier not yet
    initialised. Relaxed: the fence orders the initialisation."""
    cute.arch.cluster_arrive_relaxed()


@cute.jit
def _arrive_everywhere(cfg: Sm90Config, bar, t):
    """Thread ``t == 0`` of the consumers, past their named barrier: this CTA's arrival on ``bar`` in every CTA of the
    cluster, released at cluster scope (every consumer's shared-memory writes and reads before it)."""
    if t == 0:
        cute.arch.fence_acq_rel_cluster()
        for p in cutlass.range_constexpr(cfg.cluster):
            cute.arch.mbarrier_arrive(bar, p, scope=MEM_SCOPE_CLUSTER)


@cute.jit
def _peer_load(buf: cute.Tensor, coord, rank) -> Float32:
    """Element ``coord`` of CTA ``rank``'s ``buf`` (laid out as this CTA's): ``ld.shared::cluster`` at the address
    ``mapa`` gives for it."""
    local = buf.iterator + cute.crd2idx(coord, buf.layout)
    remote = cute.arch.map_dsmem_ptr(local, rank).toint()
    return cute.arch.load(cute.make_ptr(Float32, remote, cute.AddressSpace.smem, assumed_align=4), Float32,
                          ss="cluster")


@cute.jit
def merge(cfg: Sm90Config, consumers: cutlass.Constexpr, sPart: cute.Tensor, sLse: cute.Tensor, bars,
          mO: cute.Tensor, mLSE: cute.Tensor, query_row, bar_id: cutlass.Constexpr):
    """Called by each consumer thread once its partial is in ``sPart``, ``sLse`` (:func:`allocate`, column ``g`` of
    the KV head at row ``g``): they merge channels ``[r D / S, (r + 1) D / S)`` of the KV head's columns (``S`` the
    cluster, ``r`` this CTA's rank) from the ``S consumers`` partials into ``mO [B, rows, D]``, rank 0 the LSE
    (natural log) into ``mLSE [B, rows]``, column ``g`` of KV head ``kvh`` at row ``query_row(g, kvh, n_kvh)``
    (:meth:`foscar.cute.warpgroup.TileKernel.query_row`: a step's tokens too). ``bar_id``: the consumers' named
    barrier. The CTA's place is read again here, so that nothing of it stays live across the tile loop."""
    S = cfg.cluster
    D = cfg.head_dim
    G = cfg.rows
    span = D // S
    n = consumers * THREADS
    rank = cute.arch.block_idx_in_cluster()
    kvh, b, _ = cute.arch.block_idx()
    n_kvh, _, _ = cute.arch.grid_dim()
    tidx, _, _ = cute.arch.thread_idx()
    t = tidx - THREADS  # this thread among the consumers'
    cute.arch.cluster_wait()  # every CTA's barriers initialised (announce)
    cute.arch.barrier(barrier_id=bar_id, number_of_threads=n)  # this CTA's partials written
    _arrive_everywhere(cfg, bars, t)
    cute.arch.mbarrier_wait(bars, 0)  # every CTA's partials written
    cute.arch.fence_acq_rel_cluster()
    for k in cutlass.range_constexpr((G * span + n - 1) // n):
        i = t + k * n
        if i < G * span:
            g = i // span
            ch = rank * span + i % span
            # every partial's LSE and output element in flight together: one round trip to the peers
            lses = [_peer_load(sLse, (0, g, c), p) for p in range(S) for c in range(consumers)]
            outs = [_peer_load(sPart, (0, g, c, ch), p) for p in range(S) for c in range(consumers)]
            m, m_safe, _ = raise_running_maximum(-Float32.inf, lses)
            weights = [cute.math.exp2(x - m_safe, fastmath=True) for x in lses]  # an empty partial weighs 0
            total = Float32(0.0)
            acc = Float32(0.0)
            for j in cutlass.range_constexpr(S * consumers):
                total = total + weights[j]
                if weights[j] > 0:  # an empty partial's output is never read into the sum (it may hold anything)
                    acc = acc + weights[j] * outs[j]
            row = query_row(g, kvh, n_kvh)
            mO[b, row, ch] = merged_output(acc, total).to(mO.element_type)
            if rank == 0 and i % span == 0:
                mLSE[b, row] = merged_lse(m, total)
    cute.arch.barrier(barrier_id=bar_id, number_of_threads=n)  # every read of the peers' partials done
    _arrive_everywhere(cfg, bars + 1, t)
    cute.arch.mbarrier_wait(bars + 1, 0)  # no CTA leaves while a peer may still read its shared memory
