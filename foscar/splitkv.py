"""Split-KV, the part every GPU backend shares: how a sequence's KV tiles are dealt to splits, the
partials a decode writes (one per split, then one per BF16 window), the workspace that holds them, the
windows' partials (the Triton BF16 kernel, whatever backend wrote the splits) and the LSE combine.

The split rule is :func:`split_ranges`: ``n`` tiles in ``num_splits`` contiguous runs of ``ceil(n /
num_splits)`` tiles (the last ones shorter or empty), that count rounded up to a multiple of ``run`` where a
kernel deals a split's tiles in runs (the CuTe v1 kernel with channel-wise K of token groups of two tiles or more:
:attr:`foscar.cute.config.Sm90Config.tile_run`). :func:`foscar.decode_folded` deals its tiles with
it; the kernels compute the same runs on the device (``foscar.triton.common.split_range``, the CuTe
kernels' split loop), and the tests hold each of them to this one.
"""
from __future__ import annotations

import functools

import torch
import triton

from ._checks import check_int, check_tensor
from .cache import QuantKVCache
from .errors import InvalidArgumentError


def split_ranges(n_tiles: int, num_splits: int, run: int = 1) -> list[range]:
    """The tiles of each split: ``range(s*per, min((s+1)*per, n_tiles))`` with ``per = ceil(n_tiles /
    num_splits)`` rounded up to a multiple of ``run`` (empty ranges for the splits past the end)."""
    check_int("n_tiles", n_tiles, minimum=0)
    check_int("num_splits", num_splits, minimum=1)
    check_int("run", run, minimum=1)
    per = -(-n_tiles // num_splits) if n_tiles else 0
    per = -(-per // run) * run
    return [range(min(s * per, n_tiles), min((s + 1) * per, n_tiles)) for s in range(num_splits)]


@functools.lru_cache(maxsize=16)
def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (4 for the CPU, where the Triton interpreter runs)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def new_workspace(B: int, Hq: int, Hkv: int, parts: int, D: int, device) -> tuple[torch.Tensor, ...]:
    """A decode's workspace: partial outputs ``[B, Hq, parts, D]`` and LSEs ``[B, Hq, parts]`` (float32),
    and the fused merge's counters ``[B * Hkv]`` (int32, zero; each call leaves them zero)."""
    return (torch.empty(B, Hq, parts, D, dtype=torch.float32, device=device),
            torch.empty(B, Hq, parts, dtype=torch.float32, device=device),
            torch.zeros(B * Hkv, dtype=torch.int32, device=device))


def workspace_for(workspace, B: int, Hq: int, parts: int, D: int, device, Hkv: int) -> tuple[torch.Tensor, ...]:
    """The workspace of a call: the given one (checked), else new partial buffers and the shared
    counters of this device and stream (:func:`_counters`)."""
    if workspace is None:
        return (torch.empty(B, Hq, parts, D, dtype=torch.float32, device=device),
                torch.empty(B, Hq, parts, dtype=torch.float32, device=device), _counters(device, B * Hkv))
    if not isinstance(workspace, (tuple, list)) or len(workspace) != 3:
        raise InvalidArgumentError("workspace", "(partial outputs, partial LSEs, counters), as new_workspace makes",
                                   type(workspace).__name__)
    o_part, l_part, sem = workspace
    check_tensor("workspace[0]", o_part, shape=(B, Hq, parts, D), dtypes=(torch.float32,), device=device)
    check_tensor("workspace[1]", l_part, shape=(B, Hq, parts), dtypes=(torch.float32,), device=device)
    check_tensor("workspace[2]", sem, shape=(B * Hkv,), dtypes=(torch.int32,), device=device)
    return o_part, l_part, sem


_COUNTERS: dict = {}


def _counters(device, n: int) -> torch.Tensor:
    """Zeroed int32 counters (at least ``n``) for the fused merge, one buffer per device and stream (two
    streams never share one; every call leaves its counters at zero). Grown by a new zeroed buffer."""
    device = torch.device(device)
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (str(device), stream)
    buf = _COUNTERS.get(key)
    if buf is None or buf.numel() < n:
        buf = _COUNTERS[key] = torch.zeros(max(n, 1024), dtype=torch.int32, device=device)
    return buf[:n]


def num_window_parts(fmt) -> int:
    """The partials the BF16 windows add after the KV splits: one for the sink, one for the recent ring."""
    return int(fmt.sink > 0) + int(fmt.recent_capacity > 0)


def window_partials(q, cache: QuantKVCache, o_part, l_part, part0: int, qk_scale: float, gqa: int,
                    interp: bool, step: int = 1, tail: int = 0) -> None:
    """The BF16 sink and recent ring of ``cache`` as partials ``part0, part0 + 1, ...`` (any backend's
    stage 1 writes the KV splits before them; the combine merges all). ``gqa``: query heads per KV head;
    ``qk_scale``: the softmax scale times log2(e) (the partial LSEs are base 2). ``q`` as the caller has it:
    rotated here into a rotated cache's space (the windows hold rotated values). ``step``: ``q``, ``o_part``
    and ``l_part`` are the rows ``[B step, ...]`` of steps of that many tokens, causal among them
    (:mod:`foscar.multitoken`), ending ``tail`` tokens before the sequence's (a part of a longer step)."""
    G = gqa
    if cache.fmt.rotation is not None and num_window_parts(cache.fmt):
        from .rotation import rotate
        q = rotate(q, cache.fmt, work=torch.float32)
    block_h = max(16, triton.next_power_of_2(G * step))  # a KV head's rows along M in the BF16 kernel
    fmt = cache.fmt
    split = (fmt.sink, fmt.recent, fmt.flush)
    lens = cache.seq_lens  # the kernel derives each window's range from the length: nothing computed here
    part = part0
    if fmt.sink > 0:
        bf16_stage1(q, cache.k_sink, cache.v_sink, None, lens, lens, o_part, l_part, qk_scale, G, block_h,
                    page=cache.k_sink.shape[2], part0=part, num_splits=1, wrap=False, interp=interp, window=1,
                    split=split, step=step, tail=tail)
        part += 1
    if fmt.recent_capacity > 0:
        bf16_stage1(q, cache.k_recent, cache.v_recent, None, lens, lens, o_part, l_part, qk_scale, G, block_h,
                    page=cache.k_recent.shape[2], part0=part, num_splits=1, wrap=True, interp=interp, window=2,
                    split=split, step=step, tail=tail)


def bf16_stage1(q, kb, vb, bt, start, length, o_part, l_part, qk_scale, G, block_h, *, page, part0, num_splits,
                wrap, interp, block_n=16, num_warps=4, num_stages=2, window=0, split=(0, 0, 1), step=1,
                tail=0):
    """Launch :func:`foscar.triton.bf16.bf16_decode_stage1` (plain BF16 attention) over ``kb, vb``: a
    foscar cache's window (``window`` 1 = sink, 2 = recent ring) or a paged BF16 cache."""
    from .triton.bf16 import bf16_decode_stage1
    B, D = q.shape[0] // step, q.shape[2]
    identity = bt is None
    bt_ = start if identity else bt  # unused pointer when the pages are the batch entries
    bf16_decode_stage1[(B, kb.shape[1], num_splits)](
        q, kb, vb, bt_, start, length, o_part, l_part, qk_scale,
        q.stride(0), q.stride(1), kb.stride(0), kb.stride(1), kb.stride(2), vb.stride(0), vb.stride(1), vb.stride(2),
        0 if identity else bt.stride(0), o_part.stride(0), o_part.stride(1), o_part.stride(2),
        l_part.stride(0), l_part.stride(1), part0,
        D=D, G=G, BLOCK_H=block_h, BLOCK_N=block_n, PAGE=page, IDENTITY_PAGES=identity,
        WRAP=wrap, INTERPRET=interp, WINDOW=window, SINK=split[0], RECENT=split[1], FLUSH=split[2], STEP=step,
        TAIL=tail, num_warps=num_warps, num_stages=num_stages)


def combine(o_part, l_part, out, lse, rotation: torch.Tensor | None = None):
    """Merge the partials ``o_part [B, Hq, parts, D]``, ``l_part [B, Hq, parts]`` into ``out`` (and ``lse``)
    with the standalone combine kernel (:func:`foscar.triton.combine.combine_stage2`); ``rotation``
    (:func:`foscar.rotation.rotation_factors`): the partials are in a rotated cache's space, ``out`` is not."""
    from .triton.combine import combine_stage2
    B, Hq, parts, D = o_part.shape
    combine_stage2[(B, Hq)](
        o_part, l_part, out, lse if lse is not None else l_part, rotation if rotation is not None else l_part,
        o_part.stride(0), o_part.stride(1), o_part.stride(2), l_part.stride(0), l_part.stride(1),
        out.stride(0), out.stride(1), lse.stride(0) if lse is not None else 0, lse.stride(1) if lse is not None else 0,
        NUM_PARTS=parts, PARTS_PAD=triton.next_power_of_2(parts), D=D, WRITE_LSE=lse is not None,
        ROTATE=rotation is not None, num_warps=4)
