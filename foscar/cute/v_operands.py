"""V^T's FP16 operands, per token half of a k16 block: by placement (``q 2^(shl - 24)``, no offset), channel-wise V
too where :data:`~foscar.cute.config.V_CHANNEL_PLACEMENT` (else by one mantissa injection, ``q + 2^(10 - shl)``);
token-wise V's bits may also differ by channel-row class. The ``v_*`` fields of :class:`~foscar.cute.config.Sm90Config`
that the operands (:func:`foscar.cute.operands.build_vt_registers`) and the folds (:mod:`foscar.cute.folds`) read."""
from __future__ import annotations

import torch

from ..format import f16_placement, fold_constants, injection, injection_constants, operand_for
from . import config
from .fragment import v_class_shls, v_token_half_shls


def v_operand_fields(fmt, pivot_mma: bool) -> dict:
    """The config's ``v_patterns``, ``v_shls``, ``v_row_shls``, ``v_pivots``, ``v_mid``, ``v_factors`` and ``v_unit``
    for a cache of format ``fmt`` (:data:`~foscar.cute.config.V_LOW_PLACEMENT`,
    :data:`~foscar.cute.config.V_ROW_SHIFTS`, :data:`~foscar.cute.config.V_CHANNEL_PLACEMENT`; ``pivot_mma``: the
    pivot sums' MMA, which takes one row class)."""
    row_shls = (0, 0)
    token = fmt.v_axis == "token"
    placement = token or config.V_CHANNEL_PLACEMENT
    if not placement:  # channel-wise V injected: the acc-fold takes one pivot for every token of a tile
        v_ops = (operand_for(torch.float16, fmt.bits),) * 2
    else:
        if token and config.V_ROW_SHIFTS and not pivot_mma:
            shls, row_shls = v_class_shls(fmt.bits, fmt.head_dim)
        else:  # by placement no offset bounds the codes' bits from below
            shls = v_token_half_shls(fmt.bits, fmt.head_dim, 0 if config.V_LOW_PLACEMENT else 4)
        v_ops = tuple(injection("f16", 1 << (10 - shl)) for shl in shls)
    v0, v1 = (injection_constants("V", op, fmt) for op in v_ops)
    assert v0["V_MID"] == v1["V_MID"]  # the middle code's value does not depend on the placement
    v_factors, v_unit = (1.0, 1.0), 1.0
    if placement:  # the same bits, no offset: q 2^(shl - 24), row class 0's
        shls = (v0["V_SHL"], v1["V_SHL"])
        folds = [fold_constants("V", f16_placement(shl), fmt) for shl in shls]
        if token:  # P' of half h carries 2^(V_PRODUCT_BIT - shl_h): every product in the units of that bit's codes,
            # whatever bits they sit at (the stress study's error no lower with it than without: results doc)
            gain = 2.0 ** max(0, config.V_PRODUCT_BIT - min(shls))
            v_unit = folds[shls.index(min(shls))]["V_FACTOR"] / gain
        else:  # P~ = fp16(P v_factors[h]), P <= 2^RESCALE_HEADROOM: the higher half's factor 1, the other's 2^(shl gap)
            v_unit = folds[shls.index(max(shls))]["V_FACTOR"]
        v_factors = tuple(f["V_FACTOR"] / v_unit for f in folds)
        for v, f in zip((v0, v1), folds):
            v.update(V_PATTERN=0, V_PIVOT=f["V_PIVOT"] * v_unit, V_MID=f["V_MID"])
    pivots = (float(v0["V_PIVOT"]), float(v1["V_PIVOT"]))  # the pivot sums' A: FP16, exact (1.5 or 7.5 times 2^k)
    assert all(float(torch.tensor(c, dtype=torch.float16)) == c for c in pivots), pivots
    # the middle code's value in the products' units, the same for both halves (channel-wise V's acc-fold takes one)
    assert pivots[0] * v_factors[0] == pivots[1] * v_factors[1], (pivots, v_factors)
    return dict(v_patterns=(v0["V_PATTERN"], v1["V_PATTERN"]), v_shls=(v0["V_SHL"], v1["V_SHL"]), v_row_shls=row_shls,
                v_pivots=pivots, v_mid=float(v0["V_MID"]), v_factors=v_factors, v_unit=v_unit)
