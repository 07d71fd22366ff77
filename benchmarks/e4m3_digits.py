"""The QK product's error through the FP8 accumulation, Q as E4M3 residual terms against integer digits, on the CPU:

    python benchmarks/e4m3_digits.py --lengths 4096 16384 --seeds 0 1 2

The stress input (:func:`foscar.synthetic.stress_inputs`, B 1, Hq 8, Hkv 2, D 128, a BF16 query) quantized INT2
min-max, token-wise K (g 128): each KV head's scores from the placed codes (``q 2^-9``, token half 1 of INT2 as ``4 q
2^-9``, as ``k_operand`` E4M3 places them) times each term of Q, four k32 steps through
:func:`foscar.e4m3.truncating_step_sum` (the FP8 wgmma's accumulation, about 14 bits), one accumulator a term
(``promoted``: one a k32 step, summed in FP32, as ``e4m3d4`` runs), then the fold's offset correction, the softmax
and ``P V`` in float64. Prints, per length and seed, the output's largest relative error over the KV heads against
the same attention with exact scores (float64 over the dequantized cache): three residual terms
(:func:`foscar.e4m3.split_terms`, ``e4m3x3``), three and four digits (:func:`foscar.e4m3.split_digits`), and four
digits with every addend kept (``--bits 64``: the digits' own rounding of Q).
"""
import argparse
import math

import torch

import foscar
from foscar.e4m3 import FP8_SUM_BITS, split_digits, split_terms, truncating_step_sum
from foscar.synthetic import stress_inputs


def scores(codes: torch.Tensor, terms: list, promoted: bool, bits: int) -> torch.Tensor:
    """``sum_d codes[t, d] Q[g, d]`` by k32 steps of the FP8 accumulation model, one accumulator a term (``promoted``:
    one a k32 step), summed in float64: ``[L, G]``."""
    L, D = codes.shape
    total = torch.zeros(L, terms[0].shape[0], dtype=torch.float64)
    for t in terms:
        acc = torch.zeros_like(total)
        for k0 in range(0, D, 32):
            prods = codes[:, None, k0:k0 + 32] * t[None, :, k0:k0 + 32]
            if promoted:  # each k32 step from a zero accumulator, the steps summed in float64
                acc = acc + truncating_step_sum(prods, torch.zeros_like(acc), bits)
            else:
                acc = truncating_step_sum(prods, acc, bits)
        total += acc
    return total


def kv_heads(L: int, seed: int) -> list:
    """Per KV head of the stress input quantized INT2 min-max: ``(codes placed, s, z, q rows, k, v)``, K and V
    dequantized."""
    q, k, v = stress_inputs(1, 8, 2, L, 128, seed=seed, dtype=torch.bfloat16)
    fmt = foscar.KVFormat(bits=2, head_dim=128, group_size=128)
    kd, vd = foscar.quantize_kv(k.float(), v.float(), fmt, quantizer="minmax").dequantize(torch.float64)
    placed = torch.where((torch.arange(L) // 8 % 2 == 1)[:, None], 4.0, 1.0)  # token half 1: 4 q 2^-9
    G, out = 4, []
    for h in range(2):
        kk = kd[0, h, :L]
        lo, hi = kk.amin(-1, keepdim=True), kk.amax(-1, keepdim=True)
        s = torch.where(hi > lo, (hi - lo) / 3, torch.ones_like(hi))
        c = torch.round((kk - lo) / s)  # the codes (each token's min-max group of 128 channels)
        out.append((c * placed * 2.0 ** -9, placed, s, lo, q[0, h * G:(h + 1) * G].double(), kk, vd[0, h, :L]))
    return out


def error(heads: list, split, promoted: bool, bits: int) -> float:
    """The output's largest relative error over the KV heads against exact scores."""
    worst = 0.0
    for codes, placed, s, lo, qq, kk, vv in heads:
        mm = scores(codes, split(qq), promoted, bits) * 2.0 ** 9 / placed
        got = (s * mm + lo * qq.sum(-1)) / math.sqrt(128)
        want = kk @ qq.T / math.sqrt(128)
        o, ref = torch.softmax(got, 0).T @ vv, torch.softmax(want, 0).T @ vv
        worst = max(worst, float((o - ref).norm() / ref.norm()))
    return worst


VARIANTS = {
    "3 residual terms": (lambda x: split_terms(x, 3, (-1,)), False, FP8_SUM_BITS),
    "3 digits, promoted": (lambda x: split_digits(x, 3, (-1,)), True, FP8_SUM_BITS),
    "4 digits, promoted": (lambda x: split_digits(x, 4, (-1,)), True, FP8_SUM_BITS),
    "4 digits, every bit kept": (lambda x: split_digits(x, 4, (-1,)), True, 64),
}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    a = p.parse_args(argv)
    print(f"INT2 min-max, the FP8 accumulation kept to {FP8_SUM_BITS} bits; output error against exact scores\n")
    print("| L | seed | " + " | ".join(VARIANTS) + " |")
    print("|---|---|" + "---|" * len(VARIANTS))
    for L in a.lengths:
        for seed in a.seeds:
            heads = kv_heads(L, seed)
            errs = [error(heads, *v) for v in VARIANTS.values()]
            print(f"| {L} | {seed} | " + " | ".join(f"{e:.2e}" for e in errs) + " |", flush=True)


if __name__ == "__main__":
    main()
