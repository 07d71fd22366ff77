"""Static configuration of the CuTe DSL Hopper (sm_90a) decode kernels.

:class:`Sm90Config` holds everything one compiled kernel depends on (it is the compile-cache key); :func:`config_for`
makes it from a cache format, a GQA ratio and a page size, or says why the kernels cannot take them. The constants are
the tile geometry both kernels share and what the host side (:mod:`foscar.cute.launch`) reads: :data:`TILE`,
:data:`CONSUMERS`, :data:`WS_REGISTERS`, :data:`STAGE1_TENSORS` and :data:`ALIGN`. Plain Python: the host side imports
it without cutlass-dsl (whose import takes about a second of a process's first decode).
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

from ..e4m3 import Q_PRIME_FP16_FIRST
from ..format import v_block_tokens
from .combine_config import combine_attends_windows

TILE = 64  #: tokens per KV tile: the wgmma M of S^T = K Q^T
HEADS = 8  #: the least wgmma N: a KV head's query rows padded to 8 columns (or to 16 or 32: ``Sm90Config.cols``)
MAX_COLS = 32  #: the most query rows of one KV head a kernel takes (query heads times the step's tokens)
#: What v0 takes beyond :func:`config_for` (checked by :func:`foscar.cute.launch.run`)
V0_LIMITS = ("v0 (warp_specialized=False) takes one query token per sequence, at most 8 query heads per KV head "
             "(E4M3 K operands: 4, token-wise K), head dim 64/128 and affine codes")
THREADS = 128  #: threads of one warpgroup
CORRECTION_TILES = 16  #: tiles between two folds of the gathered offset corrections into the accumulator
#: Whether one-tile passes of token-wise and of channel-wise V take the lazy rescale (:attr:`Sm90Config.lazy_rescale`):
#: faster at GQA 8-32, as fast or faster at every shape (``docs/bench/h200/lazy-one-tile-heads.md``, ``axes-lazy-*``)
LAZY_ONE_TILE = LAZY_CHANNEL_V = True
PAIR_CHANNEL_V = True  #: channel-wise V on two tiles of one token group a pass (:mod:`foscar.cute.pair`): faster
STAGES = 4  #: v1: shared-memory stages per consumer warpgroup (:attr:`Sm90Config.stages`), 8 for tiles of 4 KB or less
DEEP_STAGES, DEEP_STAGE_BYTES = 8, 4096  #: v1's stages where a tile's K and V codes take at most this many bytes
STAGE_CHOICES = (4, 8, 16)  #: v1's stages a launch may ask for (a tuned entry's), where they fit (budget.py)
#: How a v1 CTA begins (:attr:`Sm90Config.prologue`): ``q_first``, the producer stages Q, then issues its copies;
#: ``consumer_q``, the first consumer stages Q while the producer copies
PROLOGUES = ("q_first", "consumer_q")
#: Each bit width's prologue, the faster (``consumer_q`` spills at INT4 at two CTAs an SM; a rotated cache, whose Q
#: the ring's first stage stages, ``q_first``); at one CTA an SM and 8 columns (``prologue_at``): INT4 ``consumer_q``
PROLOGUE_BY_BITS = {2: "consumer_q", 4: "q_first"}
PROLOGUE_ONE_CTA: dict = {4: "consumer_q"}
COMBINE_PDL = False  #: the split merge as a dependent launch (PDL) v1's CTAs signal: off, no faster (results doc)
#: A format's BF16 windows attended inside the CuTe combine (:mod:`foscar.cute.windows`), not by a Triton launch each:
#: faster at every shape measured (``docs/bench/h200/window-cost-kv-head.md``)
COMBINE_WINDOWS = True
COMBINE_PDL_WINDOWS = True  #: COMBINE_PDL for windowed formats: the combine attends the windows, then waits
#: The bit widths whose E4M3 K operands take each FP8 ``m64n8k32`` step of ``S^T = K Q^T`` into its own FP32
#: accumulator (:attr:`Sm90Config.qk_promote`), up to 4 query rows: INT4 only, where it lowers the error most for
#: the least time (``docs/results-h200.md``: the FP8 accumulation rounds toward zero)
QK_PROMOTE_BITS = (4,)
#: Token-wise V^T's FP16 operands are placed (:func:`foscar.format.f16_placement`: ``q 2^(shl - 24)``, no offset;
#: :attr:`Sm90Config.v_factors`): injection's offset (``q + 2^(10 - shl)``) times the sum of P' lost bits in the PV
#: chain's truncating FP32 sum, its error growing with a split's tiles (results doc). From bit 0 (``V_LOW_PLACEMENT``,
#: :func:`foscar.cute.fragment.v_token_half_shls`: fewer rotations a word, the stress study's error as from bit 4);
#: by channel-row class too (``V_ROW_SHIFTS``): off, the stress study's error rose (results doc). Channel-wise V^T
#: placed too (``V_CHANNEL_PLACEMENT``, on: each half at its bits, ``P~`` by ``v_factors[h]``, partials ``s' v_unit``)
V_LOW_PLACEMENT, V_ROW_SHIFTS, V_CHANNEL_PLACEMENT = True, False, True
#: By placement every PV product in the units of this bit's codes, whatever bit the codes sit at: P' carries
#: ``2^(V_PRODUCT_BIT - shl_h)`` (:func:`foscar.cute.v_operands.v_operand_fields`; a no-op from bit 4 up)
V_PRODUCT_BIT = 4
#: v1 reads a stage's K and V words off one base (the stage flat), not via its 2-D layout: everywhere (``FLAT_WORDS``),
#: else at ``FLAT_WORDS_COLS``' columns (H100: INT2 2.6-3.0% faster at 16, 32; at 8 +5% to -2.4% by shape: results doc)
FLAT_WORDS, FLAT_WORDS_COLS = False, (16, 32)
#: The column counts whose P^T is column-major in shared memory (:attr:`Sm90Config.p_column_major`: a thread's two
#: columns of a token in one 32-bit store): faster at 16 and 32; at 8 INT4 was slower (``docs/results-h200.md``)
P_COLUMN_MAJOR_COLS = (16, 32)
#: ... whose token-wise V scales P' in FP16 pairs (``Sm90Config.pair_p_scale``), and ``PAIR_VOTE``: there the lazy
#: rescale votes on those pairs (``Sm90Config.pair_vote``). H100: steps of 8 2.3% faster, GQA 32 0.5-1%; 16 -1%
PAIR_P_SCALE_COLS, PAIR_VOTE = (32,), True
#: v1: a CTA prefetches the length's line, the TMA descriptors and its first page-table line as it starts, reading the
#: length past the prologue's barriers (:attr:`Sm90Config.start_prefetch`): 0.8-1.2% faster (``docs/results-h200.md``)
START_PREFETCH = True
#: Steps over BF16 windows as the CuTe kernel's columns (each column's tokens and windows at its own length), a step of
#: more rows than the columns in parts (:func:`foscar.cute.launch.step_parts`); off: the causal view's rows (or Triton)
WINDOWED_STEPS = True
#: Q's E4M3 terms stacked along the contraction at 16 and 32 columns (:attr:`Sm90Config.stacked_terms`), one power of
#: two for them per KV head (:attr:`Sm90Config.shared_q_scale`, ``decode_folded(q_terms="stacked_kv_head")``), the
#: masks and the V ``(s', z')`` zeroed past the length in a branch only tiles reaching a limit take (``mask_branch``;
#: 16-32 columns, steps; ``PAIR_MASK_BRANCH``: two-tile passes): :meth:`foscar.cute.warpgroup.TileKernel._mask_branch`;
#: two-tile passes' wgmma with B descriptors formed once (``OWN_WGMMA_BITS``, :mod:`foscar.cute.wgmma`; D 128; not
#: INT4, which spills so; ``OWN_WGMMA_STEPS``: token-wise 32-column steps on three consumers; an H100: as fast)
STACKED_TERMS = SHARED_Q_SCALE = MASK_BRANCH = PAIR_MASK_BRANCH = True
OWN_WGMMA_BITS, OWN_WGMMA_STEPS = (2,), True
#: The column counts v1 runs at two CTAs an SM where a launch names none (:func:`foscar.cute.launch.default_ctas_per_sm`):
#: 8 and 16, GQA 16 measured faster at two though its 16 columns spill there (``docs/bench/h200/sweep-rows.md``)
TWO_CTA_COLUMNS = (8, 16)
OVERLAP_COLS = ()  #: one-tile passes overlapping two tiles (Sm90Config.overlap): none, no faster (docs/steps-plan.md)
QK_ZEROING_BITS = (2, 4)  #: two-tile passes zeroing QK accumulators by MMA (Sm90Config.qk_zeroing): no injected wait
#: Column counts whose P' sums come from V^T's extra m64 block (foscar.cute.pivot): token-wise V's pivot sums (H100:
#: no faster at 32, steps slower), channel-wise V's column sums (H100: GQA 32 13-17% faster; spill at 16, 3 consumers)
PIVOT_MMA_COLS, COLUMN_SUM_MMA_COLS, PRODUCER_Q_FOLD = (), (8, 32), False  # PRODUCER_Q_FOLD: Sm90Config.producer_fold
#: Channel-wise K with E4M3 K operands, ``Q'`` as two E4M3 terms (:func:`foscar.cute.fold_terms.fold_q_terms`): faster
#: at every shape swept, up to ``CHANNEL_K_E4M3_ROWS`` query rows (5-8 in two column blocks: as BF16 K; results doc)
CHANNEL_K_E4M3, CHANNEL_K_E4M3_ROWS = True, 4
CONSUMERS = 2  #: v1: consumer warpgroups per CTA, on alternating KV tiles (:func:`consumers_for`: 3 where wide)
WIDE_CONSUMERS = False  #: three consumers at one CTA an SM, 16/32 columns (Sm90Config.wide): off (docs/results-h200.md)
WIDE_STEP_COLUMNS = (32,)  #: the same for steps (q_len > 1) of these columns: on at 32 (H100: 1.03-1.16x faster)
#: 32 columns: the consumers on one copy of their code at these bits and counts: INT4's three (H100: 1-3.5% faster)
ONE_COPY_BITS, ONE_COPY_CONSUMERS = (4,), (3,)
WIDE_EIGHT_COLUMNS = False  #: the same at 8 columns (token-wise K and V): off, slower than two CTAs an SM everywhere
CLUSTER_MERGE = False  #: the split merge in stage 1 over one cluster (:attr:`Sm90Config.cluster`): correct, slower
FUSED_MERGE = False  #: the split merge by stage 1's last CTA a KV head (:attr:`Sm90Config.fused_merge`): off, slower
#: v1's (producer, consumer) registers a thread after setmaxnreg by CTAs an SM. Two: launched at 80 (65,536 / 768),
#: 56 back, 24 more a consumer (128 x 56 >= 256 x 24); three consumers (:data:`WS_REGISTERS_WIDE`): 24 and 160.
WS_REGISTERS, WS_REGISTERS_WIDE = {1: (40, 232), 2: (24, 104)}, (24, 160)
#: The same with ``Q'`` built by the producer (:attr:`Sm90Config.producer_fold`), its rows unrolled at
#: :data:`FOLD_UNROLLED_BITS` (none); ``FOLD_F16_SPLIT``: channel-wise K's ``Q'`` split in FP16 pairs as the emulator
WS_REGISTERS_FOLD, WS_REGISTERS_FOLD_UNROLLED = {1: (40, 232), 2: (32, 104)}, {1: (40, 232), 2: (48, 96)}
FOLD_UNROLLED_BITS, FOLD_F16_SPLIT = (), Q_PRIME_FP16_FIRST
#: The kernel switches above (a flag, a tuple of bit widths or a dict by bit width), set by ``benchmarks/run_with.py``
SWITCHES = ("PROLOGUE_BY_BITS", "PROLOGUE_ONE_CTA", "LAZY_ONE_TILE", "COMBINE_PDL", "QK_PROMOTE_BITS",
            "PRODUCER_Q_FOLD", "LAZY_CHANNEL_V", "COMBINE_WINDOWS", "COMBINE_PDL_WINDOWS", "CHANNEL_K_E4M3",
            "P_COLUMN_MAJOR_COLS", "START_PREFETCH", "WINDOWED_STEPS", "WIDE_CONSUMERS", "WIDE_STEP_COLUMNS",
            "ONE_COPY_BITS", "ONE_COPY_CONSUMERS", "WIDE_EIGHT_COLUMNS", "STACKED_TERMS", "SHARED_Q_SCALE",
            "PAIR_CHANNEL_V", "MASK_BRANCH", "PAIR_MASK_BRANCH", "OWN_WGMMA_BITS", "OWN_WGMMA_STEPS", "PIVOT_MMA_COLS",
            "TWO_CTA_COLUMNS", "CLUSTER_MERGE", "OVERLAP_COLS", "QK_ZEROING_BITS", "V_LOW_PLACEMENT", "V_ROW_SHIFTS",
            "FLAT_WORDS", "FLAT_WORDS_COLS", "V_PRODUCT_BIT", "FUSED_MERGE", "PAIR_P_SCALE_COLS", "PAIR_VOTE",
            "CHANNEL_K_E4M3_ROWS", "FOLD_UNROLLED_BITS", "FOLD_F16_SPLIT", "V_CHANNEL_PLACEMENT",
            "COLUMN_SUM_MMA_COLS")


def ws_registers(cfg, ctas_per_sm: int) -> tuple[int, int]:
    """v1's (producer, consumer) registers a thread after ``setmaxnreg`` (:data:`WS_REGISTERS`)."""
    if consumers_for(cfg, ctas_per_sm) == 3:
        return WS_REGISTERS_WIDE
    fold = WS_REGISTERS_FOLD_UNROLLED if cfg.fold_unrolled else WS_REGISTERS_FOLD
    return (fold if cfg.producer_fold else WS_REGISTERS)[ctas_per_sm]


