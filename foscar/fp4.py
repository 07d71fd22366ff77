"""FP4 block formats (BitDecoding-FP4 §2): E2M1 codes in blocks along the head dim, each block sharing one scale.

- **E2M1** (:func:`foscar.format.e2m1_decode`): a 4-bit code, bit 3 the sign, bits 2-1 the exponent ``e``, bit 0 the
  mantissa ``m``: ``2^(e-1) (1 + m/2)`` for ``e >= 1``, ``m / 2`` for ``e = 0``; the magnitudes
  ``0, 0.5, 1, 1.5, 2, 3, 4, 6``.
- **NVFP4** (:data:`NVFP4`): blocks of 16 values, an E4M3 block scale, an FP32 scale per tensor;
  **MXFP4** (:data:`MXFP4`): blocks of 32, an E8M0 (power-of-two) block scale. Symmetric: no offset.
- :func:`quantize_blocks` rounds to nearest on the E2M1 grid (ties to the even mantissa) with each block's
  scale searched over two candidates, BitDecoding-FP4 §3's recipe: NVFP4 ``{max / 6, max / 4}``, MXFP4
  ``{2^e, 2^(e+1)}`` around the block's largest magnitude; the one with the smaller block error is kept.
  :func:`dequantize_blocks` is its inverse, in float64 or float32.
- The operands of the tensor cores by bit placement, exact (:func:`e2m1_to_e4m3`, :func:`e2m1_to_f16`): the
  code's exponent and mantissa bits moved under an E4M3 or FP16 exponent field read the E2M1 value times
  ``2^-6`` (E4M3) or ``2^-14`` (FP16) for every code; from a 32-bit word of eight codes, two E4M3
  registers (:func:`word_to_e4m3_registers`: two shifts and two ``lop3`` each).

This module is the formats' one home: the codes, the scale encodings and the quantizer that the cache
formats and every backend are to read (``docs/fp4-plan.md``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import InvalidArgumentError
from .format import e2m1_decode

E2M1_MAX = 6.0
E4M3_MAX = 448.0
#: E8M0 exponent bias; the byte 255 is NaN.
E8M0_BIAS = 127


@dataclass(frozen=True)
class Fp4Spec:
    """One FP4 block format: ``block`` values per scale, the scale's encoding (``"e4m3"`` or ``"e8m0"``), and
    whether a per-tensor FP32 scale multiplies the block scales (NVFP4)."""

    name: str
    block: int
    scale: str
    tensor_scale: bool

    def scale_bytes(self, head_dim: int) -> int:
        """Bytes of block scales per token and head (one byte each)."""
        return head_dim // self.block

    def bytes_per_token(self, head_dim: int) -> int:
        """Bytes per token and head of one tensor: the codes (two a byte) and the block scales."""
        return head_dim // 2 + self.scale_bytes(head_dim)


NVFP4 = Fp4Spec("nvfp4", 16, "e4m3", True)
MXFP4 = Fp4Spec("mxfp4", 32, "e8m0", False)
SPECS = {s.name: s for s in (NVFP4, MXFP4)}


def spec_for(name: str) -> Fp4Spec:
    """The :class:`Fp4Spec` named ``name`` (``"nvfp4"`` or ``"mxfp4"``)."""
    if name not in SPECS:
        raise InvalidArgumentError("fp4 format", f"one of {tuple(SPECS)}", repr(name))
    return SPECS[name]


# ------------------------------------------------------------------------------------------------
# E2M1 codes
# ------------------------------------------------------------------------------------------------
_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def e2m1_round(y: torch.Tensor) -> torch.Tensor:
    """The E2M1 codes nearest ``y`` (float), ties to the even mantissa, magnitudes above 6 saturated to 6;
    a result of magnitude 0 has the sign bit clear. ``y`` must be finite (:func:`quantize_blocks` checks)."""
    a = y.abs().to(torch.float64)
    mid = torch.tensor(_MIDPOINTS, dtype=torch.float64, device=y.device)
    k = torch.searchsorted(mid, a.contiguous(), right=False)  # midpoints below a: a tie rounds down here
    tie = (k < len(_MIDPOINTS)) & (a == mid[k.clamp(max=len(_MIDPOINTS) - 1)])
    k = torch.where(tie & (k % 2 == 1), k + 1, k)  # a tie between codes k and k + 1 goes to the even one
    sign = ((y < 0) & (k > 0)).to(torch.int64) << 3
    return (k | sign).to(torch.uint8)


# ------------------------------------------------------------------------------------------------
# Block scales
# ------------------------------------------------------------------------------------------------
def encode_scale(s: torch.Tensor, spec: Fp4Spec) -> torch.Tensor:
    """Block scales ``s`` (float, >= 0) as their bytes: E4M3 rounded to nearest (at most 448), or E8M0 the
    power of two ``s`` is (``s`` must be one; 0 becomes ``2^-127``). Anything else is refused by name."""
    if not bool((torch.isfinite(s) & (s >= 0)).all()):
        raise InvalidArgumentError("s", "finite block scales >= 0", "a negative, NaN or Inf scale")
    if spec.scale == "e8m0" and not bool(((torch.frexp(s.to(torch.float64))[0] == 0.5) | (s == 0)).all()):
        raise InvalidArgumentError("s", "powers of two (E8M0 block scales)", "a scale that is not one")
    if spec.scale == "e4m3":
        return s.clamp(max=E4M3_MAX).to(torch.float32).to(torch.float8_e4m3fn).view(torch.uint8)
    e = torch.frexp(s.to(torch.float64).clamp(min=2.0 ** -127))[1] - 1  # s = 2^e exactly
    return (e + E8M0_BIAS).clamp(0, 254).to(torch.uint8)


def decode_scale(b: torch.Tensor, spec: Fp4Spec, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """The block scales of bytes ``b`` (E4M3, or E8M0: ``2^(b - 127)``, 255 NaN)."""
    if spec.scale == "e4m3":
        return b.view(torch.float8_e4m3fn).to(dtype)
    e = b.to(torch.int64) - E8M0_BIAS
    v = torch.ldexp(torch.ones_like(e, dtype=torch.float64), e).to(dtype)
    return torch.where(b == 255, torch.full_like(v, float("nan")), v)


def _candidates(amax: torch.Tensor, spec: Fp4Spec, tensor_scale: float) -> list[torch.Tensor]:
    """The two block-scale bytes tried per block (BitDecoding-FP4 §3)."""
    if spec.scale == "e4m3":
        return [encode_scale(amax / (E2M1_MAX * tensor_scale), spec), encode_scale(amax / (4.0 * tensor_scale), spec)]
    # 2^e: the least power of two with amax / 2^e <= 6 (no value clipped), and 2^(e - 1) (the largest clipped)
    ratio = (amax / E2M1_MAX).clamp(min=2.0 ** -127)
    m, e = torch.frexp(ratio)
    e = torch.where(m == 0.5, e - 1, e)  # ratio a power of two: 2^e is ratio itself
    up = torch.ldexp(torch.ones_like(ratio), e)
    return [encode_scale(up, spec), encode_scale(up / 2, spec)]


# ------------------------------------------------------------------------------------------------
# Quantizer
# ------------------------------------------------------------------------------------------------
@dataclass
class Fp4Blocks:
    """Quantized values: ``codes`` (uint8, one E2M1 code per value, ``[..., D]``), ``scales`` (uint8 bytes,
    ``[..., D / block]``) and the per-tensor scale (NVFP4; 1.0 for MXFP4)."""

    codes: torch.Tensor
    scales: torch.Tensor
    tensor_scale: float
    spec: Fp4Spec


def nvfp4_tensor_scale(x: torch.Tensor) -> float:
    """NVFP4's per-tensor scale for ``x``: its largest magnitude over ``448 * 6``, so that the block scales of
    ``max / 6`` use E4M3's range (1.0 for an all-zero ``x``)."""
    amax = float(x.abs().max()) if x.numel() else 0.0
    return amax / (E4M3_MAX * E2M1_MAX) if amax > 0 else 1.0


