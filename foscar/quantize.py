"""Group quantizers: values -> (codes, folded s', folded z').

Asymmetric uniform quantization ``x ~ s*q + z``, ``q`` in ``[0, 2^bits - 1]``, round to nearest.
The range ``[lo, hi]`` of each group comes from a selectable quantizer:

- ``"minmax"``: the group's min and max (every value within ``s/2`` of its reconstruction);
- ``"mse"``: the min-max range shrunk about its midpoint by the ratio (from ``MSE_RATIOS``) that
  minimises the group's squared reconstruction error, as clipped INT2 quantizers do (OSCAR);
- ``"quantile"``: the ``clip`` and ``1 - clip`` quantiles of the group;
- a clip preset (``CLIP_PRESETS``: ``"oscar"``): the min-max range shrunk about its midpoint by a fixed
  ratio per tensor, OSCAR's K 0.96 and V 0.92 (values outside it take the end codes).

Codes are computed against the *stored* constants: ``(s, z)`` are folded into FP32 ``(s', z')``
for the cache's operand mapping first, and ``q`` is rounded against ``s'*y(q) + z'``, so the
reconstruction error is the quantizer's, not the FP32 storage's (up to FP32 resolution of ``z'``).
A group whose values are all equal gets ``s = 0`` and reproduces its value exactly; nothing
divides by zero.
"""
from __future__ import annotations

import torch

from .errors import InvalidArgumentError
from .format import OperandMapping

#: Fixed clip ratios ``(K, V)`` of the min-max range, by preset name.
CLIP_PRESETS = {"oscar": (0.96, 0.92)}
QUANTIZERS = ("minmax", "mse", "quantile", *CLIP_PRESETS)
#: The quantizers whose range is the group's min-max range or a fixed shrink of it: no search, no sort.
RANGE_QUANTIZERS = ("minmax", *CLIP_PRESETS)
#: Shrink ratios tried by the ``"mse"`` quantizer (1.0 = min-max): ``1 - MSE_STEP i`` for ``i < MSE_STEPS``, the
#: doubles the GPU write kernels form the same way.
MSE_STEP = 0.05
MSE_STEPS = 10
MSE_RATIOS = tuple(1.0 - MSE_STEP * i for i in range(MSE_STEPS))
#: The quantizers the Triton write kernels repeat bit for bit (no sort: ``"quantile"`` is the reference's).
WRITE_KERNEL_QUANTIZERS = (*RANGE_QUANTIZERS, "mse")
DEFAULT_QUANTILE = 0.01


def check_quantizer(quantizer, allowed: tuple = QUANTIZERS, where: str = "") -> None:
    """Refuse a ``quantizer`` outside ``allowed`` by name (``where``: who takes only those)."""
    if quantizer not in allowed:
        raise InvalidArgumentError("quantizer", f"one of {allowed}{where}", repr(quantizer))


def clip_ratio(quantizer: str, tensor: str) -> float | None:
    """The fixed clip ratio of ``quantizer`` for ``tensor`` (``"k"`` or ``"v"``), ``None`` for a quantizer
    without one."""
    preset = CLIP_PRESETS.get(quantizer)
    return None if preset is None else preset[tensor == "v"]


def _quantile_range(x: torch.Tensor, p: float) -> tuple[torch.Tensor, torch.Tensor]:
    srt = torch.sort(x, dim=-1).values
    g = x.shape[-1]

    def at(f: float) -> torch.Tensor:
        pos = f * (g - 1)
        i0 = int(pos)
        i1 = min(i0 + 1, g - 1)
        w = pos - i0
        return srt[..., i0] * (1 - w) + srt[..., i1] * w

    return at(p), at(1 - p)


