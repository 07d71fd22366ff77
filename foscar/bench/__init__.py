"""Benchmarks and the pieces every timing tool shares (:mod:`foscar.bench.common`, and the one driver that
checks then times a candidate, :mod:`foscar.bench.measure`): ``foscar bench`` (:mod:`foscar.bench.cli`),
the decode speed benchmark (:mod:`foscar.bench.decode`, its command line; :mod:`~foscar.bench.grid`,
:mod:`~foscar.bench.inputs`, :mod:`~foscar.bench.kernels`, :mod:`~foscar.bench.ceiling`,
:mod:`~foscar.bench.speed` and :mod:`~foscar.bench.report` its parts), the accuracy study
(:mod:`foscar.bench.accuracy`) and the affine-operation count (:mod:`foscar.bench.ops`)."""
from .common import (
    L2_FLUSH_BYTES,
    as_graph,
    cache_to,
    make_block_table,
    one_head_cache,
    random_cache,
    rel_l2,
    summarize_us,
    time_call,
    time_interleaved,
)
from .measure import SLICE_FACTOR, SliceCheck, measure, slice_check

__all__ = ["L2_FLUSH_BYTES", "SLICE_FACTOR", "SliceCheck", "as_graph", "cache_to", "make_block_table", "measure",
           "one_head_cache", "random_cache", "rel_l2", "slice_check", "summarize_us", "time_call",
           "time_interleaved"]