def as_run(cfg, ctas_per_sm: int):
    """``cfg`` as v1 runs it at ``ctas_per_sm`` CTAs an SM: :attr:`~Sm90Config.overlap` with two consumers at one CTA
    only (two CTAs' 104 registers a consumer, or three consumers' 160, spill the second tile's); a split merge in a
    cluster there without :attr:`~Sm90Config.qk_zeroing` (INT2, two CTAs, 16 a cluster: 40 bytes spilled with it)."""
    fewer = ctas_per_sm > 1 or consumers_for(cfg, ctas_per_sm) > CONSUMERS
    run = {"overlap": cfg.overlap and not fewer, "qk_zeroing": cfg.qk_zeroing and not (cfg.cluster > 1 and fewer)}
    return cfg if run == {"overlap": cfg.overlap, "qk_zeroing": cfg.qk_zeroing} else dataclasses.replace(cfg, **run)


def consumers_for(cfg, ctas_per_sm: int) -> int:
    """v1's consumer warpgroups a CTA: 3 where :attr:`~Sm90Config.wide` at one CTA an SM, else :data:`CONSUMERS`."""
    return 3 if cfg.wide and ctas_per_sm == 1 else CONSUMERS


def consumer_code_paths(cfg, ctas_per_sm: int) -> int:
    """The copies of the consumers' code in v1: one a consumer at :data:`MAX_COLS` columns (its buffers' addresses
    constants) but where :attr:`~Sm90Config.one_copy` holds their number, else one for all (a run-time index)."""
    n = consumers_for(cfg, ctas_per_sm)
    return n if cfg.cols == MAX_COLS and n not in cfg.one_copy else 1