def block_limit(spec: Fp4Spec, tensor_scale: float) -> float:
    """The largest magnitude a block holds without clipping: 6 times the largest block scale (NVFP4: 448
    times the tensor's scale; MXFP4: ``2^127``)."""
    return E2M1_MAX * (E4M3_MAX * tensor_scale if spec.scale == "e4m3" else 2.0 ** 127)


def check_block_limit(x: torch.Tensor, spec: Fp4Spec, tensor_scale: float, name: str) -> None:
    """Refuse ``x`` by ``name`` where a magnitude is past :func:`block_limit` (it would be clipped)."""
    limit = block_limit(spec, tensor_scale)
    top = float(x.abs().max()) if x.numel() else 0.0
    if top > limit:
        raise InvalidArgumentError(name, f"values of magnitude <= {limit:.6g} ({spec.name} blocks with tensor scale "
                                   f"{tensor_scale:.6g}: 6 x the largest block scale)", f"{top:.6g}")


def check_tensor_scales(fmt, tensor_scales, device) -> torch.Tensor:
    """NVFP4's per-tensor scales ``(k, v)`` (two finite positive numbers) as FP32 ``[2]`` on ``device``;
    refused by name for any other format."""
    spec = fmt.fp4_spec
    if spec is None or not spec.tensor_scale:
        raise InvalidArgumentError("tensor_scales", f"None (scheme={fmt.scheme!r} has no per-tensor scale)",
                                   tensor_scales)
    try:
        t = torch.as_tensor(tensor_scales, dtype=torch.float64).reshape(-1)
    except (TypeError, ValueError, RuntimeError):
        t = None
    if t is None or t.numel() != 2 or not bool((torch.isfinite(t) & (t > 0)).all()):
        raise InvalidArgumentError("tensor_scales", "(k_scale, v_scale): two finite positive floats", tensor_scales)
    t32 = t.to(torch.float32)
    if not bool((t32 > 0).all()) or not bool(torch.isfinite(t32).all()):
        raise InvalidArgumentError("tensor_scales", "scales FP32 holds (normal, finite)", tensor_scales)
    return t32.to(device)


