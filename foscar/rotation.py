"""The orthonormal rotations a :class:`~foscar.format.KVFormat` can name (``rotation="hadamard"``): the matrix,
the factors a kernel that rotates in place takes, and the rotation of tensors, one home for every backend."""
from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING

import torch

from .errors import InvalidArgumentError

if TYPE_CHECKING:
    from .format import KVFormat

#: The rotations a format can name (:attr:`KVFormat.rotation`).
ROTATIONS = (None, "hadamard")


@functools.lru_cache(maxsize=32)
def _rotation64(head_dim: int, seed: int | None) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < head_dim:  # Sylvester's construction
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    h = h / math.sqrt(head_dim)
    if seed is not None:
        signs = torch.randint(0, 2, (head_dim,), generator=torch.Generator().manual_seed(seed)) * 2 - 1
        h = signs.double()[:, None] * h
    return h


def rotation_matrix(fmt: "KVFormat", dtype: torch.dtype = torch.float64, device=None) -> torch.Tensor:
    """The format's rotation ``R [D, D]`` (orthonormal: ``R R^T = I``): a stored row is ``x R``, a value is
    ``x_stored R^T``. ``diag(signs) H / sqrt(D)`` with ``H`` Sylvester's Hadamard matrix and the signs
    drawn from ``torch.Generator().manual_seed(rotation_seed)`` (all +1 without a seed). One tensor per
    device and dtype, shared by every caller: never write to it."""
    if fmt.rotation is None:
        raise InvalidArgumentError("fmt", "a format with a rotation", "rotation=None")
    return _rotation_on(fmt.head_dim, fmt.rotation_seed, dtype, torch.device("cpu" if device is None else device))


@functools.lru_cache(maxsize=64)
def _rotation_on(head_dim: int, seed: int | None, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    # one copy per device and dtype, made on first use: a CUDA-graph capture after a warm-up call copies nothing
    return _rotation64(head_dim, seed).to(dtype=dtype, device=device)


@functools.lru_cache(maxsize=64)
def rotation_factors(fmt: "KVFormat", device) -> torch.Tensor:
    """What a kernel that rotates in place takes of the format's rotation: FP32 ``[D]``, each channel's
    ``s / sqrt(D)`` (the first column of :func:`rotation_matrix`: ``H``'s is all ones), so that ``x R =
    (x * f) H`` and ``y R^T = (y H) * f``; 4 zeros for a format without one (not read). One tensor per format
    and device, made on first use (a CUDA-graph capture after a warm-up call allocates nothing)."""
    if fmt.rotation is None:
        return torch.zeros(4, dtype=torch.float32, device=device)
    return rotation_matrix(fmt)[:, 0].to(device=device, dtype=torch.float32).contiguous()


def rotate(x: torch.Tensor, fmt: "KVFormat", inverse: bool = False, work: torch.dtype = torch.float64) -> torch.Tensor:
    """``x [..., D] R`` (``inverse``: ``x R^T``) in ``x``'s dtype, computed in ``work`` and rounded once:
    float64 (the default, what the write paths use) makes a token's rotated values independent of the
    tokens rotated with it; the decode entry points rotate a BF16/FP16/FP32 query and output in float32.
    ``x`` itself without a rotation."""
    if fmt.rotation is None:
        return x
    r = rotation_matrix(fmt, work, x.device)
    return (x.to(work) @ (r.T if inverse else r)).to(x.dtype)


def rotate_given(fmt: "KVFormat", *xs):
    """Each ``x`` rotated (:func:`rotate`) where it is a floating-point tensor whose last dim is the head dim,
    else as it is, for the checks after this to refuse by name: what the write paths' entry points do to
    the tokens they are given."""
    if fmt.rotation is None:
        return xs
    return tuple(rotate(x, fmt) if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dim() >= 1
                 and x.shape[-1] == fmt.head_dim else x for x in xs)
