"""Host side of the CuTe DSL Hopper kernels: the compiled kernels keyed by static config (in this process,
then on disk: :mod:`foscar.cute.compile_cache`), the launch of stage 1, then the windows' partials of
:mod:`foscar.splitkv` (formats with windows), then the CuTe LSE combine (:mod:`foscar.cute.combine`).

``backend="cute"`` of :func:`foscar.decode` (and ``"auto"`` on Hopper, token-wise K) runs the variant,
CTAs per SM and split count of the autotune cache (``foscar tune --backend cute``), else v1, the
warp-specialized TMA kernel at two CTAs per SM (measured in ``docs/results-h200.md``). Stage 1 is called
through TVM-FFI (torch tensors as they are, torch's current stream). The first call of a configuration in
a process compiles it or loads it from the disk cache (:func:`compile_seconds` reports which, and how
long)."""
from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import torch

from ..cache import QuantKVCache
from ..errors import InvalidArgumentError, UnsupportedError
from ..problem import DecodeProblem

_COMPILED: dict = {}  # (cfg, warp_specialized, ctas_per_sm or 0) -> the stage-1 function
_COMPILE_RECORDS: dict = {}  # the same keys -> compile_cache.CompileRecord of the first call


def _compiled(cfg, warp_specialized: bool = False, ctas_per_sm: int = 1):
    """The compiled function of ``cfg`` (a stage-1 ``Sm90Config`` and the variant, or a ``CombineConfig``):
    this process's, else the disk compile cache's (:func:`foscar.cute.compile_cache.load_or_compile`:
    loaded, or compiled and written)."""
    key = (cfg, warp_specialized, ctas_per_sm if warp_specialized else 0)
    fn = _COMPILED.get(key)
    if fn is None:
        from .compile_cache import load_or_compile
        fn, _COMPILE_RECORDS[key] = load_or_compile(cfg, warp_specialized, ctas_per_sm)
        _COMPILED[key] = fn
    return fn


def compile_seconds(detail: bool = False) -> dict:
    """Seconds the first call of each configuration of this process took to get its kernel (compiled,
    or loaded from the disk compile cache), by ``(cfg, warp_specialized, ctas_per_sm or 0)``.
    ``detail``: each value is its :class:`foscar.cute.compile_cache.CompileRecord` instead (``source``
    ``"disk"`` or ``"compiled"``; compile, load and store seconds apart; the entry's path)."""
    return {k: (r if detail else r.seconds) for k, r in _COMPILE_RECORDS.items()}


#: CTAs resident per SM: v0 (one warpgroup, 127 registers a thread) fits four.
V0_RESIDENT = 4
#: v1's default CTAs per SM (:data:`foscar.cute.config.WS_REGISTERS` gives their register budgets):
#: two, four consumer warpgroups per SM (faster than one CTA on the paper grid but at B = 1, 8K:
#: ``docs/results-h200.md``).
WS_CTAS_PER_SM = 2


#: Tiles a split keeps before the split heuristic takes more than one wave of CTAs: the split counts the tuner chose
#: on the H200 (``docs/bench/h200/tune-cute.log``: one wave up to 512 tiles a split, B 8 and 64 at L 32K 2.5-7%
#: faster than four waves of 64 tiles or more; at L 64K-512K splits of about 512 tiles)
LONG_SPLIT_TILES = 512