def quantize_blocks(x: torch.Tensor, spec: Fp4Spec | str, tensor_scale: float | None = None,
                    search: bool = True, name: str = "x") -> Fp4Blocks:
    """``x [..., D]`` (finite, ``D`` a multiple of the block) as FP4 blocks along its last dim: per block the
    candidate scale (:func:`_candidates`) whose dequantized block is nearer ``x`` in squared error (ties:
    the first; ``search=False``: the first, the scale from the block's maximum), the codes rounded to nearest
    (:func:`e2m1_round`). ``tensor_scale`` (NVFP4): given, or :func:`nvfp4_tensor_scale` of ``x``. A value
    past :func:`block_limit` is refused by ``name`` (it would be clipped)."""
    spec = spec_for(spec) if isinstance(spec, str) else spec
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise InvalidArgumentError("x", "a floating-point tensor", type(x).__name__)
    if x.dim() == 0 or x.shape[-1] % spec.block:
        raise InvalidArgumentError("x", f"a last dim that is a multiple of {spec.block} ({spec.name} blocks)",
                                   tuple(x.shape))
    if not bool(torch.isfinite(x).all()):
        raise InvalidArgumentError("x", "finite values (FP4 blocks have no NaN or Inf)", "NaN or Inf")
    if spec.tensor_scale:
        tensor_scale = nvfp4_tensor_scale(x) if tensor_scale is None else float(tensor_scale)
        if not tensor_scale > 0 or tensor_scale == float("inf"):
            raise InvalidArgumentError("tensor_scale", "a finite positive float", tensor_scale)
    else:
        if tensor_scale not in (None, 1.0):
            raise InvalidArgumentError("tensor_scale", f"None ({spec.name} has no per-tensor scale)", tensor_scale)
        tensor_scale = 1.0
    xb = x.to(torch.float64).reshape(*x.shape[:-1], -1, spec.block)
    amax = xb.abs().amax(-1)
    check_block_limit(amax, spec, tensor_scale, name)
    best = None
    for sb in _candidates(amax, spec, tensor_scale)[: 2 if search else 1]:
        s = decode_scale(sb, spec) * tensor_scale
        y = torch.where(s[..., None] > 0, xb / s[..., None], torch.zeros_like(xb))
        codes = e2m1_round(y)
        err = ((e2m1_decode(codes) * s[..., None] - xb) ** 2).sum(-1)
        if best is None:
            best = (sb, codes, err)
        else:
            better = err < best[2]
            best = (torch.where(better, sb, best[0]), torch.where(better[..., None], codes, best[1]),
                    torch.minimum(err, best[2]))
    sb, codes, _ = best
    return Fp4Blocks(codes.reshape(x.shape), sb, tensor_scale, spec)


def dequantize_blocks(q: Fp4Blocks, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """The values of ``q`` (codes times block scale times the per-tensor scale), in ``dtype``."""
    spec = q.spec
    shape = q.codes.shape
    v = e2m1_decode(q.codes).reshape(*shape[:-1], -1, spec.block)
    s = decode_scale(q.scales, spec) * q.tensor_scale
    return (v * s[..., None]).reshape(shape).to(dtype)


# ------------------------------------------------------------------------------------------------
# Operands by bit placement
# ------------------------------------------------------------------------------------------------
#: The factor the placed operand carries: E4M3 reads ``value * 2^-6``, FP16 ``value * 2^-14``.
E4M3_PLACED_SCALE = 2.0 ** -6
F16_PLACED_SCALE = 2.0 ** -14


def e2m1_to_e4m3(codes: torch.Tensor) -> torch.Tensor:
    """E4M3 bytes of E2M1 ``codes``: exponent and mantissa to bits 4-2, the sign to bit 7 (``value * 2^-6``)."""
    c = codes.to(torch.int32)
    return (((c & 7) << 2) | ((c & 8) << 4)).to(torch.uint8)


def e2m1_to_f16(codes: torch.Tensor) -> torch.Tensor:
    """FP16 bits (int16 view) of E2M1 ``codes``: exponent to bits 11-10, mantissa to bit 9, the sign to bit 15
    (``value * 2^-14``)."""
    c = codes.to(torch.int32)
    bits = ((c & 7) << 9) | ((c & 8) << 12)
    return (bits - ((bits & 0x8000) << 1)).to(torch.int16)  # the 16-bit pattern as a signed int16


def word_to_e4m3_registers(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The two E4M3 registers of a 32-bit word ``w`` (int64 values 0 to 2^32 - 1) of eight codes (code ``i`` at
    bits ``4i``): byte ``b`` of the first is code ``2b``, of the second code ``2b + 1``
    (``((w << 2) & 0x1C1C1C1C) | ((w << 4) & 0x80808080)`` and ``((w >> 2) & 0x1C1C1C1C) | (w & 0x80808080)``)."""
    w = w.to(torch.int64) & 0xFFFFFFFF
    lo = ((w << 2) & 0x1C1C1C1C) | ((w << 4) & 0x80808080)
    hi = ((w >> 2) & 0x1C1C1C1C) | (w & 0x80808080)
    return lo, hi
