"""Launch of the FP4 block formats' stage 1 (:func:`foscar.triton.decode_fp4.fp4_decode_stage1`); the rest of a
decode (the launch choice, the workspace, the BF16 windows, the merge) is :func:`foscar.triton.launch.run`'s."""
from __future__ import annotations

import functools
from types import MappingProxyType

import triton

from ..splitkv import num_window_parts
from .decode_fp4 import fp4_decode_stage1


def launch_stage1_fp4(q, cache, o_part, l_part, out, lse_buf, sem, qk_scale: float, G: int, *, block_n: int,
                      num_splits: int, num_warps: int, num_stages: int, interpret: bool, fused_combine: bool,
                      write_lse: bool, step: int) -> None:
    """One launch of the FP4 stage 1 over ``cache`` (an NVFP4 or MXFP4 :class:`~foscar.QuantKVCache`), grid
    ``(B, Hkv, num_splits)``, into the partials ``o_part, l_part`` (and, fused, ``out`` and ``lse_buf``)."""
    kc, ks, vs = cache.k_codes, cache.k_params, cache.v_params
    bt = cache.page_table.block_table
    B = q.shape[0] // step
    fp4_decode_stage1[(B, cache.num_kv_heads, num_splits)](
        q, kc, cache.v_codes, ks, vs, bt, cache.seq_lens, cache.tensor_scales, o_part, l_part, out, lse_buf, sem,
        qk_scale, q.stride(0), q.stride(1), kc.stride(0), kc.stride(1), ks.stride(0), ks.stride(1), vs.stride(0),
        vs.stride(1), bt.stride(0), o_part.stride(0), o_part.stride(1), o_part.stride(2), l_part.stride(0),
        l_part.stride(1), out.stride(0), out.stride(1), lse_buf.stride(0), lse_buf.stride(1),
        **stage1_constexprs_fp4(cache.fmt, G, block_n=block_n, page=cache.page_size, interpret=interpret,
                                fused_combine=fused_combine, write_lse=write_lse, step=step),
        num_warps=num_warps, num_stages=num_stages, **register_cap(G * step, num_warps, interpret))


def register_cap(rows: int, num_warps: int, interpret: bool) -> dict:
    """``maxnreg=128`` (four 4-warp programs per SM instead of three) where ptxas fits the FP4 stage 1 in it
    without spilling: up to 8 query rows per KV head (``python benchmarks/sass_stats.py --scheme nvfp4 --gqa G
    --max-registers 128``, Triton 3.8: 135 and 129 registers uncapped at 4 and 8 rows, 56 bytes spilled at 16)."""
    return {"maxnreg": 128} if rows <= 8 and num_warps == 4 and not interpret else {}


@functools.lru_cache(maxsize=256)
def stage1_constexprs_fp4(fmt, G: int, *, block_n: int, page: int, interpret: bool = False,
                          fused_combine: bool = True, write_lse: bool = False, step: int = 1) -> MappingProxyType:
    """The constexprs of :func:`fp4_decode_stage1` for a format, GQA ratio and launch (read-only: cached)."""
    from .launch import merge_chunk
    spec = fmt.fp4_spec
    return MappingProxyType(dict(
        D=fmt.head_dim, G=G, BLOCK_H=max(8, triton.next_power_of_2(G * step)), BLOCK_N=block_n, PAGE=page,
        BLOCK=spec.block, E8M0=spec.scale == "e8m0", SINK=fmt.sink, RECENT=fmt.recent, FLUSH=fmt.flush,
        INTERPRET=interpret, FUSED_COMBINE=fused_combine, WINDOWS=num_window_parts(fmt),
        MERGE_H=triton.next_power_of_2(G * step), CHUNK=merge_chunk(G * step, fmt.head_dim), WRITE_LSE=write_lse,
        STEP=step))