#: The stage-1 arguments, in order (the kernels' ``__call__`` tensors): (name, element type ``"bf16"``, ``"i32"`` or
#: ``"f32"``, rank). Each has dynamic shape and strides, unit stride in its last dim and a 16-byte aligned base (TMA
#: and vector loads): one compile serves every batch, length and pool size.
STAGE1_TENSORS = (("q", "bf16", 3), ("k_codes", "i32", 3), ("v_codes", "i32", 3), ("k_params", "f32", 5),
                  ("v_params", "f32", 5), ("block_table", "i32", 2), ("seq_lens", "i32", 1),
                  ("partial_out", "f32", 4), ("partial_lse", "f32", 3), ("rotation", "f32", 1),
                  ("tensor_scales", "f32", 1))
ALIGN = 16  #: bytes: the alignment of every stage-1 tensor's base


def thread_k_words(bits: int, head_dim: int) -> int:
    """Packed K words each thread of a warpgroup holds per 64-token tile."""
    return head_dim * bits // 64


def tile_words(bits: int, head_dim: int) -> int:
    """Packed words of one tensor's 64-token tile (one KV head)."""
    return TILE * head_dim * bits // 32


@dataclass(frozen=True)
class Sm90Config:
    """Static configuration of one compiled kernel (the compile-cache key).

    The injection constants build each product's operands from the codes: BF16 bits ``k_pattern | q << k_shl`` are
    ``q + beta_K``; V^T's FP16 bits ``v_patterns[h] | q << v_shls[h]`` are ``q + beta_V`` (channel-wise V injected at
    one bit) or ``q 2^(v_shls[h] - 24)`` with no pattern (placement: :attr:`v_factors`, :attr:`v_unit`) for the codes
    of token half ``h`` of a k16 block (:func:`foscar.cute.fragment.v_token_half`, ``v_token_half_shls``: fewer shifts
    than one bit). ``*_pivot`` is the operand of the middle code; a group's middle value is ``z' + *_mid * s'``."""

    bits: int  #: the codes' width (4 for the FP4 block formats)
    head_dim: int
    page: int  #: tokens per page (a multiple of TILE)
    gqa: int  #: query heads per KV head
    k_pattern: int
    k_shl: int
    k_pivots: tuple[float, float]  #: per token half (rows + 8 of a 16-row block: half 1)
    k_mid: float
    v_patterns: tuple[int, int]  #: per token half of a k16 block
    v_shls: tuple[int, int]
    v_pivots: tuple[float, float]
    v_mid: float
    #: V^T by placement: the factor of each token half's P' (P~), a power of two, and the products' unit (an operand
    #: factor ``2^(24 - shl)``): token-wise V's accumulator holds the output in units of ``sigma v_unit``
    #: (:attr:`acc_unit`), channel-wise V's acc-fold scales each partial by ``s' v_unit``; 1 by injection
    v_factors: tuple[float, float] = (1.0, 1.0)
    v_unit: float = 1.0
    #: by placement, the extra bits of channel-row class 1's codes (rows +8 of 16; :data:`V_ROW_SHIFTS`): its
    #: accumulator rows are ``2^b`` times the output's units until the end
    v_row_shls: tuple[int, int] = (0, 0)
    flat_words: bool = False  #: v1 reads its K and V words off one base a stage (:data:`FLAT_WORDS_COLS`)
    sink: int = 0  #: the format's BF16 windows: the kernel derives each sequence's quantized length
    recent: int = 0
    k_channel: bool = False  #: channel-wise K: groups of group_size tokens (operand-fold into Q)
    group_size: int = 0  #: values sharing one (s', z'): channels of a token-wise axis, tokens of a channel-wise one
    v_channel: bool = False  #: channel-wise V (acc-fold of each tile's PV partial)
    k_e4m3: bool = False  #: E4M3 K operands by bit placement and Q as E4M3 terms (foscar.cute.operands_e4m3)
    #: E4M3 K operands: Q's residual terms (``hi``, ``lo``; three: ``hi``, ``mid``, ``lo``, each step x16,
    #: ``k_operand="e4m3x3"``; four digits, ``e4m3d4``: always in separate column blocks, :attr:`term_blocks`)
    q_terms: int = 2
    q_digits: bool = False  #: Q's terms as integer digits in base 16 (``e4m3d4``, :func:`foscar.e4m3.split_digits`)
    #: the K operand's scale per token half: s' k_factor multiplies the MMA's sum (E4M3: 2^9; INT2 placed
    #: with two registers a rotation, :func:`foscar.cute.operands_e4m3.k_placement_e4m3`: 2^7 for half 1)
    k_factors: tuple[float, float] = (1.0, 1.0)
    #: KV tiles per softmax pass (v1): 2 puts a second tile's scores in the N columns that gqa <= 4 leaves as
    #: padding, so that one pass of the online softmax serves two tiles (:mod:`foscar.cute.pair`)
    tiles_per_pass: int = 1
    #: a rotated cache (``KVFormat.rotation``): stage 1 rotates the query into its space (:mod:`foscar.cute.rotation`)
    rotation: bool = False
    #: query tokens per sequence (a decode step, :mod:`foscar.multitoken`): column ``c`` of the N axis is
    #: token ``c // gqa``, head ``c % gqa``, and sees the tokens up to its own (:func:`~foscar.cute.fragment.column_token`)
    step: int = 1
    #: a step's tokens end this many tokens before the sequence's (a part of a longer step: the launch runs a step
    #: of more rows than :func:`max_rows` as parts of its tokens, :func:`foscar.cute.launch.step_parts`)
    tail: int = 0
    #: the wgmma N: ``gqa * step`` query rows padded to 8, 16 or 32 (:func:`columns_for`)
    cols: int = HEADS
    #: v1: shared-memory stages per consumer (a power of two, :data:`STAGE_CHOICES`); by default
    #: :func:`default_stages`: :data:`DEEP_STAGES` where a tile's codes are small (INT2 at head dim 128: a tile
    #: streams half INT4's bytes in as many instructions, so twice the stages keep as many bytes in flight),
    #: else :data:`STAGES`; a tuned entry may ask for more where its CTAs per SM leave the shared memory
    stages: int = STAGES
    #: the online softmax's rescale made lazy (:mod:`foscar.cute.lazy`): two tiles a pass always, one tile a pass
    #: where :data:`LAZY_ONE_TILE` (token-wise V) or :data:`LAZY_CHANNEL_V` (channel-wise V)
    lazy_rescale: bool = False
    #: v1: how a CTA begins, one of :data:`PROLOGUES` (:data:`PROLOGUE_BY_BITS`)
    prologue: str = "q_first"
    #: v1: every CTA signals the dependent combine as it starts (:data:`COMBINE_PDL`)
    trigger_dependents: bool = False
    #: E4M3 K operands, token-wise K with one channel group: the QK steps promoted to FP32 (:data:`QK_PROMOTE_BITS`)
    qk_promote: bool = False
    #: v1, channel-wise K: ``Q'`` per stage, built by the producer warpgroup (:data:`PRODUCER_Q_FOLD`)
    producer_fold: bool = False
    fold_unrolled: bool = False  #: ``producer_fold``'s E4M3 terms, a pass's rows unrolled (:data:`FOLD_UNROLLED_BITS`)
    fold_f16_split: bool = False  #: channel-wise K's E4M3 terms split in FP16 pairs (:data:`FOLD_F16_SPLIT`)
    #: an FP4 block format's block (16: NVFP4, 32: MXFP4, :mod:`foscar.cute.operands_fp4`), 0 for the affine codes: E2M1
    #: codes placed as FP16 operands and multiplied by their block scales, token-wise K and V of one "group" the
    #: head dim, no offsets; the parameters a tile's block-scale bytes
    fp4_block: int = 0
    p_column_major: bool = False  #: P^T's layout (:data:`P_COLUMN_MAJOR_COLS`, ``operands.mmas_and_layouts``)
    pair_p_scale: bool = False  #: token-wise V's P' scaled in FP16 pairs (PAIR_P_SCALE_COLS, ``folds.p_operands``)
    pair_vote: bool = False  #: with pair_p_scale and the lazy rescale, its vote on P's FP16 pairs (PAIR_VOTE)
    start_prefetch: bool = False  #: v1: :data:`START_PREFETCH`
    #: Q's terms stacked along the contraction (:data:`STACKED_TERMS`, :attr:`term_blocks` only): term ``k`` of row
    #: ``c`` at channels ``(q_terms - 1 - k) D ...`` of a contraction ``q_terms D`` deep (each rounded where it sits)
    stacked_terms: bool = False
    #: stacked terms: Q's power of two one per KV head, joining the token's scale in K's fold (:data:`SHARED_Q_SCALE`)
    shared_q_scale: bool = False
    mask_branch: bool = False  #: the scores' masks only in the tiles that reach a limit (:data:`MASK_BRANCH`)
    own_wgmma: bool = False  #: v1, two-tile passes and 32-column steps: :data:`OWN_WGMMA_BITS`, ``OWN_WGMMA_STEPS``
    pivot_mma: bool = False  #: token-wise V's pivot sums by the tensor core (:data:`PIVOT_MMA_COLS`)
    column_sum_mma: bool = False  #: channel-wise V's column sums of P by the tensor core (:data:`COLUMN_SUM_MMA_COLS`)
    overlap: bool = False  #: v1: a consumer's tiles two a pass, B's QK over A's softmax (:data:`OVERLAP_COLS`)
    qk_zeroing: bool = False  #: v1, two tiles a pass: QK accumulators zeroed by their first MMA (QK_ZEROING_BITS)
    #: v1 at one CTA an SM: three consumer warpgroups (:func:`consumers_for`), tiles in turn: 16 or 32 columns one
    #: tile a pass (:data:`WIDE_CONSUMERS`, steps :data:`WIDE_STEP_COLUMNS`); 8 (:data:`WIDE_EIGHT_COLUMNS`)
    wide: bool = False
    one_copy: tuple = ()  #: at 32 columns, the consumer counts on one copy of their code (ONE_COPY_CONSUMERS)
    #: v1: a (sequence, KV head)'s splits one cluster of this many CTAs, merged from their shared memory into the
    #: output (``cluster_out``, :mod:`foscar.cute.cluster`); 0: the partials to memory, then the combine
    cluster: int = 0
    cluster_out: str = "bf16"  #: the output's element type where stage 1 merges (``cluster``, ``fused_merge``)
    #: v1: the last CTA of a (sequence, KV head)'s splits merges them (:mod:`foscar.cute.tail_merge`; 2: with the LSE)
    fused_merge: int = 0

    @property
    def tile_run(self) -> int:
        """v1: the consecutive tiles of a split each consumer takes in turn (:func:`foscar.cute.ring.ring_tile`): 2
        where channel-wise K's token group spans two tiles or more and each consumer folds its own ``Q'`` (one fold for
        both tiles, where alternate tiles would fold every tile) or takes them as one pass (one ``Q'``), else 1."""
        fold_pairs = self.k_channel and (not self.producer_fold or self.tiles_per_pass == 2)
        one_group = fold_pairs or (self.v_channel and self.tiles_per_pass == 2)  # channel-wise V: one acc-fold a pass
        return 2 if one_group and self.group_size >= 2 * TILE else 1

    @property
    def p_tiles(self) -> int:
        """The tiles a pass's P' holds: two with two tiles a pass or :attr:`overlap`."""
        return 2 if self.tiles_per_pass == 2 or self.overlap else 1

    @property
    def rows(self) -> int:
        """Query rows of one KV head: its heads times the step's tokens."""
        return self.gqa * self.step

    @property
    def nb(self) -> int:
        """8-column blocks of the N axis: a thread holds two columns of each (:func:`~foscar.cute.fragment.slot_column`)."""
        return self.cols // HEADS

    @property
    def acc_unit(self) -> float:
        """The O^T accumulator's unit: :attr:`v_unit` for token-wise V, 1 for channel-wise V (its acc-fold's)."""
        return 1.0 if self.v_channel else self.v_unit

    @property
    def fp4_mx(self) -> bool:
        """MXFP4 (blocks of 32, E8M0 scales relative to each token's largest, :mod:`foscar.cute.operands_fp4`)."""
        return self.fp4_block == 32

    @property
    def fp4_blocks(self) -> int:
        """FP4 block formats: the block scales of a token (per tensor)."""
        return self.head_dim // self.fp4_block if self.fp4_block else 0

    @property
    def q_scaled(self) -> bool:
        """Q^T staged with a power of two per query row, taken back from the scores (``sQinv``): E4M3 terms, or
        the FP16 operand of the FP4 formats."""
        return self.q_as_terms or self.fp4_block > 0

    @property
    def q_as_terms(self) -> bool:
        """Q^T staged as E4M3 terms (:func:`foscar.cute.operands.stage_q`): E4M3 K of a token-wise K (channel-wise
        K stages Q in BF16 and folds each group's ``Q'`` into terms, :data:`CHANNEL_K_E4M3`)."""
        return self.k_e4m3 and not self.k_channel

    @property
    def term_blocks(self) -> bool:
        """E4M3 K operands with Q's (channel-wise K: ``Q'``'s) terms in separate column blocks (more than 4 rows,
        or three terms): term ``k`` of row ``c`` in column ``k cols + c`` of a QK product :attr:`qk_cols` wide, a
        row's terms in one thread (:func:`foscar.cute.operands_e4m3.sum_term_blocks`); else in the 8 columns."""
        return self.k_e4m3 and (self.rows > HEADS // 2 or self.q_terms > 2)

    @property
    def qk_cols(self) -> int:
        """The QK product's N: :attr:`q_terms` times the columns with unstacked :attr:`term_blocks`, else the columns."""
        return self.q_terms * self.cols if self.term_blocks and not self.stacked_terms else self.cols

    @property
    def qk_depth(self) -> int:
        """The contraction of the QK product: the head dim, :attr:`q_terms` times it with :attr:`stacked_terms`."""
        return self.q_terms * self.head_dim if self.stacked_terms else self.head_dim

    @property
    def red_slots(self) -> int:
        """Reduction slots per warp in shared memory: column maxima, ``|s'_V|`` maxima, channel-wise V's ``P~`` sums."""
        return 2 * self.cols

    @property
    def kc(self) -> int:
        """Channel groups of a token-wise K (1 when channel-wise)."""
        return 1 if self.k_channel else self.head_dim // self.group_size

    @property
    def vc(self) -> int:
        """Channel groups of a token-wise V (1 when channel-wise)."""
        return 1 if self.v_channel else self.head_dim // self.group_size

    @property
    def k_par_words(self) -> int:
        """Per-thread K ``(s', z')`` registers of a tile: its two token rows' per channel group, or (channel-wise
        K, v0) the token group's of the channels it folds into ``Q'`` (:data:`~foscar.cute.fold_map.FOLD_CHANNELS`)."""
        from .fold_map import FOLD_CHANNELS
        return 2 * FOLD_CHANNELS if self.k_channel else 4 * self.kc

    @property
    def par_words(self) -> int:
        """Per-thread ``(s', z')`` registers of a tile: K's, then V's (from :attr:`k_par_words`)."""
        return self.k_par_words + 4 * self.vc

    @property
    def flush(self) -> int:
        """Tokens quantized together (``KVFormat.flush``)."""
        return self.group_size if (self.k_channel or self.v_channel) else 1

    @property
    def causal(self) -> bool:
        """Whether the columns have causal limits: a step of several tokens, or a part of one (:attr:`tail`)."""
        return self.step > 1 or self.tail > 0

    @property
    def windows(self) -> bool:
        """Whether the format keeps BF16 windows (a sink, or a recent ring: a window or a channel-wise group)."""
        return self.sink > 0 or self.recent + self.flush - 1 > 0

    @property
    def k_param_words(self) -> int:
        """Floats of a tile's K ``(s', z')`` (per token and channel group, or the token group's row; FP4: words)."""
        if self.fp4_block:
            return TILE * self.fp4_blocks // 4
        return 2 * self.head_dim if self.k_channel else 2 * TILE * self.kc

    @property
    def k_param_rows(self) -> int:
        """Rows of K ``(s', z')`` per page: tiles, or token groups (at least one)."""
        return max(1, self.page // self.group_size) if self.k_channel else self.page // TILE

    @property
    def v_param_words(self) -> int:
        """Floats of a tile's V ``(s', z')``; FP4: words of the tile's block-scale bytes."""
        if self.fp4_block:
            return TILE * self.fp4_blocks // 4
        return 2 * self.head_dim if self.v_channel else 2 * TILE * self.vc

    @property
    def v_param_rows(self) -> int:
        """Rows of V ``(s', z')`` per page."""
        return max(1, self.page // self.group_size) if self.v_channel else self.page // TILE

    @property
    def acc_elems(self) -> int:
        """O^T accumulator elements per thread."""
        return self.head_dim * self.cols // THREADS

    @property
    def k_words(self) -> int:
        """Packed K words per thread per tile."""
        return thread_k_words(self.bits, self.head_dim)

    @property
    def tile_words(self) -> int:
        """Packed words of one tensor's 64-token tile (one KV head)."""
        return tile_words(self.bits, self.head_dim)

    @property
    def tma_box(self) -> tuple[int, int]:
        """``(ci, co)``: a tile's words as ``co`` TMA boxes of ``ci <= 256`` words (a box's extent limit)."""
        ci = min(self.tile_words, 256)
        return ci, self.tile_words // ci

    @property
    def v_blocks(self) -> int:
        """V pack blocks per tile."""
        return TILE // v_block_tokens(self.bits)

    @property
    def mh(self) -> int:
        """m64 blocks of the head dim (the row blocks of V^T)."""
        return self.head_dim // 64

    def v_group(self, m: int) -> int:
        """The channel group of token-wise V that m64 block ``m`` of V^T (of O^T) belongs to."""
        return m * self.vc // self.mh


def columns_for(rows: int) -> int:
    """The wgmma N of ``rows`` query rows: 8, 16 or 32 (the least power of two from :data:`HEADS` that holds them)."""
    return max(HEADS, 1 << (rows - 1).bit_length())


#: The K operands: BF16 by mantissa injection, E4M3 by placement with Q as two E4M3 terms, three (``e4m3x3``: to 2^-12
#: of the row's largest value) or four integer digits (``e4m3d4``: to 2^-15, each k32 step exact in FP8; accuracy)
K_OPERANDS = ("bf16", "e4m3", "e4m3x3", "e4m3d4")
TILES_PER_PASS = (1, 2)  #: KV tiles per softmax pass a kernel takes (:attr:`Sm90Config.tiles_per_pass`)


def max_rows(fmt) -> int:
    """The most query rows of one KV head a kernel takes for ``fmt``: :data:`MAX_COLS`, 8 at head dim 256."""
    return HEADS if fmt.head_dim == 256 else MAX_COLS


def default_stages(bits: int, head_dim: int) -> int:
    """v1's stages per consumer unless a launch asks: :data:`DEEP_STAGES` where a tile's K and V codes take at
    most :data:`DEEP_STAGE_BYTES` (two CTAs an SM still fit), else :data:`STAGES`."""
    return DEEP_STAGES if 2 * tile_words(bits, head_dim) * 4 <= DEEP_STAGE_BYTES else STAGES


def clear_switch_caches() -> None:
    """Forget what was decided under other :data:`SWITCHES`: :func:`config_for`'s configs, the operands and passes
    of :func:`foscar.cute.launch.default_variant` and ``auto``'s backend choices (:data:`WINDOWED_STEPS`)."""
    import sys
    config_for.cache_clear()
    launch = sys.modules.get("foscar.cute.launch")
    if launch is not None:
        launch.default_variant.cache_clear()
    api = sys.modules.get("foscar.api")
    if api is not None:
        api.clear_selection_cache()


@functools.lru_cache(maxsize=256)  # host time per call
def config_for(fmt, gqa: int, page: int, k_operand: str = "bf16", tiles_per_pass: int = 1,
               step: int = 1, stages: int | None = None, tail: int = 0) -> Sm90Config:
    """The static configuration for a cache format (``KVFormat``), GQA ratio (query heads per KV head), page size, K
    operand (:data:`K_OPERANDS`), tiles per softmax pass (:data:`TILES_PER_PASS`) and query tokens per sequence
    (``step``); the injection constants are the Triton kernels' (:func:`foscar.format.injection_constants`,
    :func:`foscar.format.fold_constants`): one home. The ``gqa * step`` query rows of a KV head are the wgmma N columns,
    at most :func:`max_rows`. E4M3 K operands take token-wise K (up to 4 query rows the two Q terms share the 8 columns,
    beyond they take separate column blocks, :attr:`Sm90Config.term_blocks`), and channel-wise K where
    :data:`CHANNEL_K_E4M3` is set; two tiles per pass take one token and at most 4 query heads per KV head (the second
    tile's scores in the other four columns), token-wise K and V or, switched on, a channel-wise axis whose token groups
    hold a pass (E4M3 K's ``Q'``, :data:`PAIR_CHANNEL_V`); ``tail``: the step's tokens end that many before the
    sequence's (a part of a longer step). ``stages``: v1's stages per consumer (:data:`STAGE_CHOICES`; unset,
    :func:`default_stages`); whether they fit the CTAs of an SM is the launch's check
    (:func:`foscar.cute.budget.fits_shared_memory`)."""
    import torch

    from ..errors import InvalidArgumentError, UnsupportedError
    from ..format import E4M3_PLACEMENT, fold_constants, injection_constants, operand_for
    from .v_operands import v_operand_fields
    if k_operand not in K_OPERANDS:
        raise InvalidArgumentError("k_operand", f"one of {K_OPERANDS}", k_operand)
    if tiles_per_pass not in TILES_PER_PASS:
        raise InvalidArgumentError("tiles_per_pass", f"one of {TILES_PER_PASS}", tiles_per_pass)
    if fmt.is_fp4:
        from .config_fp4 import fp4_config
        return fp4_config(fmt, gqa, page, k_operand, tiles_per_pass, step, stages, tail)
    g = fmt.group_size
    if g % TILE or ("token" in (fmt.k_axis, fmt.v_axis) and fmt.head_dim % g):
        raise UnsupportedError(f"k_axis={fmt.k_axis!r}, v_axis={fmt.v_axis!r}, group_size={g}",
                               "the CuTe kernels need g a multiple of 64 (channels of a token-wise axis, tokens of "
                               "a channel-wise one), dividing the head dim for a token-wise axis")
    if not isinstance(step, int) or step < 1:
        raise InvalidArgumentError("step", "query tokens per sequence, an int >= 1", step)
    if fmt.head_dim not in (64, 128, 256) or gqa * step > MAX_COLS or page % TILE or fmt.mapping != "bf16":
        raise UnsupportedError(f"head_dim={fmt.head_dim}, gqa={gqa}, q_len={step}, page={page}, mapping={fmt.mapping!r}",
                               f"the CuTe kernels need head_dim 64/128/256, gqa * q_len <= {MAX_COLS} query rows per "
                               "KV head, pages of 64k tokens, bf16")
    if fmt.head_dim == 256 and (fmt.k_axis != "token" or fmt.group_size < 128 or gqa * step > HEADS
                                or k_operand != "bf16" or tiles_per_pass != 1):
        raise UnsupportedError(f"head_dim=256 with k_axis={fmt.k_axis!r}, group_size={g}, gqa={gqa}, q_len={step}, "
                               f"k_operand={k_operand!r}, tiles_per_pass={tiles_per_pass}",
                               "head dim 256 takes token-wise K, groups of 128 or 256, gqa * q_len <= 8, BF16 K "
                               "operands and one tile a pass (the registers of one CTA per SM)")
    e4m3 = k_operand != "bf16"
    q_terms, digits = {"e4m3x3": 3, "e4m3d4": 4}.get(k_operand, 2), k_operand == "e4m3d4"
    rows = gqa * step
    if e4m3 and fmt.k_axis == "channel" and (not CHANNEL_K_E4M3 or q_terms != 2 or step != 1
                                             or gqa > CHANNEL_K_E4M3_ROWS or tiles_per_pass != 2 and PRODUCER_Q_FOLD):
        raise UnsupportedError(f"k_operand={k_operand!r} with k_axis='channel', gqa={gqa}, q_len={step}",
                               "E4M3 K operands take channel-wise K where foscar.cute.config.CHANNEL_K_E4M3 is set, "
                               f"with two Q terms, one token, gqa <= {CHANNEL_K_E4M3_ROWS} (CHANNEL_K_E4M3_ROWS; "
                               "two tiles a pass where the producer folds)")
    most = {3: 2 * HEADS, 4: HEADS // 2}.get(q_terms, MAX_COLS)  # three terms: measured up to 16 rows
    if e4m3 and (rows > most or (step > 1 and rows <= HEADS // 2)):
        raise UnsupportedError(f"k_operand={k_operand!r} with gqa={gqa}, q_len={step}",
                               f"{k_operand!r} K operands take gqa * q_len <= {most} (a step: more than 4 rows)")
    if q_terms > 2 and tiles_per_pass == 2:
        raise UnsupportedError(f"k_operand={k_operand!r} with tiles_per_pass=2", f"Q's {q_terms} E4M3 terms take one "
                               "tile a pass (the second tile's scores sit in the columns two terms leave free)")
    k_pass = fmt.k_axis == "token" or (e4m3 and g >= 2 * TILE)  # channel-wise K: a pass within one token group
    v_pass = fmt.v_axis == "token" or (PAIR_CHANNEL_V and g >= 2 * TILE)
    if tiles_per_pass == 2 and (not k_pass or not v_pass or gqa > HEADS // 2 or step > 1 or tail):
        raise UnsupportedError(f"tiles_per_pass=2 with k_axis={fmt.k_axis!r}, v_axis={fmt.v_axis!r}, gqa={gqa}, "
                               f"q_len={step}, k_operand={k_operand!r}, group_size={g}", "two tiles per softmax pass "
                               "take gqa <= 4, one token, token-wise K or (E4M3 K operands) channel-wise K, and "
                               "token-wise V or (foscar.cute.config.PAIR_CHANNEL_V) channel-wise V, with token groups "
                               "of two tiles or more for a channel-wise axis")
    if e4m3:
        k = {"K_PATTERN": 0, "K_SHL": 0, **fold_constants("K", E4M3_PLACEMENT, fmt)}
    else:
        k = {**injection_constants("K", operand_for(torch.bfloat16, fmt.bits), fmt), "K_FACTOR": 1.0}
    pivot = float(k["K_PIVOT"])
    placed = 4.0 if e4m3 and fmt.bits == 2 else 1.0  # token half 1's operand is 4 q 2^-9 (k_placement_e4m3)
    producer_fold = PRODUCER_Q_FOLD and fmt.k_axis == "channel"
    cols, token_axes, D = columns_for(rows), fmt.k_axis == fmt.v_axis == "token", fmt.head_dim
    wide_cols = WIDE_EIGHT_COLUMNS if cols <= HEADS else WIDE_CONSUMERS or (step > 1 and cols in WIDE_STEP_COLUMNS)
    wide = not producer_fold and wide_cols and (token_axes if tiles_per_pass == 2
                                                else fmt.k_axis == "token" or g < 2 * TILE)
    pivot_mma = cols in PIVOT_MMA_COLS and fmt.v_axis == "token" and g >= D and (not wide or fmt.bits in OWN_WGMMA_BITS)
    v_fields = v_operand_fields(fmt, pivot_mma)
    stages = default_stages(fmt.bits, fmt.head_dim) if stages is None else stages
    if stages not in STAGE_CHOICES:
        raise InvalidArgumentError("stages", f"one of {STAGE_CHOICES}", stages)
    # a rotated cache stages Q through the ring's first stage; the producer's Q' reads Q staged before its loop
    prologue = "q_first" if fmt.rotation is not None or producer_fold else PROLOGUE_BY_BITS.get(fmt.bits, "q_first")
    if prologue not in PROLOGUES:  # the kernel branches on the names: a misspelt one must not run as q_first
        raise InvalidArgumentError("foscar.cute.config.PROLOGUE_BY_BITS", f"values of {PROLOGUES}", prologue)
    lazy = tiles_per_pass == 2 or (LAZY_ONE_TILE if fmt.v_axis == "token" else LAZY_CHANNEL_V)
    pair_p = cols in PAIR_P_SCALE_COLS and fmt.v_axis == "token"
    return Sm90Config(bits=fmt.bits, head_dim=fmt.head_dim, page=page, gqa=gqa, k_pattern=k["K_PATTERN"],
                      k_shl=k["K_SHL"], k_pivots=(pivot, pivot * placed), k_mid=float(k["K_MID"]),
                      k_e4m3=e4m3, q_terms=q_terms, q_digits=digits,
                      k_factors=(float(k["K_FACTOR"]), float(k["K_FACTOR"]) / placed),
                      **v_fields, sink=fmt.sink, recent=fmt.recent,
                      k_channel=fmt.k_axis == "channel", group_size=fmt.group_size,
                      v_channel=fmt.v_axis == "channel", tiles_per_pass=tiles_per_pass,
                      rotation=fmt.rotation is not None, step=step, tail=tail, cols=cols,
                      stages=stages,
                      lazy_rescale=lazy, pair_vote=PAIR_VOTE and lazy and pair_p,
                      prologue=prologue,
                      trigger_dependents=COMBINE_PDL or (COMBINE_PDL_WINDOWS and combine_attends_windows(fmt)),
                      qk_promote=(fmt.bits in QK_PROMOTE_BITS or digits) and e4m3 and fmt.k_axis == "token"
                      and rows <= HEADS // 2 and fmt.head_dim // fmt.group_size <= 1, producer_fold=producer_fold,
                      fold_unrolled=producer_fold and e4m3 and fmt.bits in FOLD_UNROLLED_BITS,
                      fold_f16_split=FOLD_F16_SPLIT and e4m3 and fmt.k_axis == "channel",
                      p_column_major=cols in P_COLUMN_MAJOR_COLS, start_prefetch=START_PREFETCH,
                      pair_p_scale=pair_p,
                      stacked_terms=STACKED_TERMS and e4m3 and q_terms == 2 and rows > HEADS,
                      shared_q_scale=SHARED_Q_SCALE and STACKED_TERMS and e4m3 and q_terms == 2 and rows > HEADS,
                      mask_branch=PAIR_MASK_BRANCH if tiles_per_pass == 2 else MASK_BRANCH and (cols > HEADS or step > 1),
                      pivot_mma=pivot_mma, column_sum_mma=cols in COLUMN_SUM_MMA_COLS and fmt.v_axis == "channel" and
                      not wide and len(set(v_fields["v_factors"])) == 2, own_wgmma=fmt.bits in OWN_WGMMA_BITS and e4m3
                      and D == 128 and (cols == MAX_COLS or cols not in P_COLUMN_MAJOR_COLS)  # MN-major P': 32 only
                      and (tiles_per_pass == 2 or OWN_WGMMA_STEPS and STACKED_TERMS and wide and cols == MAX_COLS
                           and token_axes),
                      overlap=cols in OVERLAP_COLS and tiles_per_pass == 1 and LAZY_ONE_TILE and token_axes
                      and g >= fmt.head_dim,
                      qk_zeroing=tiles_per_pass == 2 and fmt.bits in QK_ZEROING_BITS,
                      flat_words=FLAT_WORDS or cols in FLAT_WORDS_COLS,
                      wide=wide, one_copy=ONE_COPY_CONSUMERS if cols == MAX_COLS and fmt.bits in ONE_COPY_BITS else ())

