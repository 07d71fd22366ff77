"""Launchers of the Triton decode kernels: validation, tiling choice, split count, and the two stages."""
from __future__ import annotations

import functools
import math
import os
from types import MappingProxyType
from typing import NamedTuple

import torch
import triton

from .. import autotune
from .._checks import check_int, check_tensor, decode_out_buffers
from ..cache import QuantKVCache
from ..errors import InvalidArgumentError, UnsupportedError
from ..format import P_UNITS_OFFSET_RATIO, P_UNITS_START, RESCALE_HEADROOM, injection_constants, operand_for
from ..rotation import rotation_factors
from ..problem import DecodeProblem
from ..quantize import FP4_QUANTIZERS, WRITE_KERNEL_QUANTIZERS, check_quantizer, clip_ratio
from ..splitkv import bf16_stage1, combine, num_window_parts, sm_count, window_partials, workspace_for
from .decode import LOG2E, fold_decode_stage1

KERNELS = ("folded", "reconstruct")
BLOCK_N_CHOICES = (64, 32, 16)
#: The folded kernel's lazy rescale (token-wise V of one channel group: ``LAZY`` in
#: :func:`~foscar.triton.decode.fold_decode_stage1`) where a launch names none: off until its speed is measured on
#: a GPU (``docs/triton-perf.md``)
LAZY_RESCALE = False


def takes_lazy_rescale(fmt) -> bool:
    """Whether the folded kernel has a lazy rescale for ``fmt``: token-wise V of one channel group, affine codes."""
    return fmt.v_axis == "token" and fmt.group_size == fmt.head_dim and not fmt.is_fp4


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _check_device(q: torch.Tensor) -> None:
    if q.device.type != "cuda" and not interpreting():
        raise UnsupportedError("backend 'triton'", f"needs a CUDA device (q is on {q.device}); "
                                                   "TRITON_INTERPRET=1 runs it on the CPU")


def _block_n_fits(fmt, page: int, bn: int) -> bool:
    """A KV tile of ``bn`` tokens is whole pack blocks, divides the page and, for a channel-wise axis,
    divides the group (one token group per tile)."""
    if bn not in BLOCK_N_CHOICES or bn % fmt.token_alignment or page % bn:
        return False
    return "channel" not in (fmt.k_axis, fmt.v_axis) or fmt.group_size % bn == 0


def block_n_for(fmt, page: int, rows: int = 1) -> int:
    """The KV tile: the largest of 64/32/16 tokens that fits pages of ``page`` tokens of format ``fmt``
    (:func:`_block_n_fits`), at most 32 where :func:`ptxas_loses_pv_base` holds for ``rows`` rows a program."""
    for bn in BLOCK_N_CHOICES:
        if _block_n_fits(fmt, page, bn) and (bn <= 32 or not ptxas_loses_pv_base(fmt, rows)):
            return bn
    raise UnsupportedError(f"page_size={page}", "no KV tile of 16, 32 or 64 tokens fits it")  # pragma: no cover


@functools.lru_cache(maxsize=1)
def _ptxas_release() -> tuple[int, ...]:
    """The release of the ptxas that Triton builds sm_90 code with (its own, or ``TRITON_PTXAS_PATH``'s); ``()``
    where it cannot be told (before Triton 3.4, which names none; a ptxas that does not answer): taken as affected."""
    try:
        return tuple(int(x) for x in triton.knobs.nvidia.ptxas.version.split("."))
    except Exception:  # noqa: BLE001 - any failure to read the release: the 32-token tiles, correct everywhere
        return ()


def ptxas_loses_pv_base(fmt, rows: int) -> bool:
    """Whether ptxas miscompiles the folded kernel's 64-token tiles for ``fmt`` at ``rows`` rows a program (query
    heads per KV head times a step's tokens): over channel-wise K from 9 rows (both products wgmma) Triton puts
    the Q' and P' operands at the same shared-memory offset, and ptxas before 12.9 (Triton 3.6 bundles 12.8) then
    builds the descriptors of P' past its first 16 tokens from a uniform register that nothing writes: a read out
    of bounds (``benchmarks/sanitize_one.py triton_step_ring``) or of the wrong rows. At 32-token tiles P' has an
    offset of its own."""
    if interpreting() or fmt.is_fp4 or fmt.k_axis != "channel" or rows <= 8:
        return False
    return _ptxas_release()[:2] < (12, 9)


