"""Q as integer digits in base 16 (:func:`foscar.e4m3.split_digits`, the CuTe kernels' ``k_operand="e4m3d4"``):
exact E4M3 values whose products with the placed codes sum exactly in the FP8 wgmma's accumulation, where the
residual terms' products are rounded toward zero (:func:`foscar.e4m3.truncating_step_sum`); and the folded spec
with four digits held to the BF16-operand kernels' error."""
import pytest
import torch
from _helpers import rel

import foscar
from foscar.e4m3 import DIGIT_TOP, round_e4m3, scale_exponent, split_digits, split_terms, truncating_step_sum
from foscar.errors import InvalidArgumentError
from foscar.synthetic import stress_inputs


def _rows(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(64, 128, generator=g) * torch.exp2(torch.randint(-20, 20, (64, 1), generator=g))).float()


@pytest.mark.parametrize("terms", (1, 2, 3, 4))
def test_split_digits(terms):
    """Each digit is an integer (an exact E4M3 value) times ``16^-k 2^-e``, the first at most 14 in magnitude and
    the others 8; their sum holds ``x`` to half a unit of the last digit, ``16^-(terms - 1) / 14`` of the row's
    largest value at most (``2^-e`` puts it above 7)."""
    x = _rows(terms)
    parts = split_digits(x, terms, (-1,))
    assert len(parts) == terms
    top = x.double().abs().amax(-1, keepdim=True)
    e = scale_exponent(top) - 5
    scaled = torch.ldexp(top, e)
    assert bool(((scaled > DIGIT_TOP / 2) & (scaled <= DIGIT_TOP)).all())
    for k, p in enumerate(parts):
        d = torch.ldexp(p, e) * 16.0 ** k
        assert torch.equal(d, d.round()) and torch.equal(round_e4m3(d), d)
        assert float(d.abs().max()) <= (DIGIT_TOP if k == 0 else 8)
    err = (x.double() - sum(parts)).abs() / top
    assert float(err.max()) <= 0.5 * 16.0 ** -(terms - 1) / 7


@pytest.mark.parametrize("bits,placed", [(2, 1), (2, 4), (4, 1)])
def test_digit_products_sum_exactly_in_the_fp8_accumulation(bits, placed):
    """A k32 step of the QK product (codes placed as ``q 2^-9``, INT2's token half 1 as ``4 q 2^-9``) against four
    digits sums exactly in the truncating model of the FP8 accumulation, from a zero accumulator (each k-step
    promoted to FP32, as ``e4m3d4`` runs); against three residual terms some sums lose their low bits."""
    g = torch.Generator().manual_seed(bits * placed)
    codes = torch.randint(0, 1 << bits, (512, 32), generator=g).double() * placed * 2.0 ** -9
    q = torch.randn(1, 32, generator=g, dtype=torch.float64)
    for parts, exact_sums in ((split_digits(q, 4, (-1,)), True), (split_terms(q, 3, (-1,)), False)):
        e = scale_exponent(q.abs().amax()) - (5 if exact_sums else 0)
        for k, p in enumerate(parts):
            unit = torch.ldexp(p, e) * 16.0 ** k  # the E4M3 values the tensor core takes (their scales after the MMA)
            assert torch.equal(round_e4m3(unit), unit)
            prods = codes * unit
            got = truncating_step_sum(prods, torch.zeros(prods.shape[0], dtype=torch.float64))
            if exact_sums:
                assert torch.equal(got, prods.sum(-1))
        if not exact_sums:  # the last term's products are the finest
            assert not torch.equal(got, prods.sum(-1))
    with pytest.raises(InvalidArgumentError, match="acc"):
        truncating_step_sum(prods, torch.zeros(3, dtype=torch.float64))
    with pytest.raises(InvalidArgumentError, match="bits"):
        truncating_step_sum(prods, torch.zeros(prods.shape[0], dtype=torch.float64), bits=0)
    nan = prods.clone()
    nan[0, 0] = float("nan")  # a NaN product stays NaN in its sum, never a finite number
    got = truncating_step_sum(nan, torch.zeros(nan.shape[0], dtype=torch.float64))
    assert bool(got[0].isnan()) and bool(got[1:].isfinite().all())


@pytest.mark.parametrize("bits", (2, 4))
@pytest.mark.parametrize("data", ("stress", "random"))
def test_four_digits_keep_the_bf16_operands_bound(data, bits):
    """The folded spec with Q as four digits (``q_terms="digits"``) at the BF16-operand emulation's error on the same
    cache, within 1% (its FP16 PV operands dominate both; the digits hold Q to 2^-15 of a row's largest value);
    digits need E4M3 K operands."""
    fmt = foscar.KVFormat(bits=bits, head_dim=128, group_size=128)
    if data == "stress":
        q, k, v = stress_inputs(3, 8, 2, 2048, 128, seed=bits)
    else:
        g = torch.Generator().manual_seed(bits)
        q, k, v = torch.randn(3, 8, 128, generator=g), torch.randn(3, 2, 2048, 128, generator=g), \
            torch.randn(3, 2, 2048, 128, generator=g)
    cache = foscar.quantize_kv(k, v, fmt, page_size=64, seq_lens=torch.tensor([2048, 1000, 1]))
    q = q.bfloat16()
    exact = foscar.decode_exact(q, cache)
    kw = dict(num_splits=4, dtype=torch.float32, pv_operand_dtype=torch.float16)
    base = foscar.decode_folded(q, cache, operand_dtype=torch.bfloat16, **kw)
    four = foscar.decode_folded(q, cache, operand_dtype=torch.float8_e4m3fn, operand_terms=4, q_terms="digits", **kw)
    assert rel(four, exact) <= 1.01 * rel(base, exact), (rel(four, exact), rel(base, exact))
    with pytest.raises(InvalidArgumentError, match="q_terms"):
        foscar.decode_folded(q, cache, operand_dtype=torch.bfloat16, q_terms="digits")


def test_the_digits_study_prints_its_table(capsys):
    """``benchmarks/e4m3_digits.py`` at a short length: a row of four errors a length and seed, the promoted four
    digits' error that of Q's digits alone (nothing lost in the accumulation)."""
    import os
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
    import e4m3_digits
    e4m3_digits.main(["--lengths", "256", "--seeds", "0"])
    rows = [r for r in capsys.readouterr().out.splitlines() if r.startswith("| 256 |")]
    assert len(rows) == 1
    errs = [float(x) for x in rows[0].strip("|").split("|")[2:]]
    assert len(errs) == 4 and all(e == e for e in errs) and errs[2] == errs[3]
