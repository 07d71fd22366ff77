"""The tensor core's FP16 product chain at V^T's operand magnitudes (on an sm_90 GPU):

    python benchmarks/f16_magnitude_probe.py [--tokens 1024 16384] [--shls 0 2 4 8] [--bits 2 4]

(each ``shl`` up to ``10 - bits``: INT4 stops at 6)

The PV product of the CuTe kernels, ``O^T = V^T P'^T`` accumulated in FP32 over a split's tokens, with V^T's
codes by placement (``q 2^(shl - 24)``, FP16 subnormals for every ``shl`` here: :func:`foscar.format.f16_placement`)
and P' the FP16 softmax weights of peaky scores (normal, a few large outliers: many weights far below the largest).
Every ``shl`` multiplies every product by the same power of two, so an exact or scale-invariant accumulation gives
the same relative error at every ``shl``; a loss of small products or of their sum's low bits below some magnitude
shows as an error that grows as ``shl`` falls. A Triton kernel (``tl.dot``, FP32 accumulator chained over the
tokens; a tensor-core MMA on the GPU) against float64 on the same FP16 inputs; per ``(bits, tokens, shl)`` the error
of each element in units of its ``sum |products|``: mean, root mean square and largest, and the norm-wise relative
error of the whole product; for each ``shl`` below ``--product-bits``, again with P' carrying ``2^(bit - shl)``
(``foscar.cute.config.V_PRODUCT_BIT``: every product in that bit's units), which a loss below some magnitude
would not see.
"""
import argparse

import torch
import triton
import triton.language as tl

CHANNELS, COLUMNS, STEP = 64, 16, 32


@triton.jit
def _pv_chain(v_ptr, p_ptr, out_ptr, tokens, M: tl.constexpr, N: tl.constexpr, BK: tl.constexpr):
    rm, rn, rk = tl.arange(0, M), tl.arange(0, N), tl.arange(0, BK)
    acc = tl.zeros((M, N), dtype=tl.float32)
    for k0 in range(0, tokens, BK):
        v = tl.load(v_ptr + rm[:, None] * tokens + (k0 + rk)[None, :])
        p = tl.load(p_ptr + (k0 + rk)[:, None] * N + rn[None, :])
        acc = tl.dot(v, p, acc, out_dtype=tl.float32)
    tl.store(out_ptr + rm[:, None] * N + rn[None, :], acc)


def inputs(bits: int, tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes [CHANNELS, tokens] int, P' [tokens, COLUMNS] FP16)``: random codes and the FP16 softmax weights
    (``exp(x - max)``, unnormalized as the kernels' P') of scores with a few outliers per column."""
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 1 << bits, (CHANNELS, tokens), generator=gen)
    x = torch.randn(tokens, COLUMNS, generator=gen, dtype=torch.float64) * 2.0
    hot = torch.rand(tokens, COLUMNS, generator=gen) < 16 / tokens
    x = x + hot * 12.0
    return codes, torch.exp(x - x.max(dim=0).values).to(torch.float16)


def product(codes: torch.Tensor, p: torch.Tensor, shl: int, device: str) -> torch.Tensor:
    """The chain's FP32 output ``[CHANNELS, COLUMNS]``, in units of the codes (times ``2^(24 - shl)``)."""
    v = (codes.double() * 2.0 ** (shl - 24)).to(torch.float16)
    assert torch.equal(v.double() * 2.0 ** (24 - shl), codes.double()), "a code's FP16 is not exact"
    v, p = v.contiguous().to(device), p.contiguous().to(device)
    out = torch.full((CHANNELS, COLUMNS), float("nan"), dtype=torch.float32, device=device)
    _pv_chain[(1,)](v, p, out, codes.shape[1], M=CHANNELS, N=COLUMNS, BK=STEP)
    return out.cpu().double() * 2.0 ** (24 - shl)


def measure(bits: int, tokens: int, shl: int, seed: int = 0, device: str = "cuda", product_bit: int = 0) -> dict:
    """The chain's error at ``shl``; with ``product_bit`` above ``shl``, P' times ``2^(product_bit - shl)`` first
    (``foscar.cute.config.V_PRODUCT_BIT``: the products in that bit's units), against the exact product of the
    FP16 inputs the chain takes."""
    codes, p = inputs(bits, tokens, seed)
    if product_bit > shl:
        p = (p.double() * 2.0 ** (product_bit - shl)).to(torch.float16)
    ref = codes.double() @ p.double()
    got = product(codes, p, shl, device)
    scale = (codes.double().abs() @ p.double().abs()).clamp(min=1e-300)
    rel = (got - ref) / scale
    return {"mean": rel.mean().item(), "rms": rel.pow(2).mean().sqrt().item(), "max": rel.abs().max().item(),
            "norm": ((got - ref).norm() / ref.norm()).item()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1024, 16384])
    ap.add_argument("--shls", type=int, nargs="+", default=[0, 2, 4, 8])
    ap.add_argument("--bits", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--product-bits", type=int, nargs="*", default=[4],
                    help="also each shl below these with P' carrying 2^(bit - shl) (V_PRODUCT_BIT)")
    a = ap.parse_args()
    if any(t % STEP for t in a.tokens):
        ap.error(f"argument --tokens: expected multiples of {STEP}, got {a.tokens}")
    if any(not 0 <= s <= 10 - min(a.bits) for s in a.shls):
        ap.error(f"argument --shls: expected 0 <= shl <= 10 - bits, got {a.shls}")
    print(f"device: {torch.cuda.get_device_name()}\n")
    print("| bits | tokens | shl | P' units | mean | rms | max | norm-wise |\n|---|---|---|---|---|---|---|---|")
    for bits in a.bits:
        for tokens in a.tokens:
            for shl in (s for s in a.shls if s <= 10 - bits):  # a code's FP16 subnormal: shl + bits <= 10
                for bit in sorted({0, *(b for b in a.product_bits if b > shl)}):
                    rs = [measure(bits, tokens, shl, seed, product_bit=bit) for seed in range(a.seeds)]
                    cell = lambda k: f"{min(r[k] for r in rs):.2e}..{max(r[k] for r in rs):.2e}"  # noqa: E731
                    units = f"bit {bit}" if bit > shl else "the codes'"
                    print(f"| {bits} | {tokens} | {shl} | {units} | {cell('mean')} | {cell('rms')} | {cell('max')} | "
                          f"{cell('norm')} |")


if __name__ == "__main__":
    main()
