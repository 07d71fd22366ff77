"""The static configuration of the Hopper decode kernels for an FP4 block format (``KVFormat.scheme``):
what :func:`foscar.cute.config.config_for` returns, or refuses, for NVFP4 and MXFP4 caches. Plain Python, as
:mod:`foscar.cute.config`.

The kernel is v1's tile step on the INT4 words (the E2M1 codes sit where INT4 codes do, ``docs/layout.md``):
token-wise K and V with one "channel group" (the head dim) and no offsets, the operands FP16 by placement times
their block scales (:mod:`foscar.cute.operands_fp4`), the query an FP16 operand scaled per row by a power of
two. What it takes (:data:`FP4_LIMITS`): NVFP4 and MXFP4 (its E8M0 scales taken relative to each token's largest),
head dim 64 or 128, v1 with 16-bit K operands, one or two tiles a softmax pass.
"""
from __future__ import annotations

#: What the CuTe kernel takes of the FP4 block formats (beyond :func:`foscar.cute.config.config_for`'s other
#: limits: pages of 64k tokens, ``gqa * q_len`` query rows)
FP4_LIMITS = ("the CuTe kernel takes NVFP4 and MXFP4 at head dim 64 or 128 with k_operand='bf16' (16-bit K "
              "operands: FP16 for the FP4 codes), one tile a softmax pass or two (gqa <= 4, one token), v1 "
              "(warp_specialized)")
#: The operands' unit: a code's FP16 placement ``v 2^-14`` times its block scale ``s`` (FP16, from E4M3 exactly)
#: is ``v s 2^-14``, exact for every E2M1 value and E4M3 scale (the product's lowest bit is at least ``2^-10 x
#: 2^-14``, FP16's subnormal spacing), at most ``6 x 448 x 2^-14``; the factor ``T 2^FP4_UNIT_SHIFT`` is every
#: token row's ``s'`` (``T`` the tensor's scale)
FP4_UNIT_SHIFT = 14


def fp4_config(fmt, gqa: int, page: int, k_operand: str, tiles_per_pass: int, step: int, stages: int | None,
               tail: int = 0):
    """:func:`~foscar.cute.config.config_for` of an FP4 block format ``fmt``: its
    :class:`~foscar.cute.config.Sm90Config`, or an ``UnsupportedError`` naming what the kernel does not take (the
    limits every format shares, then :data:`FP4_LIMITS`). The switches of :mod:`foscar.cute.config` are read
    when it is called."""
    from ..errors import UnsupportedError
    from . import config as c
    if gqa * step > c.MAX_COLS or page % c.TILE:
        raise UnsupportedError(f"gqa={gqa}, q_len={step}, page={page}", f"the CuTe kernels need gqa * q_len <= "
                               f"{c.MAX_COLS} query rows per KV head and pages of 64k tokens")
    if (fmt.scheme not in ("nvfp4", "mxfp4") or fmt.head_dim not in (64, 128) or k_operand != "bf16"
            or tiles_per_pass not in (1, 2)
            or (tiles_per_pass == 2 and (gqa > 4 or step > 1 or tail))):
        raise UnsupportedError(f"scheme={fmt.scheme!r}, head_dim={fmt.head_dim}, k_operand={k_operand!r}, "
                               f"tiles_per_pass={tiles_per_pass}", FP4_LIMITS)
    if stages is None:
        stages = c.default_stages(4, fmt.head_dim)
    elif stages not in c.STAGE_CHOICES:
        from ..errors import InvalidArgumentError
        raise InvalidArgumentError("stages", f"one of {c.STAGE_CHOICES}", stages)
    prologue = "q_first" if fmt.rotation is not None else c.PROLOGUE_BY_BITS.get(4, "q_first")
    lazy, pair_p = c.LAZY_ONE_TILE or tiles_per_pass == 2, c.columns_for(gqa * step) in c.PAIR_P_SCALE_COLS
    trigger = c.COMBINE_PDL or (c.COMBINE_PDL_WINDOWS and c.combine_attends_windows(fmt))
    return c.Sm90Config(bits=4, head_dim=fmt.head_dim, page=page, gqa=gqa, k_pattern=0, k_shl=0, k_pivots=(0.0, 0.0),
                        k_mid=0.0, v_patterns=(0, 0), v_shls=(0, 0), v_pivots=(0.0, 0.0), v_mid=0.0, sink=fmt.sink,
                        recent=fmt.recent, group_size=fmt.head_dim, rotation=fmt.rotation is not None, step=step,
                        tail=tail, cols=c.columns_for(gqa * step), stages=stages,
                        lazy_rescale=lazy, prologue=prologue,
                        tiles_per_pass=tiles_per_pass, trigger_dependents=trigger,
                        fp4_block=fmt.group_size, p_column_major=c.columns_for(gqa * step) in c.P_COLUMN_MAJOR_COLS,
                        pair_p_scale=pair_p, pair_vote=c.PAIR_VOTE and lazy and pair_p, start_prefetch=c.START_PREFETCH)