def default_num_splits(batch: int, kv_heads: int, max_tiles: int, device: torch.device,
                       resident: int = V0_RESIDENT, waves: int = 4) -> int:
    """KV splits per sequence: one wave of resident CTAs (a CTA pays a prologue, an epilogue and a merge
    slot, so short splits cost more than a wave's tail); where the splits of one wave would be longer than
    :data:`LONG_SPLIT_TILES`, splits of about that many tiles, up to ``waves`` waves; at most 64.
    ``waves``: the most waves (1 for 16 and 32 query rows a KV head, :func:`default_waves`)."""
    from ..splitkv import sm_count
    heads = max(1, batch * kv_heads)
    one_wave = max(1, resident * sm_count(device) // heads)  # no CTA left for a second wave
    splits = min(one_wave, max_tiles)
    if max_tiles > LONG_SPLIT_TILES * one_wave and waves > 1:
        splits = min(waves * one_wave, -(-max_tiles // LONG_SPLIT_TILES))
    return max(1, min(splits, 64))


#: The variant a call runs when neither the caller nor the autotune cache says: v1 (warp-specialized), the
#: faster at every shape of the paper grid but one (B 1, 8K, where the tuner may take v0).
DEFAULT_WARP_SPECIALIZED = True


class LaunchConfig(NamedTuple):
    """What one CuTe decode launches: the variant (v1 or v0) and CTAs per SM, the split count, the K
    operands, the KV tiles per softmax pass and v1's stages per consumer (``None``: the format's default,
    :func:`foscar.cute.config.default_stages`)."""

    warp_specialized: bool
    ctas_per_sm: int
    num_splits: int
    k_operand: str
    tiles_per_pass: int
    stages: int | None = None


def launch_config(q: torch.Tensor, cache: QuantKVCache, G: int, *, num_splits: int | None = None,
                  warp_specialized: bool | None = None, ctas_per_sm: int | None = None,
                  k_operand: str | None = None, tiles_per_pass: int | None = None,
                  stages: int | None = None, use_tuned: bool = True, step: int = 1, tail: int = 0) -> LaunchConfig:
    """The :class:`LaunchConfig` of a launch (``step``: query tokens per sequence, ``q`` their rows; ``tail``: a
    part of a longer step, :attr:`~foscar.cute.config.Sm90Config.tail`): the given values, else the autotune
    cache's (backend ``"cute"``, keyed by ``step`` as well; a part of a longer step takes none; only where its entry
    is the variant asked for), else :data:`DEFAULT_WARP_SPECIALIZED`, :func:`default_ctas_per_sm`,
    :func:`default_num_splits` and, for v1, E4M3 K operands and two tiles per softmax pass where the format
    takes them (:func:`default_variant`); v0 takes BF16 K operands and one tile per pass. ``stages`` (v1's
    pipeline depth): the given value, else the tuned entry's, else the format's default. Host facts only: no
    device read."""
    from .. import autotune
    from .._checks import check_int
    if warp_specialized is not None and not isinstance(warp_specialized, bool):
        raise InvalidArgumentError("warp_specialized", "True, False or None", warp_specialized)
    tuned = autotune.tuned_config("cute", q, cache, G, step) if use_tuned and not tail else {}
    if tuned and not _same_variant(tuned, warp_specialized, ctas_per_sm, k_operand, tiles_per_pass):
        tuned = {}  # its split count was tuned for another variant than the one asked for
    if warp_specialized is None:
        warp_specialized = tuned.get("warp_specialized")
        warp_specialized = DEFAULT_WARP_SPECIALIZED if warp_specialized is None else bool(warp_specialized)
    if ctas_per_sm is None:
        ctas_per_sm = tuned.get("ctas_per_sm") or default_ctas_per_sm(G * step, cache.fmt.head_dim)
    check_int("ctas_per_sm", ctas_per_sm, allowed=(1, 2))
    default_k, default_tiles = ("bf16", 1) if tuned or not warp_specialized else default_variant(
        cache.fmt, G, cache.page_size, k_operand, step, tail)
    if k_operand is None:
        k_operand = tuned.get("k_operand", default_k)
    if tiles_per_pass is None:
        tiles_per_pass = tuned.get("tiles_per_pass", default_tiles)
    check_int("tiles_per_pass", tiles_per_pass, allowed=(1, 2))
    if tiles_per_pass == 2 and not warp_specialized:
        raise InvalidArgumentError("tiles_per_pass", "1 with warp_specialized=False (two tiles per pass are v1's)",
                                   tiles_per_pass)
    if num_splits is None:
        num_splits = tuned.get("num_splits")
    if num_splits is None:
        num_splits = default_num_splits(cache.batch_size, cache.num_kv_heads, max_tiles_of(cache), q.device,
                                        ctas_per_sm if warp_specialized else V0_RESIDENT, default_waves(G * step))
    check_int("num_splits", num_splits, minimum=1)
    if stages is None:
        stages = tuned.get("stages")
    if stages is not None:
        from .config import STAGE_CHOICES
        check_int("stages", stages, allowed=STAGE_CHOICES)  # an int: config_for's cache takes 8.0 for 8
        if not warp_specialized:
            raise InvalidArgumentError("stages", "None with warp_specialized=False (the stage ring is v1's)", stages)
    return LaunchConfig(warp_specialized, ctas_per_sm, num_splits, k_operand, tiles_per_pass, stages)


def default_ctas_per_sm(rows: int, head_dim: int = 128) -> int:
    """v1's CTAs per SM for ``rows`` query rows per KV head: :data:`WS_CTAS_PER_SM` at the column counts of
    :data:`foscar.cute.config.TWO_CTA_COLUMNS` (8 and 16), one at 32 and at head dim 256 (the accumulators of 32
    columns, the A fragments of 256 channels take the registers of one CTA per SM,
    :data:`foscar.cute.config.WS_REGISTERS`). GQA 16 runs faster at two CTAs though 16 columns spill there,
    GQA 32 at one (``benchmarks/sweep_rows.py``, ``docs/bench/h200/sweep-rows.md``)."""
    from . import config
    two = config.columns_for(rows) in config.TWO_CTA_COLUMNS and head_dim <= 128
    return WS_CTAS_PER_SM if two else 1


def default_waves(rows: int) -> int:
    """The most waves of CTAs :func:`default_num_splits` fills: 4, one beyond 8 query rows a KV head
    (the faster split count at GQA 16 and 32 in the record of :func:`default_ctas_per_sm`)."""
    from .config import HEADS
    return 4 if rows <= HEADS else 1


@functools.lru_cache(maxsize=256)  # host time per call: a refusal is an exception, which config_for does not cache
def default_variant(fmt, G: int, page: int, k_operand: str | None = None, step: int = 1,
                    tail: int = 0) -> tuple[str, int]:
    """``(k_operand, tiles_per_pass)`` of an untuned v1 launch: E4M3 K operands (unless ``k_operand`` is
    given) and two tiles per softmax pass, each where the format takes it (:func:`takes`; E4M3 K with one tile a
    pass where it takes no pair, before BF16 K).
    Both are what the tuner picks in most paper cases (``docs/results-h200.md``); beyond 4 query rows (Q's terms
    in separate column blocks, ``Sm90Config.term_blocks``) E4M3 K is faster than BF16 K at GQA 8, 16 and 32
    (``docs/bench/h200/rows-e4m3.md``, ``docs/bench/h200/heads-e4m3-32.md``)."""
    for k in (k_operand,) if k_operand else ("e4m3", "bf16"):
        for tiles in (2, 1):
            if takes(fmt, G, page, k, tiles, step, tail):
                return k, tiles
    return k_operand or "bf16", 1


def takes(fmt, G: int, page: int, k_operand: str, tiles_per_pass: int, step: int = 1, tail: int = 0) -> bool:
    """Whether the kernels take the format with these K operands, tiles per pass and query tokens per
    sequence (and ``tail``) (:func:`foscar.cute.config.config_for` does not refuse them)."""
    from .config import config_for
    try:
        config_for(fmt, G, page, k_operand, tiles_per_pass, step, tail=tail)
    except (UnsupportedError, InvalidArgumentError):
        return False
    return True


def _same_variant(tuned: dict, warp_specialized: bool | None, ctas_per_sm: int | None,
                  k_operand: str | None = None, tiles_per_pass: int | None = None) -> bool:
    """Whether a tuned entry is the variant the caller asked for (``None``: any)."""
    tuned_ws = bool(tuned.get("warp_specialized", DEFAULT_WARP_SPECIALIZED))
    if warp_specialized is not None and warp_specialized != tuned_ws:
        return False
    if k_operand is not None and k_operand != tuned.get("k_operand", "bf16"):
        return False
    if tiles_per_pass is not None and tiles_per_pass != tuned.get("tiles_per_pass", 1):
        return False
    return ctas_per_sm is None or not tuned_ws or tuned.get("ctas_per_sm", WS_CTAS_PER_SM) == ctas_per_sm


def num_parts(fmt, num_splits: int, warp_specialized: bool = False, consumers: int | None = None) -> int:
    """The partials of one (sequence, query head): one per split (v1: one per split and consumer, ``consumers``
    of them, :data:`~foscar.cute.config.CONSUMERS` unless given: :func:`split_partials`), then the BF16 windows'
    where the combine does not attend them itself (:data:`~foscar.cute.config.COMBINE_WINDOWS`)."""
    from ..splitkv import num_window_parts
    from .combine_config import combine_attends_windows
    from .config import CONSUMERS
    per_split = (consumers or CONSUMERS) if warp_specialized else 1
    return per_split * num_splits + (0 if combine_attends_windows(fmt) else num_window_parts(fmt))


def split_partials(fmt, G: int, page: int, step: int, config: dict) -> int:
    """The partials one split of a launch ``config`` (:class:`LaunchConfig` as a dict) writes per (sequence, query
    head): v1's consumer warpgroups (:func:`~foscar.cute.config.consumers_for`), v0's one. A step of more rows
    than the columns runs in parts of its tokens (:func:`step_parts`, each with a workspace of its own) with
    :data:`~foscar.cute.config.WINDOWED_STEPS`, else as the rows of a causal view, one token each."""
    from .config import config_for, consumers_for
    if not config["warp_specialized"]:
        return 1
    parts, viewed = step_form(fmt, G, step)
    cfg = config_for(fmt, G, page, config["k_operand"], config["tiles_per_pass"], 1 if viewed else parts[0][1])
    return consumers_for(cfg, config["ctas_per_sm"])


@functools.lru_cache(maxsize=16)
def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def stage1_tensors(cfg) -> tuple:
    """The tensors stage 1 of ``cfg`` takes: :data:`~foscar.cute.config.STAGE1_TENSORS`, where the splits merge in
    a cluster (:attr:`~foscar.cute.config.Sm90Config.cluster`) the output ``[B, Hq, D]`` and its LSE ``[B, Hq]`` in
    place of the partials; where the last CTA merges them (``fused_merge``) those and the counters after them."""
    from .config import STAGE1_TENSORS
    if cfg.fused_merge:  # the last CTA of a KV head's splits merges them (foscar.cute.tail_merge)
        return STAGE1_TENSORS + (("out", cfg.cluster_out, 3), ("lse", "f32", 2), ("counters", "i32", 1))
    if not cfg.cluster:
        return STAGE1_TENSORS
    merged = {"partial_out": ("out", cfg.cluster_out, 3), "partial_lse": ("lse", "f32", 2)}
    return tuple(merged.get(t[0], t) for t in STAGE1_TENSORS)


def cluster_for(cfg, warp_specialized: bool, ctas: int, num_splits: int, out: torch.Tensor,
                lse: torch.Tensor | None) -> int:
    """The cluster a v1 launch of ``cfg`` at ``ctas`` an SM merges its ``num_splits`` splits in
    (:data:`~foscar.cute.config.CLUSTER_MERGE`), 0 where it runs the combine: no BF16 windows, no rotation, affine
    codes, 1 to 16 splits (a power of two dividing the head dim), the partials' buffers within the SM's shared
    memory, an output ``[B, rows, D]`` and an LSE ``[B, rows]`` (``lse``: the LSE asked for, or where the launch
    would put one not asked for; None, nowhere) stage 1 can write: unit last stride, 16-byte aligned; one code path
    for every consumer (:func:`merges_in_one_code_path`)."""
    from .budget import fits_shared_memory
    from .config import CLUSTER_MERGE
    if not (CLUSTER_MERGE and warp_specialized and not cfg.windows and not cfg.rotation and not cfg.fp4_block
            and out is not None and lse is not None and merges_in_one_code_path(cfg, ctas)):
        return 0
    if num_splits not in (1, 2, 4, 8, 16) or cfg.head_dim % num_splits or out.dtype not in _OUT_TYPES:
        return 0
    if not fits_shared_memory(dataclasses.replace(cfg, cluster=num_splits), ctas):
        return 0
    return num_splits if _writable(out, lse) else 0


def merges_in_one_code_path(cfg, ctas: int) -> bool:
    """Whether stage 1 can merge the splits (in a cluster, by the last CTA): its consumers run one code path
    (:func:`~foscar.cute.config.consumer_code_paths`), so that the merge's barriers of every consumer are one
    aligned instruction; with a copy a consumer, each would meet them at its own."""
    from .config import consumer_code_paths
    return consumer_code_paths(cfg, ctas) == 1


def fused_merge_to(fmt, warp_specialized: bool, out: torch.Tensor, lse: torch.Tensor | None, l_part: torch.Tensor,
                   sem: torch.Tensor, B: int, rows: int) -> tuple:
    """``(out, lse, counters)`` as stage 1 takes them where its last CTA of each KV head merges the splits
    (:data:`~foscar.cute.config.FUSED_MERGE`, :mod:`foscar.cute.tail_merge`), else ``()`` (the combine merges): v1, a
    format without BF16 windows or rotation, an output ``[B, rows, D]`` (and the LSE ``[B, rows]`` asked for; else a
    placeholder never written, the contiguous workspace's first floats) with unit last stride on 16-byte aligned
    bases, the workspace's zeroed counters ``[B Hkv]``."""
    from ..splitkv import num_window_parts
    from .config import FUSED_MERGE
    if not (FUSED_MERGE and warp_specialized and not num_window_parts(fmt) and fmt.rotation is None
            and out.dtype in _OUT_TYPES):
        return ()
    merged = (_as_rows(out, B, rows), _lse_rows(lse, l_part, B, rows), sem)
    return merged if _writable(*merged) else ()


def prologue_at(cfg, warp_specialized: bool, ctas: int):
    """``cfg`` with the prologue of :data:`~foscar.cute.config.PROLOGUE_ONE_CTA` for its bit width where v1 runs one
    CTA an SM at 8 columns (whose consumers' registers take ``consumer_q`` at INT4 without a spill; at 32 columns
    it was slower), unless Q must be staged first (a rotated cache, the producer's ``Q'`` fold) or the codes are
    FP4; else ``cfg``."""
    from .config import HEADS, PROLOGUE_ONE_CTA, PROLOGUES
    prologue = PROLOGUE_ONE_CTA.get(cfg.bits)
    if not (prologue and warp_specialized and ctas == 1 and cfg.cols == HEADS and not cfg.rotation
            and not cfg.producer_fold and not cfg.fp4_block):
        return cfg
    if prologue not in PROLOGUES:  # the kernel branches on the names: a misspelt one must not run as q_first
        raise InvalidArgumentError("foscar.cute.config.PROLOGUE_ONE_CTA", f"values of {PROLOGUES}", prologue)
    return dataclasses.replace(cfg, prologue=prologue)


def _as_rows(t: torch.Tensor | None, B: int, rows: int) -> torch.Tensor | None:
    """``t [B T, Hq, ...]`` as ``[B, T Hq, ...]`` (a step's rows of a sequence together), or None where there is none
    or its strides allow no such view."""
    if t is None:
        return None
    try:
        return t.view(B, rows, *t.shape[2:])
    except RuntimeError:
        return None


def _lse_rows(lse: torch.Tensor | None, l_part: torch.Tensor, B: int, rows: int) -> torch.Tensor | None:
    """Where stage 1 merging the splits puts the LSE ``[B, rows]``: the one asked for (:func:`_as_rows`), else the
    contiguous workspace's first ``B rows`` floats (else None: nowhere)."""
    if lse is not None:
        return _as_rows(lse, B, rows)
    return l_part.view(-1)[:B * rows].view(B, rows) if l_part.is_contiguous() else None


def _writable(*tensors) -> bool:
    """Whether stage 1 can write each of ``tensors``: given, unit last stride, a 16-byte aligned base."""
    from .config import ALIGN
    return all(t is not None and t.stride(-1) == 1 and t.data_ptr() % ALIGN == 0 for t in tensors)


def _check_stage1_tensors(tensors, cfg) -> None:
    """What the compiled stage 1 takes (:func:`stage1_tensors`), checked here so that a bad tensor is named in
    foscar's words (the TVM-FFI call would refuse it too, less plainly)."""
    from .config import ALIGN
    for (name, _, _), t in zip(stage1_tensors(cfg), tensors):
        if t.stride(-1) != 1 or t.data_ptr() % ALIGN:
            raise UnsupportedError(name, f"the CuTe kernels read it with unit stride in the last dim "
                                   f"and a {ALIGN}-byte aligned base (strides {tuple(t.stride())}, "
                                   f"address {t.data_ptr():#x})")


def max_tiles_of(cache: QuantKVCache) -> int:
    from .config import TILE
    return cache.table_capacity // TILE


def decode(q: torch.Tensor, cache: QuantKVCache, *, sm_scale: float | None = None, out: torch.Tensor | None = None,
           lse: torch.Tensor | None = None, return_lse: bool = False, num_splits: int | None = None,
           warp_specialized: bool | None = None, ctas_per_sm: int | None = None,
           workspace: tuple[torch.Tensor, ...] | None = None, k_operand: str | None = None,
           tiles_per_pass: int | None = None, stages: int | None = None):
    """Decode ``q [B, Hq, D]`` over ``cache`` with the CuTe DSL sm_90a kernel; same contract as
    :func:`foscar.triton.decode`. ``warp_specialized``: v1 (TMA producer, two consumer warpgroups, each
    writing its own partial) instead of v0, with ``ctas_per_sm`` (1 or 2) resident per SM; unset, these
    and ``num_splits`` come from :func:`launch_config`. ``workspace``: the partials as
    :func:`foscar.splitkv.new_workspace` makes them with :func:`num_parts` parts (what
    :func:`foscar.plan` holds); given, the call allocates nothing (given ``out``). ``k_operand``: the K
    operands (:data:`foscar.cute.config.K_OPERANDS`): ``"bf16"``, or E4M3 codes with Q as two E4M3 terms
    (``"e4m3"``), three (``"e4m3x3"``) or four integer digits (``"e4m3d4"``: every k32 step's sum exact, the error
    BF16 K has on an unrotated cache, on a rotated one too; :func:`foscar.cute.config.config_for` says what each
    takes), and ``tiles_per_pass``: KV tiles per softmax pass of v1, 1 or 2 (:mod:`foscar.cute.pair`); unset, the
    autotune cache's, else :func:`default_variant`'s for v1 (BF16 K and one tile a pass for v0). ``stages``:
    v1's shared-memory stages per consumer (:data:`foscar.cute.config.STAGE_CHOICES`, fitting ``ctas_per_sm``
    CTAs an SM); unset, the autotune cache's, else :func:`foscar.cute.config.default_stages`."""
    problem = DecodeProblem.build(q, cache, sm_scale=sm_scale, out=out, lse=lse, return_lse=return_lse,
                                  num_splits=num_splits)
    run(problem, warp_specialized=warp_specialized, ctas_per_sm=ctas_per_sm, workspace=workspace,
        k_operand=k_operand, tiles_per_pass=tiles_per_pass, stages=stages)
    return (problem.out, problem.lse) if (return_lse or lse is not None) else problem.out


def step_parts(gqa: int, q_len: int, rows: int) -> list[tuple[int, int]]:
    """``(first token, tokens)`` of each part a step of ``q_len`` tokens runs in where its ``gqa * q_len`` rows
    are more than a kernel's ``rows`` (:func:`~foscar.cute.config.max_rows`): as many tokens a part as fill the
    columns (at least one); one part otherwise."""
    per = max(1, rows // gqa)
    return [(j, min(per, q_len - j)) for j in range(0, q_len, per)]


def step_form(fmt, gqa: int, q_len: int) -> tuple[list[tuple[int, int]], bool]:
    """How the CuTe backend runs a step: ``(parts, viewed)``, its parts (:func:`step_parts`; one where its rows fit
    the columns) and whether it runs as the causal view's rows instead, one token each (more rows than the columns
    without :data:`~foscar.cute.config.WINDOWED_STEPS`)."""
    from .config import WINDOWED_STEPS, max_rows
    parts = step_parts(gqa, q_len, max_rows(fmt))
    viewed = len(parts) > 1 and not WINDOWED_STEPS
    return ([(0, q_len)] if viewed else parts), viewed


def _run_parts(problem: DecodeProblem, parts: list, tail: int, **launch) -> None:
    """:func:`run` of a step in ``parts`` (:func:`step_parts`): each part's tokens a step of their own that ends
    ``tail`` plus the later parts' tokens before the sequence's end, its rows copied in and its output out."""
    from dataclasses import replace
    B, T = problem.cache.batch_size, problem.q_len
    Hq, D = problem.q.shape[1:]
    q, out = problem.q.reshape(B, T, Hq, D), problem.out.view(B, T, Hq, D)
    lse = None if problem.lse is None else problem.lse.view(B, T, Hq)
    launch["workspace"] = None  # a plan's workspace is the whole step's
    for j, n in parts:
        part = replace(problem, q=q[:, j:j + n].reshape(B * n, Hq, D), out=out.new_empty(B * n, Hq, D),
                       lse=None if lse is None else lse.new_empty(B * n, Hq), q_len=n)
        run(part, tail=tail + T - j - n, **launch)
        out[:, j:j + n] = part.out.view(B, n, Hq, D)
        if lse is not None:
            lse[:, j:j + n] = part.lse.view(B, n, Hq)


def run(problem: DecodeProblem, *, num_splits: int | None = None, warp_specialized: bool | None = None,
        ctas_per_sm: int | None = None, workspace: tuple[torch.Tensor, ...] | None = None,
        k_operand: str | None = None, tiles_per_pass: int | None = None, stages: int | None = None,
        tail: int = 0) -> None:
    """:func:`decode` of a validated :class:`~foscar.problem.DecodeProblem` (its ``num_splits`` unless given):
    the CuTe backend's own checks (an sm_90 device, a format the kernels take), then the launches. A step of more
    rows than a kernel's columns runs in parts of its tokens (:func:`step_parts`,
    :data:`~foscar.cute.config.WINDOWED_STEPS`; else as the causal view's rows); ``tail``: the step's tokens end
    that many before the sequence's (a part of a longer step)."""
    from ..rotation import rotation_factors
    from ..splitkv import num_window_parts, window_partials, workspace_for
    from .budget import default_ring, fits_shared_memory
    from .combine_config import combine_attends_windows, dependent_combine
    from .config import config_for
    q, cache, out, lse, sm_scale, G = problem.q, problem.cache, problem.out, problem.lse, problem.sm_scale, problem.gqa
    if q.device.type != "cuda" or _capability(q.device) != (9, 0):
        raise UnsupportedError("backend 'cute'", f"needs an sm_90 GPU (q is on {q.device})")
    T = problem.q_len
    pieces, viewed = step_form(cache.fmt, G, T)
    if len(pieces) > 1:  # more rows than the columns
        return _run_parts(problem, pieces, tail, num_splits=num_splits, warp_specialized=warp_specialized,
                          ctas_per_sm=ctas_per_sm, k_operand=k_operand, tiles_per_pass=tiles_per_pass, stages=stages)
    if viewed:  # the causal view's rows, one token each
        from dataclasses import replace

        from ..multitoken import causal_view
        problem, T = replace(problem, cache=causal_view(cache, T), q_len=1), 1
        cache = problem.cache
    fmt = cache.fmt
    B = cache.batch_size  # a step's rows: B * T rows of q, its tokens the kernel's N columns
    asked = stages
    warp_specialized, ctas, num_splits, k_operand, tiles_per_pass, stages = launch_config(
        q, cache, G, num_splits=problem.num_splits if num_splits is None else num_splits,
        warp_specialized=warp_specialized, ctas_per_sm=ctas_per_sm, k_operand=k_operand,
        tiles_per_pass=tiles_per_pass, stages=stages, step=T, tail=tail)
    if asked is None and stages is not None and warp_specialized and not fits_shared_memory(
            config_for(fmt, G, cache.page_size, k_operand, tiles_per_pass, T, stages, tail), ctas):
        stages = None  # a tuned ring the CTAs of this launch do not hold (switches that add consumers)
    if stages is None and warp_specialized:  # the default ring, or the deepest that the CTAs of an SM hold
        cfg = default_ring(fmt, G, cache.page_size, k_operand, tiles_per_pass, T, ctas, tail)
    else:
        cfg = config_for(fmt, G, cache.page_size, k_operand, tiles_per_pass, T, stages, tail)
    if stages is not None and not fits_shared_memory(cfg, ctas):
        raise UnsupportedError(f"stages={stages} with ctas_per_sm={ctas}", "the stage ring of that many CTAs "
                               "does not fit an SM's shared memory (foscar.cute.budget.fits_shared_memory)")
    if not warp_specialized and (cfg.causal or cfg.cols > 8 or cfg.head_dim > 128 or cfg.term_blocks
                                 or (cfg.k_channel and cfg.k_e4m3) or cfg.fp4_block):
        from .config import V0_LIMITS
        raise UnsupportedError(f"warp_specialized=False with gqa={G}, q_len={T}", V0_LIMITS)
    from .config import CLUSTER_MERGE, consumers_for
    cfg = prologue_at(cfg, warp_specialized, ctas)
    parts = num_parts(fmt, num_splits, warp_specialized, consumers_for(cfg, ctas))  # windows: after the splits
    o_part, l_part, sem = workspace_for(workspace, q.shape[0], q.shape[1], parts, fmt.head_dim, q.device,
                                        cache.num_kv_heads)
    rot = rotation_factors(fmt, q.device)  # a rotated cache: the kernels rotate Q in and the output back
    Hr = T * q.shape[1]  # the rows of one sequence: q [B T, Hq, D] as [B, T Hq, D] (token-major)
    dest = (o_part.view(B, Hr, *o_part.shape[2:]), l_part.view(B, Hr, l_part.shape[2]))
    size = 0
    if CLUSTER_MERGE:  # the output and LSE as a sequence's rows, views made only where the switch is on
        lse_to = _lse_rows(lse, l_part, B, Hr)  # an LSE not asked for: into the workspace's first floats
        out_to = _as_rows(out, B, Hr)
        size = cluster_for(cfg, warp_specialized, ctas, num_splits, out_to, lse_to)
    if size:  # stage 1 writes the output
        cfg = dataclasses.replace(cfg, cluster=size, cluster_out=_OUT_TYPES[out.dtype])
        dest = (out_to, lse_to)
    fused = () if size or not merges_in_one_code_path(cfg, ctas) else fused_merge_to(
        fmt, warp_specialized, out, lse, l_part, sem, B, Hr)
    if fused:  # stage 1's last CTA of each KV head merges its splits
        cfg = dataclasses.replace(cfg, fused_merge=1 + (lse is not None), cluster_out=_OUT_TYPES[out.dtype])
    tensors = (q.to(torch.bfloat16).contiguous().view(B, Hr, -1), cache.k_codes, cache.v_codes,
               *(_param_words(p) for p in (cache.k_params, cache.v_params)), cache.page_table.block_table,
               cache.seq_lens.to(torch.int32), *dest, rot, cache.tensor_scales, *fused)  # Q: BF16
    _check_stage1_tensors(tensors, cfg)
    qk_scale = sm_scale * 1.4426950408889634
    _compiled(cfg, warp_specialized, ctas)(*tensors, qk_scale, num_splits)  # on torch's current stream
    if size or fused:
        return
    windows = None
    if combine_attends_windows(fmt):  # no launch of their own
        rows = (_row_aligned(t) for t in (cache.k_sink, cache.v_sink, cache.k_recent, cache.v_recent))
        windows = CombineWindows(tensors[0].view(B * T, -1, fmt.head_dim), *rows, tensors[6], qk_scale, G, fmt, T,
                                 tail)
    elif num_window_parts(fmt):
        window_partials(q, cache, o_part, l_part, parts - num_window_parts(fmt), qk_scale, G, interp=False, step=T,
                        tail=tail)
    combine(o_part, l_part, out, lse, rot if fmt.rotation is not None else None, windows,
            dependent_combine(fmt, warp_specialized, ctas))


def _param_words(params: torch.Tensor) -> torch.Tensor:
    """A cache's parameters as stage 1 reads them (``k_params`` of :data:`~foscar.cute.config.STAGE1_TENSORS`):
    the affine ``(s', z')`` as they are; an FP4 format's block-scale bytes ``[pages, Hkv, page, blocks]`` as
    float32 words ``[pages, Hkv, page / 64, 16 blocks, 1]``, a tile's bytes one row (the kernel reads the bytes)."""
    if params.dtype != torch.uint8:
        return params
    P, H, page, nb = params.shape
    return params.reshape(P, H, page // 64, 64 * nb).view(torch.float32).view(P, H, page // 64, 16 * nb, 1)


#: The combine's output element type of each output dtype (the query's).
_OUT_TYPES = {torch.bfloat16: "bf16", torch.float16: "f16", torch.float32: "f32"}


class CombineWindows(NamedTuple):
    """What the combine reads to attend a cache's BF16 windows itself (:mod:`foscar.cute.windows`): the query
    (BF16 ``[B, Hq, D]``), the sink and the recent ring (``[B, Hkv, slots, D]``, rows 16-byte aligned), the
    lengths, the softmax scale times ``log2(e)``, the GQA ratio and the format (its split of a length); the query's
    rows those of steps of ``step`` tokens ending ``tail`` before the sequence's (``[B step, Hq, D]``)."""

    q: torch.Tensor
    k_sink: torch.Tensor
    v_sink: torch.Tensor
    k_recent: torch.Tensor
    v_recent: torch.Tensor
    seq_lens: torch.Tensor
    qk_scale: float
    gqa: int
    fmt: object
    step: int = 1
    tail: int = 0


def _row_aligned(t: torch.Tensor) -> torch.Tensor:
    """``t`` where every row is a 16-byte aligned vector (unit last stride, 16-byte strides and base), else a
    contiguous copy (a window tensor a caller built with other strides)."""
    rows = t.stride(-1) == 1 and all(s * t.element_size() % 16 == 0 for s in t.stride()[:-1])
    return t if rows and t.data_ptr() % 16 == 0 else t.contiguous()


def combine(o_part: torch.Tensor, l_part: torch.Tensor, out: torch.Tensor, lse: torch.Tensor | None,
            rotation: torch.Tensor | None = None, windows: CombineWindows | None = None, pdl: bool = False) -> None:
    """Merge the partials ``o_part [B, Hq, parts, D]``, ``l_part [B, Hq, parts]`` into ``out`` (and
    ``lse``) with the CuTe combine (:class:`foscar.cute.combine.CombineSm90`), on torch's current stream;
    ``rotation`` (:func:`foscar.rotation.rotation_factors`): the partials are in a rotated cache's space, the
    output is not; ``windows``: a cache's BF16 windows, attended by the combine and merged with the partials;
    ``pdl``: launched as a programmatic dependent of the stage 1 just launched (which signals it)."""
    from .combine_config import CombineConfig, combine_chunk
    win = {}
    if windows is not None:
        fmt = windows.fmt
        win = {"sink": fmt.sink, "recent": fmt.recent, "flush": fmt.flush, "ring": fmt.recent_capacity,
               "gqa": windows.gqa, "window_dtype": _OUT_TYPES[windows.k_sink.dtype], "step": windows.step,
               "tail": windows.tail}
    cfg = CombineConfig(o_part.shape[-1], _OUT_TYPES[out.dtype], lse is not None, combine_chunk(o_part.shape[2]),
                        rotation is not None, pdl, **win)
    args = (o_part, l_part, out, lse if lse is not None else l_part[:, :, 0],
            rotation if rotation is not None else l_part[0, 0])
    if windows is not None:
        args += (*windows[:6], windows.qk_scale)
    _compiled(cfg)(*args)