def _codes_for(x: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, bits: int, mapping: OperandMapping):
    """Fold the range into FP32 (s', z') and round codes against the stored constants."""
    qmax = (1 << bits) - 1
    s = (hi - lo) / qmax
    sp, zp = mapping.fold(s, lo)
    s_eff, z_eff = mapping.unfold(sp, zp)  # float64, exactly what the cache stands for
    s_eff_b, z_eff_b = s_eff.unsqueeze(-1), z_eff.unsqueeze(-1)
    safe = torch.where(s_eff_b > 0, s_eff_b, torch.ones_like(s_eff_b))
    q = torch.where(s_eff_b > 0, torch.round((x - z_eff_b) / safe), torch.zeros_like(x))
    q = q.clamp_(0, qmax)
    return q, sp, zp, s_eff_b, z_eff_b


def quantize_groups(x: torch.Tensor, bits: int, mapping: OperandMapping, quantizer: str = "minmax",
                    clip: float = DEFAULT_QUANTILE, tensor: str = "k") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize ``x[..., n_groups, g]`` of ``tensor`` (``"k"`` or ``"v"``: a clip preset's ratio) group-wise
    along the last dim.

    Returns ``codes`` (uint8, same shape as ``x``) and FP32 ``s'``, ``z'`` of shape ``x.shape[:-1]``.
    """
    check_quantizer(quantizer)
    x = x.double()
    if quantizer == "quantile":
        if not 0.0 <= clip < 0.5:
            raise InvalidArgumentError("clip", "a quantile in [0, 0.5)", clip)
        lo, hi = _quantile_range(x, clip)
    else:
        lo, hi = x.amin(-1), x.amax(-1)
    ratio = clip_ratio(quantizer, tensor)
    if ratio is not None:  # in float64, in this order: the GPU write kernels repeat it bit for bit
        mid, half = (lo + hi) / 2, (hi - lo) / 2
        lo, hi = mid - ratio * half, mid + ratio * half
    if quantizer != "mse":
        q, sp, zp, _, _ = _codes_for(x, lo, hi, bits, mapping)
        return q.to(torch.uint8), sp, zp

    mid, half = (lo + hi) / 2, (hi - lo) / 2
    best = None
    for r in MSE_RATIOS:
        q, sp, zp, s_eff, z_eff = _codes_for(x, mid - r * half, mid + r * half, bits, mapping)
        err = ((s_eff * q + z_eff - x) ** 2).sum(-1)
        if best is None:
            best = [err, q, sp, zp]
            continue
        better = err < best[0]
        best[0] = torch.where(better, err, best[0])
        best[1] = torch.where(better.unsqueeze(-1), q, best[1])
        best[2] = torch.where(better, sp, best[2])
        best[3] = torch.where(better, zp, best[3])
    return best[1].to(torch.uint8), best[2], best[3]


def quantize_tensor(x: torch.Tensor, bits: int, axis: str, group_size: int, mapping: OperandMapping,
                    quantizer: str = "minmax", clip: float = DEFAULT_QUANTILE, tensor: str = "k"):
    """Quantize ``x[..., T, D]`` of ``tensor`` token-wise (groups of ``g`` channels) or channel-wise (``g``
    tokens).

    Returns logical ``codes [..., T, D]`` (uint8) and ``s', z'`` shaped ``[..., T, D/g]``
    (token-wise) or ``[..., T/g, D]`` (channel-wise).
    """
    *lead, T, D = x.shape
    g = group_size
    if axis == "token":
        q, sp, zp = quantize_groups(x.reshape(*lead, T, D // g, g), bits, mapping, quantizer, clip, tensor)
        return q.reshape(*lead, T, D), sp, zp
    xt = x.reshape(*lead, T // g, g, D).transpose(-1, -2)  # [..., T/g, D, g]
    q, sp, zp = quantize_groups(xt, bits, mapping, quantizer, clip, tensor)
    return q.transpose(-1, -2).reshape(*lead, T, D), sp, zp


#: The damping of :func:`weighted_codes`: this fraction of the weights' mean diagonal added to their diagonal
WEIGHT_DAMPING = 0.01


def weighted_codes(x: torch.Tensor, s: torch.Tensor, z: torch.Tensor, weights: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes of the rows ``x [..., T, D]`` on the grids ``s q + z`` (``s``, ``z`` broadcast to ``x``, as the
    cache stands for them; ``s = 0``: code 0) that make each row's weighted error ``e W e^T`` small, ``e = x -
    x^`` and ``W = weights [..., D, D]`` (symmetric, positive semi-definite: the second moments of the queries
    that will read these keys make ``e W e^T`` the scores' squared error). Channel by channel, each is rounded to
    its nearest code after the earlier channels' errors are fed forward through ``W`` (GPTQ's sequential
    rounding, with the upper Cholesky factor of ``(W + d I)^-1``, ``d`` :data:`WEIGHT_DAMPING` of ``W``'s mean
    diagonal). With ``W = I`` it rounds to nearest. Float64; uint8 codes of ``x``'s shape."""
    qmax = (1 << bits) - 1
    x = x.double().clone()
    s, z = torch.broadcast_to(s.double(), x.shape), torch.broadcast_to(z.double(), x.shape)
    D = x.shape[-1]
    w = weights.double()
    eye = torch.eye(D, dtype=torch.float64, device=x.device)
    diag = w.diagonal(dim1=-2, dim2=-1).mean(-1)[..., None, None]
    w = torch.where(diag > 0, w + WEIGHT_DAMPING * diag * eye, eye)  # no weight at all: round to nearest
    u = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(w)), upper=True)[..., None, :, :]
    safe = torch.where(s > 0, s, torch.ones_like(s))
    codes = torch.empty_like(x)
    for c in range(D):
        q = torch.where(s[..., c] > 0, torch.round((x[..., c] - z[..., c]) / safe[..., c]), 0.0).clamp_(0, qmax)
        codes[..., c] = q
        err = (x[..., c] - (s[..., c] * q + z[..., c])) / u[..., c, c]
        x[..., c + 1:] -= err[..., None] * u[..., c, c + 1:]
    return codes.to(torch.uint8)


