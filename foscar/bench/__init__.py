"""Benchmarks and the pieces every timing tool shares (:mod:`foscar.bench.common`): ``foscar bench``
(:mod:`foscar.bench.cli`), the decode speed benchmark (:mod:`foscar.bench.decode`), the accuracy study
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
)

__all__ = ["L2_FLUSH_BYTES", "as_graph", "cache_to", "make_block_table", "one_head_cache", "random_cache",
           "rel_l2", "summarize_us", "time_call"]
