"""Host side of the CuTe DSL Hopper kernels (issue 4): validation, the compile cache keyed by static
config, the launch of stage 1 and the LSE combine (for now :mod:`foscar.triton.combine`'s).

``backend="cute"`` of :func:`foscar.decode` runs v0 (validated on the H200); v1, the warp-specialized
TMA kernel (``warp_specialized=True``), compiles for sm_90a and awaits its GPU run. The first call
of a configuration compiles it (reported by :func:`compile_seconds`)."""
from __future__ import annotations

import torch

from ..cache import QuantKVCache
from ..errors import UnsupportedError
from ..reference import check_decode_inputs, decode_out_buffers

_COMPILED: dict = {}
_COMPILE_SECONDS: dict = {}


def _compiled(cfg, warp_specialized: bool = False):
    import time

    from .decode_sm90 import compile_stage1
    key = (cfg, warp_specialized)
    fn = _COMPILED.get(key)
    if fn is None:
        t0 = time.perf_counter()
        fn = _COMPILED[key] = compile_stage1(cfg, warp_specialized=warp_specialized)
        _COMPILE_SECONDS[key] = time.perf_counter() - t0
    return fn


def compile_seconds() -> dict:
    """Seconds each compiled configuration took to compile in this process (its first call)."""
    return dict(_COMPILE_SECONDS)


def decode(q: torch.Tensor, cache: QuantKVCache, *, sm_scale: float | None = None, out: torch.Tensor | None = None,
           lse: torch.Tensor | None = None, return_lse: bool = False, num_splits: int | None = None,
           warp_specialized: bool = False):
    """Decode ``q [B, Hq, D]`` over ``cache`` with the CuTe DSL sm_90a kernel; same contract as
    :func:`foscar.triton.decode`. ``warp_specialized``: v1 (TMA producer, two consumer warpgroups, each
    writing its own partial) instead of v0."""
    import cuda.bindings.driver as cuda
    from cutlass import Float32, Int32

    from ..triton.launch import _combine, default_num_splits, num_window_parts, window_partials
    from .decode_sm90 import CONSUMERS, TILE, as_cute, config_for
    G, sm_scale = check_decode_inputs(q, cache, sm_scale)
    if q.device.type != "cuda" or torch.cuda.get_device_capability(q.device) != (9, 0):
        raise UnsupportedError("backend 'cute'", f"needs an sm_90 GPU (q is on {q.device})")
    fmt = cache.fmt
    cfg = config_for(fmt, G, cache.page_size)
    B = q.shape[0]
    out, lse = decode_out_buffers(q, out, lse, return_lse)
    if num_splits is None:
        max_tiles = cache.page_table.block_table.shape[1] * cache.page_size // TILE
        num_splits = default_num_splits(B, cache.num_kv_heads, max_tiles, q.device)
    per_split = CONSUMERS if warp_specialized else 1  # v1: one partial per consumer warpgroup
    if warp_specialized and (cache.k_codes.stride(-1) != 1 or cache.k_params.stride(-1) != 1):
        raise UnsupportedError("cache", "v1 reads the pools by TMA: unit stride in their last dims")
    parts = per_split * num_splits + num_window_parts(fmt)  # the BF16 windows: partials after the splits
    o_part = torch.empty(B, q.shape[1], parts, fmt.head_dim, dtype=torch.float32, device=q.device)
    l_part = torch.empty(B, q.shape[1], parts, dtype=torch.float32, device=q.device)
    tensors = (q.contiguous(), cache.k_codes, cache.v_codes, cache.k_params, cache.v_params,
               cache.page_table.block_table, cache.seq_lens.to(torch.int32), o_part, l_part)  # lengths: read on device
    qk_scale = sm_scale * 1.4426950408889634
    stream = cuda.CUstream(torch.cuda.current_stream(q.device).cuda_stream)  # graph capture sees the launch
    _compiled(cfg, warp_specialized)(*[as_cute(t) for t in tensors], Float32(qk_scale), Int32(num_splits), stream)
    window_partials(q, cache, o_part, l_part, per_split * num_splits, qk_scale, G, interp=False)
    _combine(o_part, l_part, out, lse)
    return (out, lse) if (return_lse or lse is not None) else out