#: The quantizers an FP4 block format takes: ``"minmax"`` (the block scale from the block's largest
#: magnitude) and ``"mse"`` (BitDecoding-FP4's two candidates per block, the lower squared error kept).
FP4_QUANTIZERS = ("minmax", "mse")


def quantize_for(fmt, x: torch.Tensor, tensor: str, quantizer: str = "minmax", clip: float = DEFAULT_QUANTILE,
                 tensor_scale: float = 1.0, name: str | None = None, weights: torch.Tensor | None = None):
    """Quantize ``x[..., T, D]`` of ``tensor`` as the format ``fmt`` stores it: affine, ``(codes, s', z')``
    (:func:`quantize_tensor`); an FP4 block format (:mod:`foscar.fp4`), ``(codes, block-scale bytes, None)``
    with ``tensor_scale`` (NVFP4's, already the FP32 the cache holds), a value past the blocks' limit
    refused by ``name`` (default ``tensor``). ``weights [..., D, D]`` (keys of an affine format): the codes
    rounded for the rows' weighted error on the quantizer's grid (:func:`weighted_codes`). Every write path
    quantizes through here."""
    if not fmt.is_fp4:
        codes, sp, zp = quantize_tensor(x, fmt.bits, fmt.axis(tensor), fmt.group_size, fmt.op, quantizer, clip, tensor)
        if weights is not None and tensor == "k":
            s, z = fmt.op.unfold(sp, zp)
            g = fmt.group_size
            if fmt.axis(tensor) == "token":  # [..., T, D/g] -> each channel's group
                s, z = s.repeat_interleave(g, -1), z.repeat_interleave(g, -1)
            else:  # [..., T/g, D] -> each token's group
                s, z = s.repeat_interleave(g, -2), z.repeat_interleave(g, -2)
            codes = weighted_codes(x, s, z, weights, fmt.bits)
        return codes, sp, zp
    from .fp4 import quantize_blocks
    check_quantizer(quantizer, FP4_QUANTIZERS, f" (scheme={fmt.scheme!r})")
    spec = fmt.fp4_spec
    q = quantize_blocks(x, spec, tensor_scale if spec.tensor_scale else None, search=quantizer == "mse",
                        name=name or tensor)
    return q.codes, q.scales, None