class TritonLaunch(NamedTuple):
    """A folded-kernel launch (:func:`launch_config`)."""

    block_n: int
    num_splits: int
    num_warps: int
    prefetch: int
    lazy_rescale: bool


def launch_config(q: torch.Tensor, cache: QuantKVCache, G: int, *, num_splits: int | None = None,
                  block_n: int | None = None, num_warps: int | None = None, prefetch: int | None = None,
                  use_tuned: bool = True, lazy_rescale: bool | None = None, step: int = 1) -> TritonLaunch:
    """The :class:`TritonLaunch` of a folded-kernel launch: the given values, else the autotune cache's
    (``use_tuned``; an entry may name the lazy rescale), else the heuristics here (:data:`LAZY_RESCALE`). Host facts
    only: no device read. ``step``: the tokens of a step (each program takes ``G step`` rows)."""
    tuned = {}
    if use_tuned:  # a step's own entry, else the one-token decode's
        tuned = (step > 1 and autotune.tuned_config("triton", q, cache, G, step)) or autotune.tuned_config(
            "triton", q, cache, G)
    fmt, page = cache.fmt, cache.page_size
    if block_n is None:  # the largest tile that fits, else a tuned one below it
        block_n = block_n_for(fmt, page, G * step)
        if tuned.get("block_n") is not None and _block_n_fits(fmt, page, tuned["block_n"]):
            block_n = min(tuned["block_n"], block_n)
    num_splits = tuned.get("num_splits") if num_splits is None else num_splits
    num_warps = (tuned.get("num_warps") or 4) if num_warps is None else num_warps
    prefetch = (tuned.get("prefetch") or 1) if prefetch is None else prefetch
    check_int("num_warps", num_warps, allowed=(1, 2, 4, 8))
    check_int("prefetch", prefetch, allowed=(1, 2))
    if not _block_n_fits(fmt, page, block_n):
        raise InvalidArgumentError("block_n", f"a tile of {BLOCK_N_CHOICES} tokens that fits this cache", block_n)
    if num_splits is None:  # from the page table's capacity: known on the host, no device read
        num_splits = default_num_splits(q.shape[0], cache.num_kv_heads, cache.table_capacity // block_n, q.device)
    check_int("num_splits", num_splits, minimum=1)
    if lazy_rescale is None:
        lazy_rescale = tuned.get("lazy_rescale", LAZY_RESCALE)
    if not isinstance(lazy_rescale, bool):
        raise InvalidArgumentError("lazy_rescale", "True, False or None", lazy_rescale)
    return TritonLaunch(block_n, num_splits, num_warps, prefetch, lazy_rescale)


def default_num_splits(batch: int, kv_heads: int, max_tiles: int, device: torch.device) -> int:
    """About sixteen programs per SM (three or four resident at a time keep the tail short), at most 64
    splits and at least four KV tiles per split (each split pays a prologue, an epilogue and a merge
    slot); and where the heads alone fill a wave of four programs per SM with splits of 32 tiles, no
    split shorter than that (``benchmarks/sweep_triton.py``, ``docs/triton-perf.md``)."""
    heads = max(1, batch * kv_heads)
    sms = sm_count(device)
    splits = max(1, min(math.ceil(16 * sms / heads), 64, max_tiles // 4))
    if heads * (max_tiles // 32) >= 4 * sms:
        splits = min(splits, max(math.ceil(4 * sms / heads), max_tiles // 32))
    return max(1, splits)


def max_registers(fmt, prefetch: int = 1, gqa: int = 4) -> int | None:
    """The folded kernel's register cap: 128 (four 4-warp programs per SM instead of three) where ptxas
    fits it without spilling (``benchmarks/sass_stats.py --max-registers 128``, Triton 3.8): head dim
    <= 128, with token-wise groups spanning the head dim, or channel-wise K and V; up to 4 query heads
    per KV head (8 at INT2); with two tiles in flight (``prefetch=2``), INT2 only. Elsewhere: no cap
    (at 16 and 32 query heads per KV head the cap spilled 40-592 bytes per thread)."""
    D = fmt.head_dim
    k_fits = (fmt.k_axis == "token" and fmt.group_size >= D) or fmt.v_axis == fmt.k_axis == "channel"
    v_fits = fmt.v_axis == "channel" or fmt.group_size >= D
    gqa_fits = gqa <= 4 or (gqa <= 8 and fmt.bits == 2)
    fits = D <= 128 and k_fits and v_fits and gqa_fits and (prefetch == 1 or fmt.bits == 2)
    return 128 if fits else None


def merge_chunk(G: int, D: int) -> int:
    """Partials the fused merge reads per step: 2,048 values (16 registers a thread at 4 warps), the most
    that keeps the capped kernels free of spills (``benchmarks/sass_stats.py``)."""
    return max(1, 2048 // (triton.next_power_of_2(G) * D))


def decode(q: torch.Tensor, cache: QuantKVCache, *, sm_scale: float | None = None, out: torch.Tensor | None = None,
           lse: torch.Tensor | None = None, return_lse: bool = False, num_splits: int | None = None,
           kernel: str = "folded", block_n: int | None = None, num_warps: int | None = None, num_stages: int = 1,
           pv_fp16: bool = True, prefetch: int | None = None, fused_combine: bool = True,
           workspace: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None, lazy_rescale: bool | None = None):
    """Decode ``q [B, Hq, D]`` over ``cache`` with the Triton kernels; returns ``out`` (and ``lse``).

    ``kernel="folded"`` is foscar's affine-folded kernel; ``"reconstruct"`` the per-value
    reconstruction baseline of the paper's ablation (same tiling). ``out`` (``[B, Hq, D]``, BF16,
    FP16 or FP32; default ``q``'s dtype) and ``lse`` (``[B, Hq]`` FP32, natural log) may be given.
    ``num_splits``, ``block_n``, ``num_warps``: launch parameters; left ``None``, they come from the
    autotune cache (:mod:`foscar.autotune`, written by ``foscar tune``) or, without a tuned entry, the
    heuristics here; so does ``prefetch``, the KV tiles in flight while one is computed (1 or 2).
    ``pv_fp16``: FP16 PV operands (default; ``False``: BF16, as
    ``decode_folded(operand_dtype=torch.bfloat16)``). ``fused_combine``: the split merge runs in stage 1's
    epilogue (one launch; default) instead of a kernel of its own. ``workspace``: the partial outputs
    and LSEs, ``([B, Hq, parts, D], [B, Hq, parts])`` float32 with ``parts = num_splits + windows``, and
    the fused merge's counters, ``[B * Hkv]`` int32 zeros (:func:`new_workspace`; a
    :class:`foscar.DecodePlan` holds them): the call then allocates nothing. Without it, the counters
    are a zeroed buffer kept per device and stream (they reset themselves after each call).
    ``lazy_rescale``: the folded kernel keeps each row's running maximum and the P' units while no score passes
    the maximum by ``2^8`` and no ``|s'_V|`` passes the units, and rescales only then (token-wise V of one channel
    group; elsewhere it has no effect); ``None``: the autotune cache's, else :data:`LAZY_RESCALE`.
    """
    step = isinstance(q, torch.Tensor) and q.dim() == 4
    if step:  # a step of q_len tokens: its rows, the cache as it is
        from ..multitoken import step_problem
        problem = step_problem(q, cache, sm_scale=sm_scale, out=out, lse=lse, return_lse=return_lse,
                               num_splits=num_splits)
    else:
        problem = DecodeProblem.build(q, cache, sm_scale=sm_scale, out=out, lse=lse, return_lse=return_lse,
                                      num_splits=num_splits)
    solved = problem.in_cache_space() if cache.fmt.is_fp4 else problem  # the FP4 kernel: the cache's space
    run(solved, kernel=kernel, block_n=block_n, num_warps=num_warps, num_stages=num_stages, pv_fp16=pv_fp16,
        prefetch=prefetch, fused_combine=fused_combine, workspace=workspace, lazy_rescale=lazy_rescale)
    problem.finish(solved, lse_wanted=False)
    result = (problem.out, problem.lse) if (return_lse or lse is not None) else problem.out
    if not step:
        return result
    from ..multitoken import unflatten
    return unflatten(result, q.shape[0], problem.q_len)


def run(problem: DecodeProblem, *, num_splits: int | None = None, kernel: str = "folded", block_n: int | None = None,
        num_warps: int | None = None, num_stages: int = 1, pv_fp16: bool = True, prefetch: int | None = None,
        fused_combine: bool = True, workspace: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
        lazy_rescale: bool | None = None) -> None:
    """:func:`decode` of a validated :class:`~foscar.problem.DecodeProblem` (its ``num_splits`` unless given):
    the Triton backend's own checks (a CUDA device or the interpreter, the ``bf16`` mapping, unit-stride
    ``q``), then the launches, writing ``problem.out`` and ``problem.lse``. ``problem.q_len > 1``: its
    ``q``, ``out`` and ``lse`` are a step's rows (``[B q_len, Hq, ...]``, :mod:`foscar.multitoken`) over its
    cache as it is, each program taking all the step's tokens of its KV head (and the BF16 windows' kernel
    too)."""
    q, cache, out, lse, sm_scale, G = problem.q, problem.cache, problem.out, problem.lse, problem.sm_scale, problem.gqa
    _check_device(q)
    fmt = cache.fmt
    if kernel not in KERNELS:
        raise InvalidArgumentError("kernel", f"one of {KERNELS}", repr(kernel))
    if fmt.mapping != "bf16":
        raise UnsupportedError(f"mapping={fmt.mapping!r}", "the Triton kernels build BF16 operands (mapping 'bf16')")
    if q.stride(-1) != 1:
        raise InvalidArgumentError("q", "unit stride in the last dim", tuple(q.stride()))
    if fmt.is_fp4 and kernel != "folded":
        raise UnsupportedError(f"kernel={kernel!r}", f"the {fmt.scheme} kernel is the folded one")
    q_len = problem.q_len
    rows, Hq, D = q.shape
    B = rows // q_len
    Hkv = cache.num_kv_heads
    bn, num_splits, num_warps, prefetch, lazy_rescale = launch_config(
        q[::q_len], cache, G, num_splits=problem.num_splits if num_splits is None else num_splits, block_n=block_n,
        num_warps=num_warps, prefetch=prefetch, use_tuned=kernel == "folded" and not interpreting(),
        lazy_rescale=lazy_rescale, step=q_len)
    parts = num_splits + num_window_parts(fmt)
    o_part, l_part, sem = workspace_for(workspace, rows, Hq, parts, D, q.device, Hkv)
    if q_len > 1 and (out.stride(0) != Hq * out.stride(1) or (lse is not None and lse.stride(0) != Hq * lse.stride(1))
                      or o_part.stride(1) * Hq != o_part.stride(0) or l_part.stride(1) * Hq != l_part.stride(0)):
        fused_combine = False  # the fused merge finds a step's rows as rows of heads
    qk_scale = sm_scale * LOG2E
    interp = interpreting()
    kc, kp, vp = cache.k_codes, cache.k_params, cache.v_params
    bt = cache.page_table.block_table
    cap = max_registers(fmt, prefetch, G * q_len) if num_warps == 4 and kernel == "folded" else None
    regs = {} if interp or cap is None else {"maxnreg": cap}
    rot = rotation_factors(fmt, q.device)  # a rotated cache: stage 1 rotates Q in, the merge the output back
    if fused_combine:  # the windows' partials first: stage 1's last split merges them
        window_partials(q, cache, o_part, l_part, num_splits, qk_scale, G, interp, q_len)
    lse_buf = lse if lse is not None else l_part
    if fmt.is_fp4:
        from .launch_fp4 import launch_stage1_fp4
        launch_stage1_fp4(q, cache, o_part, l_part, out, lse_buf, sem, qk_scale, G, block_n=bn,
                          num_splits=num_splits, num_warps=num_warps, num_stages=num_stages, interpret=interp,
                          fused_combine=fused_combine, write_lse=lse is not None, step=q_len)
    else:
        fold_decode_stage1[(B, Hkv, num_splits)](
            q, kc, cache.v_codes, kp, vp, bt, cache.seq_lens, o_part, l_part, out, lse_buf, sem, rot, qk_scale,
            q.stride(0), q.stride(1), kc.stride(0), kc.stride(1), kp.stride(0), kp.stride(1), vp.stride(0), vp.stride(1),
            bt.stride(0), o_part.stride(0), o_part.stride(1), o_part.stride(2), l_part.stride(0), l_part.stride(1),
            out.stride(0), out.stride(1), lse_buf.stride(0), lse_buf.stride(1),
            **stage1_constexprs(fmt, G, block_n=bn, page=cache.page_size, pv_fp16=pv_fp16, fold=kernel == "folded",
                                interpret=interp, prefetch=prefetch, fused_combine=fused_combine,
                                write_lse=lse is not None, step=q_len, lazy=lazy_rescale),
            num_warps=num_warps, num_stages=num_stages, **regs)
    if not fused_combine:
        window_partials(q, cache, o_part, l_part, num_splits, qk_scale, G, interp, q_len)
        combine(o_part, l_part, out, lse, rot if fmt.rotation is not None else None)


@functools.lru_cache(maxsize=256)  # host time per call: built once per format and launch
def stage1_constexprs(fmt, G: int, *, block_n: int, page: int, pv_fp16: bool = True, fold: bool = True,
                      interpret: bool = False, prefetch: int = 1, fused_combine: bool = True,
                      write_lse: bool = False, step: int = 1, lazy: bool = False) -> MappingProxyType:
    """The constexprs of :func:`fold_decode_stage1` for a format, GQA ratio and launch (one home: the
    launcher and ``benchmarks/sass_stats.py`` compile the same kernel), read-only (they are cached).
    Heads run along N, padded to 8 (a step of ``step`` tokens: its ``G step`` rows). ``lazy``: the lazy rescale,
    where the format takes it (token-wise V of one channel group, the folded kernel)."""
    D = fmt.head_dim
    k_op = operand_for(torch.bfloat16, fmt.bits)
    v_op = operand_for(torch.float16 if pv_fp16 else torch.bfloat16, fmt.bits)
    return MappingProxyType(dict(
        BITS=fmt.bits, D=D, G=G, BLOCK_H=max(8, triton.next_power_of_2(G * step)), BLOCK_N=block_n, PAGE=page,
        GROUP=fmt.group_size, K_TOKEN=fmt.k_axis == "token", V_TOKEN=fmt.v_axis == "token",
        SINK=fmt.sink, RECENT=fmt.recent, FLUSH=fmt.flush,
        **injection_constants("K", k_op, fmt), **injection_constants("V", v_op, fmt),
        PV_F16=pv_fp16, FOLD=fold, INTERPRET=interpret, PREFETCH=prefetch, FUSED_COMBINE=fused_combine,
        WINDOWS=num_window_parts(fmt), MERGE_H=triton.next_power_of_2(G * step), CHUNK=merge_chunk(G * step, D),
        WRITE_LSE=write_lse, P_START=P_UNITS_START, P_OFFSET_RATIO=P_UNITS_OFFSET_RATIO,
        ROTATE=fmt.rotation is not None, STEP=step,
        LAZY=lazy and fold and takes_lazy_rescale(fmt), HEADROOM=RESCALE_HEADROOM))


def decode_bf16(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                seq_lens: torch.Tensor, *, sm_scale: float | None = None, out: torch.Tensor | None = None,
                num_splits: int | None = None, block_n: int = 64, num_warps: int = 4, num_stages: int = 2):
    """Plain BF16 paged decode with the same tiling (the baseline): ``k_cache, v_cache [pages, Hkv, page, D]``,
    ``block_table [B, max_pages]`` int32, ``seq_lens [B]``."""
    _check_device(q)
    check_tensor("q", q, ndim=3, dtypes=(torch.bfloat16, torch.float16))
    B, Hq, D = q.shape
    check_tensor("k_cache", k_cache, ndim=4, dtypes=(q.dtype,), device=q.device)
    _, Hkv, page, Dk = k_cache.shape
    if Dk != D or Hq % Hkv:
        raise InvalidArgumentError("k_cache", f"[pages, Hkv, page, {D}] with Hq={Hq} a multiple of Hkv",
                                   tuple(k_cache.shape))
    check_tensor("v_cache", v_cache, shape=tuple(k_cache.shape), dtypes=(q.dtype,), device=q.device)
    check_tensor("block_table", block_table, ndim=2, dtypes=(torch.int32,), device=q.device)
    check_tensor("seq_lens", seq_lens, shape=(B,), dtypes=(torch.int32,), device=q.device)
    if page % block_n:
        raise InvalidArgumentError("block_n", f"a divisor of the page size {page}", block_n)
    sm_scale = 1.0 / math.sqrt(D) if sm_scale is None else sm_scale
    out, _ = decode_out_buffers(q, out, None, False)
    if num_splits is None:  # from the block table's capacity: no device read
        num_splits = default_num_splits(B, Hkv, block_table.shape[1] * page // block_n, q.device)
    G = Hq // Hkv
    o_part = torch.empty(B, Hq, num_splits, D, dtype=torch.float32, device=q.device)
    l_part = torch.empty(B, Hq, num_splits, dtype=torch.float32, device=q.device)
    bf16_stage1(q, k_cache, v_cache, block_table, torch.zeros_like(seq_lens), seq_lens, o_part, l_part,
                 sm_scale * LOG2E, G, max(16, triton.next_power_of_2(G)), page=page, part0=0, num_splits=num_splits,
                 wrap=False, interp=interpreting(), block_n=block_n, num_warps=num_warps, num_stages=num_stages)
    combine(o_part, l_part, out, None)
    return out


def append_step(cache: QuantKVCache, k_new: torch.Tensor, v_new: torch.Tensor, *, check: bool = True,
                quantizer: str = "minmax") -> None:
    """Append one token per sequence, ``k_new, v_new [B, Hkv, D]``, with the Triton kernel
    (:mod:`foscar.triton.write`): every axis combination, the ``bf16`` mapping, a quantizer of
    :data:`foscar.quantize.WRITE_KERNEL_QUANTIZERS`; the same cache :meth:`QuantKVCache.append` writes, bit for
    bit. ``check=True``
    first runs every check of :meth:`QuantKVCache.append` (capacity and finite values read the device
    back); pass ``check=False`` inside a CUDA graph, where nothing may wait for the host."""
    from .write import append_token_kernel
    B, H, D = cache.batch_size, cache.num_kv_heads, cache.head_dim
    _check_append_inputs(cache, k_new, v_new, (B, H, D), check, quantizer)
    for tensor, x, codes, params, sink, ring, c in _append_tensors(cache, k_new, v_new, quantizer):
        append_token_kernel[(B, H)](
            x, cache.seq_lens, c["bt"], c["np"], codes, params, sink, ring, cache.tensor_scales, cache.ring_from,
            x.stride(0), x.stride(1), c["bt"].stride(0), codes.stride(0), codes.stride(1), params.stride(0),
            params.stride(1), sink.stride(0), sink.stride(1), sink.stride(2), ring.stride(0), ring.stride(1),
            ring.stride(2), **c["constexprs"], ROLLBACK=_ring_rollback(cache.fmt),
            UPDATE_RING=tensor == "k" and cache.fmt.recent_capacity > 0, num_warps=4, enable_fp_fusion=False)
    cache.seq_lens.add_(1)


def append(cache: QuantKVCache, k_new: torch.Tensor, v_new: torch.Tensor, *, check: bool = True,
           quantizer: str = "minmax") -> None:
    """Append ``T`` tokens per sequence, ``k_new, v_new [B, Hkv, T, D]`` (a prefill, or several decode
    tokens), with the Triton kernels: first the tokens that leave the recent window (from the ring or
    straight from the input) are quantized, one program per flush unit, then the sink and ring take the
    rest. Same contract as :func:`append_step`: :meth:`QuantKVCache.append`'s cache, bit for bit; no host
    sync or allocation with ``check=False``."""
    from .write import append_quantize_kernel, append_window_kernel
    B, H, D = cache.batch_size, cache.num_kv_heads, cache.head_dim
    if isinstance(k_new, torch.Tensor) and k_new.dim() == 4:
        T = k_new.shape[2]
    else:
        T = None
    _check_append_inputs(cache, k_new, v_new, (B, H, T, D), check, quantizer)
    if T == 0:
        return
    fmt = cache.fmt
    units = triton.cdiv(T, fmt.flush) + 1  # at most this many flush units leave in one append
    block_t = 16
    tensors = list(_append_tensors(cache, k_new, v_new, quantizer))
    for tensor, x, codes, params, sink, ring, c in tensors:
        append_quantize_kernel[(B, H, units)](
            x, cache.seq_lens, c["bt"], c["np"], codes, params, ring, cache.tensor_scales, T,
            x.stride(0), x.stride(1), x.stride(2), c["bt"].stride(0), codes.stride(0), codes.stride(1),
            params.stride(0), params.stride(1), ring.stride(0), ring.stride(1), ring.stride(2),
            **c["constexprs"], num_warps=4, enable_fp_fusion=False)
    for tensor, x, codes, params, sink, ring, c in tensors:  # after every read of the ring
        k = c["constexprs"]
        append_window_kernel[(B, H, triton.cdiv(T, block_t))](
            x, cache.seq_lens, sink, ring, T, cache.ring_from, x.stride(0), x.stride(1), x.stride(2),
            sink.stride(0), sink.stride(1), sink.stride(2), ring.stride(0), ring.stride(1), ring.stride(2),
            D=D, SINK=k["SINK"], RECENT=k["RECENT"], CAP=k["CAP"], FLUSH=k["FLUSH"], BLOCK_T=block_t,
            ROLLBACK=_ring_rollback(fmt), UPDATE_RING=tensor == "k" and fmt.recent_capacity > 0, num_warps=4)
    cache.seq_lens.add_(T)


def _ring_rollback(fmt) -> int:
    """The append kernels' ``ROLLBACK``: the format's, where it has a ring."""
    return fmt.rollback if fmt.recent_capacity else 0


def _check_append_inputs(cache: QuantKVCache, k_new, v_new, shape: tuple, check: bool, quantizer: str) -> None:
    """What both Triton appends check on the host (no device read), then, with ``check``, everything
    :meth:`QuantKVCache.append` checks (capacity, pages, finite values: device reads)."""
    fmt = cache.fmt
    if fmt.is_fp4:
        check_quantizer(quantizer, FP4_QUANTIZERS, f" (scheme={fmt.scheme!r})")
    else:
        check_quantizer(quantizer, WRITE_KERNEL_QUANTIZERS,
                        " (the Triton append; QuantKVCache.append takes every quantizer)")
    if fmt.mapping != "bf16":
        raise UnsupportedError(f"mapping={fmt.mapping!r}", "the Triton append writes the bf16 mapping's (s', z'); "
                               "QuantKVCache.append covers the others")
    for name, t in (("k_new", k_new), ("v_new", v_new)):
        check_tensor(name, t, shape=shape, dtypes=(torch.float32, torch.float16, torch.bfloat16), device=cache.device)
        _check_device(t)
        if t.stride(-1) != 1:
            raise InvalidArgumentError(name, "unit stride in the last dim", tuple(t.stride()))
    if check:
        if len(shape) == 3:
            cache._check_append(k_new[:, :, None], v_new[:, :, None], quantizer)
        else:
            cache._check_append(k_new, v_new, quantizer)
        if fmt.is_fp4:  # QuantKVCache.append refuses these as it quantizes; the kernels write NaN scales there
            from ..fp4 import check_block_limit
            for name, t, x in (("k_new", "k", k_new), ("v_new", "v", v_new)):
                check_block_limit(x.to(cache.window_dtype) if fmt.passes_window else x, fmt.fp4_spec,
                                  cache.tensor_scale(t), name)


def _append_tensors(cache: QuantKVCache, k_new, v_new, quantizer: str):
    """Per tensor (K, V): its input, pools, windows and the append kernels' shared arguments."""
    fmt = cache.fmt
    pt = cache.page_table
    for tensor, x, codes, params, sink, ring in (("k", k_new, cache.k_codes, cache.k_params, cache.k_sink,
                                                  cache.k_recent),
                                                 ("v", v_new, cache.v_codes, cache.v_params, cache.v_sink,
                                                  cache.v_recent)):
        constexprs = dict(BITS=fmt.bits, D=fmt.head_dim, GROUP=fmt.group_size, PAGE=cache.page_size, SINK=fmt.sink,
                          RECENT=fmt.recent, CAP=max(fmt.recent_capacity, 1), FLUSH=fmt.flush,
                          CHANNEL=fmt.axis(tensor) == "channel", BETA=float(fmt.op.beta), TENSOR_V=tensor == "v",
                          BLOCK_TOKENS=16 if tensor == "k" else 64 // fmt.bits, PASS_WINDOW=fmt.passes_window,
                          RATIO=(clip_ratio(quantizer, tensor) or 1.0) if not fmt.is_fp4 else 1.0, FP4=fmt.is_fp4,
                          E8M0=fmt.is_fp4 and fmt.fp4_spec.scale == "e8m0", SEARCH=quantizer == "mse")
        yield tensor, x, codes, params, sink, ring, {"bt": pt.block_table, "np": pt.num_pages, "constexprs": constexprs}
