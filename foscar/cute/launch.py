"""Host side of the CuTe DSL Hopper kernels (issue 4): validation, the compile cache keyed by static
config, the launch of stage 1 and the LSE combine (for now :mod:`foscar.triton.combine`'s).

``backend="cute"`` of :func:`foscar.decode` (and ``"auto"`` on Hopper) runs v0; v1, the
warp-specialized TMA kernel (``warp_specialized=True``), is correct on the H200 but slower
(``docs/results-h200.md``). The first call of a configuration compiles it (reported by
:func:`compile_seconds`)."""
from __future__ import annotations

import torch

from ..cache import QuantKVCache
from ..errors import UnsupportedError
from ..reference import check_decode_inputs, decode_out_buffers

_COMPILED: dict = {}
_COMPILE_SECONDS: dict = {}


def _compiled(cfg, warp_specialized: bool = False, ctas_per_sm: int = 1):
    import time

    from .decode_sm90 import compile_stage1
    key = (cfg, warp_specialized, ctas_per_sm if warp_specialized else 0)
    fn = _COMPILED.get(key)
    if fn is None:
        t0 = time.perf_counter()
        fn = _COMPILED[key] = compile_stage1(cfg, warp_specialized=warp_specialized, ctas_per_sm=ctas_per_sm)
        _COMPILE_SECONDS[key] = time.perf_counter() - t0
    return fn


def compile_seconds() -> dict:
    """Seconds each compiled configuration took to compile in this process (its first call)."""
    return dict(_COMPILE_SECONDS)


#: CTAs resident per SM: v0 (one warpgroup, 127 registers a thread) fits four.
V0_RESIDENT = 4
#: v1's default CTAs per SM (:data:`foscar.cute.decode_sm90.WS_REGISTERS` gives their register budgets).
WS_CTAS_PER_SM = 2


def default_num_splits(batch: int, kv_heads: int, max_tiles: int, device: torch.device,
                       resident: int = V0_RESIDENT) -> int:
    """KV splits per sequence: one wave of resident CTAs (a CTA pays a prologue, an epilogue and a merge
    slot, so short splits cost more than a wave's tail); where the splits of one wave would still be 64
    tiles or longer, up to four waves (a shorter tail), never splits under 64 tiles; at most 64.
    Measured on the H200 (``benchmarks/sweep_cute.py``, ``docs/results-h200.md``): at B = 8, L = 8K,
    8 splits take 40.8 us where 32 (the Triton rule) take 53.6; at B = 64, L = 8K, 1 and 2 splits tie."""
    from ..triton.launch import _sm_count
    heads = max(1, batch * kv_heads)
    one_wave = max(1, resident * _sm_count(device) // heads)  # no CTA left for a second wave
    splits = min(one_wave, max_tiles)
    if max_tiles // one_wave >= 64:
        splits = min(4 * one_wave, max_tiles // 64)
    return max(1, min(splits, 64))


def num_parts(fmt, num_splits: int, warp_specialized: bool = False) -> int:
    """The partials of one (sequence, query head): one per split (v1: one per split and consumer), then the
    BF16 windows'."""
    from ..triton.launch import num_window_parts
    from .decode_sm90 import CONSUMERS
    return (CONSUMERS if warp_specialized else 1) * num_splits + num_window_parts(fmt)


def max_tiles_of(cache: QuantKVCache) -> int:
    from .decode_sm90 import TILE
    return cache.page_table.block_table.shape[1] * cache.page_size // TILE


def decode(q: torch.Tensor, cache: QuantKVCache, *, sm_scale: float | None = None, out: torch.Tensor | None = None,
           lse: torch.Tensor | None = None, return_lse: bool = False, num_splits: int | None = None,
           warp_specialized: bool = False, ctas_per_sm: int | None = None,
           workspace: tuple[torch.Tensor, ...] | None = None):
    """Decode ``q [B, Hq, D]`` over ``cache`` with the CuTe DSL sm_90a kernel; same contract as
    :func:`foscar.triton.decode`. ``warp_specialized``: v1 (TMA producer, two consumer warpgroups, each
    writing its own partial) instead of v0, with ``ctas_per_sm`` (1 or 2; default :data:`WS_CTAS_PER_SM`)
    resident per SM. ``workspace``: the partials as
    :func:`foscar.triton.launch.new_workspace` makes them with :func:`num_parts` parts (what
    :func:`foscar.plan` holds); given, the call allocates nothing (given ``out``)."""
    import cuda.bindings.driver as cuda
    from cutlass import Float32, Int32

    from ..triton.launch import _combine, window_partials, workspace_for
    from .decode_sm90 import as_cute, config_for
    G, sm_scale = check_decode_inputs(q, cache, sm_scale)
    if q.device.type != "cuda" or torch.cuda.get_device_capability(q.device) != (9, 0):
        raise UnsupportedError("backend 'cute'", f"needs an sm_90 GPU (q is on {q.device})")
    fmt = cache.fmt
    cfg = config_for(fmt, G, cache.page_size)
    B = q.shape[0]
    out, lse = decode_out_buffers(q, out, lse, return_lse)
    ctas = WS_CTAS_PER_SM if ctas_per_sm is None else ctas_per_sm
    if num_splits is None:
        num_splits = default_num_splits(B, cache.num_kv_heads, max_tiles_of(cache), q.device,
                                        ctas if warp_specialized else V0_RESIDENT)
    if warp_specialized and (cache.k_codes.stride(-1) != 1 or cache.k_params.stride(-1) != 1):
        raise UnsupportedError("cache", "v1 reads the pools by TMA: unit stride in their last dims")
    parts = num_parts(fmt, num_splits, warp_specialized)  # the BF16 windows: partials after the splits
    o_part, l_part, _ = workspace_for(workspace, B, q.shape[1], parts, fmt.head_dim, q.device, cache.num_kv_heads)
    tensors = (q.to(torch.bfloat16).contiguous(), cache.k_codes, cache.v_codes, cache.k_params, cache.v_params,
               cache.page_table.block_table, cache.seq_lens.to(torch.int32), o_part, l_part)  # Q: BF16 operands
    qk_scale = sm_scale * 1.4426950408889634
    stream = cuda.CUstream(torch.cuda.current_stream(q.device).cuda_stream)  # graph capture sees the launch
    _compiled(cfg, warp_specialized, ctas)(*[as_cute(t) for t in tensors], Float32(qk_scale), Int32(num_splits), stream)
    window_partials(q, cache, o_part, l_part, parts - num_parts(fmt, 0), qk_scale, G, interp=False)
    _combine(o_part, l_part, out, lse)
    return (out, lse) if (return_lse or lse is not None) else out
