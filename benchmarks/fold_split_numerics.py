"""Channel-wise K's ``Q'`` split into two E4M3 terms with ``Q' 2^e`` rounded to FP16 first (the kernels'
``FOLD_F16_SPLIT``) against the split from FP32, emulated on the CPU:

    python benchmarks/fold_split_numerics.py --lengths 1024 16384 --seeds 0 1

The stress input (:func:`foscar.synthetic.stress_inputs`, B 1, Hq 32, Hkv 8, D 128, a BF16 query) quantized min-max,
channel-wise K (g 128) with token- and channel-wise V, INT2 and INT4; ``decode_folded`` with E4M3 K operands in two
terms and FP16 PV operands, once with ``Q'`` split from FP32 and once from FP16 (:data:`foscar.e4m3.Q_PRIME_FP16_FIRST`,
which the emulator reads through the module at each call: the run sets it there). Prints each output's relative L2 error
against exact attention over the dequantized cache, beside BF16 attention's on the same cache.
"""
import argparse
from unittest import mock

import torch

import foscar
from foscar import e4m3
from foscar.bench.accuracy import attention
from foscar.bench.common import rel_l2
from foscar.fold import decode_folded
from foscar.synthetic import stress_inputs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 16384])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    args = ap.parse_args()
    print("| L | seed | bits | K / V | BF16 attention | split from FP32 | from FP16 |")
    print("|---|---|---|---|---|---|---|")
    for n in args.lengths:
        for seed in args.seeds:
            q, k, v = stress_inputs(1, 32, 8, n, 128, seed=seed, dtype=torch.bfloat16)
            for bits in (2, 4):
                for v_axis in ("token", "channel"):
                    fmt = foscar.KVFormat(bits=bits, head_dim=128, group_size=128, k_axis="channel", v_axis=v_axis)
                    cache = foscar.quantize_kv(k, v, fmt)
                    oracle = foscar.decode_exact(q, cache)
                    kd, vd = cache.dequantize(torch.float64)
                    errs = []
                    for fp16_first in (False, True):
                        with mock.patch.object(e4m3, "Q_PRIME_FP16_FIRST", fp16_first):
                            out = decode_folded(q, cache, operand_dtype=torch.float8_e4m3fn, operand_terms=2,
                                                pv_operand_dtype=torch.float16)
                        errs.append(rel_l2(out, oracle))
                    bf16 = rel_l2(attention(q, kd, vd, bf16=True), oracle)
                    print(f"| {n} | {seed} | INT{bits} | channel / {v_axis} | {bf16:.2e} | {errs[0]:.2e} | {errs[1]:.2e} |",
                          flush=True)


if __name__ == "__main__":
    main()
