"""The FP8 ``wgmma`` accumulation's error on the QK product of E4M3 K operands, signed (on an sm_90 GPU):

    python benchmarks/e4m3_accumulation_bias.py [--tiles 512] [--bits 2 4] [--head-dim 64 128]

The probe kernel of :mod:`foscar.cute.operands_e4m3` (one ``m64n8k32`` chain over the head dim, the codes placed
in E4M3 bytes as ``q 2^-9``, an E4M3 query) computes ``S^T`` of random codes; float64 gives the exact product.
Per case it prints the error in units of each element's ``sum |products|`` (the scale of any accumulation's
rounding): its mean and standard deviation, the mean split by the sign of the exact value (a rounding toward
zero shows as opposite signs, toward minus infinity as the same sign), and the share of elements below the
exact value. An unbiased accumulation has a mean near 0 at about ``std / sqrt(n)``.
"""
import argparse

import torch


def measure(bits: int, head_dim: int, tiles: int, q_scale: float) -> dict:
    from cutlass.cute.runtime import from_dlpack

    from foscar import e4m3
    from foscar.cute.operands_e4m3 import E4m3Tile, compile_probe
    from foscar.format import pack_codes
    cfg = E4m3Tile(bits, head_dim)
    gen = torch.Generator().manual_seed(7 * bits + head_dim)
    codes = torch.randint(0, 1 << bits, (tiles, 64, head_dim), generator=gen, dtype=torch.int32)
    words = torch.stack([pack_codes(c, bits, "k") for c in codes])
    q = (torch.randn(8, head_dim, generator=gen) * q_scale).to(torch.float8_e4m3fn)
    order = e4m3.contraction_order(bits, head_dim)
    W, Q = words.cuda(), q[:, order].contiguous().view(torch.uint8).cuda()
    S = torch.full((tiles, 64, 8), float("nan"), device="cuda")
    args = [from_dlpack(x, assumed_align=16) for x in (W, Q, S)]
    compile_probe(cfg, *args)(*args)
    torch.cuda.synchronize()
    y = codes.double() * 2.0 ** -9
    ref = y @ q.double().T
    scale = (y.abs() @ q.double().abs().T).clamp(min=1e-300)
    rel = (S.cpu().double() - ref) / scale
    pos, neg = ref > 0, ref < 0
    return {"mean": rel.mean().item(), "std": rel.std().item(), "n": rel.numel(),
            "mean_pos": rel[pos].mean().item(), "mean_neg": rel[neg].mean().item(),
            "below": (rel < 0).double().mean().item(), "exact": (rel == 0).double().mean().item()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiles", type=int, default=512)
    p.add_argument("--bits", type=int, nargs="+", default=[2, 4])
    p.add_argument("--head-dim", type=int, nargs="+", default=[64, 128])
    p.add_argument("--q-scale", type=float, default=4.0, help="the query's standard deviation before E4M3")
    a = p.parse_args()
    print("| bits | D | k32 steps | mean err / sum|p| | std | mean, exact > 0 | mean, exact < 0 | below exact | exact |")
    print("|---|---|---|---|---|---|---|---|---|")
    for bits in a.bits:
        for d in a.head_dim:
            r = measure(bits, d, a.tiles, a.q_scale)
            print(f"| {bits} | {d} | {d // 32} | {r['mean']:+.2e} | {r['std']:.2e} | {r['mean_pos']:+.2e} | "
                  f"{r['mean_neg']:+.2e} | {r['below']:.3f} | {r['exact']:.3f} |")


if __name__ == "__main__":
    main()
