"""Argument checks shared by every public function (one home for the wording)."""
from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from .errors import InvalidArgumentError


def canonical_device(device: torch.device | str) -> torch.device:
    """``device`` with its index filled in (``"cuda"`` is the current CUDA device), so that tensors made
    with ``device="cuda"`` compare equal to their ``cuda:0`` placement."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return device


def same_device(a: torch.device | str, b: torch.device | str) -> bool:
    return a == b or canonical_device(a) == canonical_device(b)  # equal as given: no device query


def check_tensor(
    name: str,
    t: object,
    *,
    ndim: int | None = None,
    shape: Sequence[int | None] | None = None,
    dtypes: Iterable[torch.dtype] | None = None,
    device: torch.device | None = None,
    contiguous: bool = False,
) -> torch.Tensor:
    """Check that ``t`` is a tensor of the given rank/shape/dtype/device; return it.

    ``shape`` entries that are ``None`` are free.
    """
    if not isinstance(t, torch.Tensor):
        raise InvalidArgumentError(name, "a torch.Tensor", type(t).__name__)
    if shape is not None:
        ndim = len(shape)
    if ndim is not None and t.dim() != ndim:
        raise InvalidArgumentError(name, f"a {ndim}-D tensor", f"shape {tuple(t.shape)}")
    if shape is not None:
        for i, (want, have) in enumerate(zip(shape, t.shape)):
            if want is not None and want != have:
                want_s = tuple("*" if s is None else s for s in shape)
                raise InvalidArgumentError(name, f"shape {want_s} (dim {i} = {want})", f"shape {tuple(t.shape)}")
    if dtypes is not None:
        dtypes = tuple(dtypes)
        if t.dtype not in dtypes:
            names = " or ".join(str(d).replace("torch.", "") for d in dtypes)
            raise InvalidArgumentError(name, f"dtype {names}", str(t.dtype).replace("torch.", ""))
    if device is not None and not same_device(t.device, device):
        raise InvalidArgumentError(name, f"a tensor on {device}", f"a tensor on {t.device}")
    if contiguous and not t.is_contiguous():
        raise InvalidArgumentError(name, "a contiguous tensor", f"strides {tuple(t.stride())} for shape {tuple(t.shape)}")
    return t


def check_finite(name: str, t: torch.Tensor) -> None:
    """Reject NaN and Inf (values that would be quantized or attended)."""
    if t.is_floating_point() and t.numel() and not bool(torch.isfinite(t).all()):
        bad = (~torch.isfinite(t)).nonzero()[0].tolist()
        raise InvalidArgumentError(name, "finite values (no NaN/Inf)", f"{t[tuple(bad)].item()} at index {tuple(bad)}")


def check_int(name: str, value: object, *, allowed: Iterable[int] | None = None, minimum: int | None = None,
              multiple_of: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgumentError(name, "an int", repr(value))
    if allowed is not None:
        allowed = tuple(allowed)
        if value not in allowed:
            raise InvalidArgumentError(name, f"one of {allowed}", value)
    if minimum is not None and value < minimum:
        raise InvalidArgumentError(name, f">= {minimum}", value)
    if multiple_of is not None and value % multiple_of:
        raise InvalidArgumentError(name, f"a multiple of {multiple_of}", value)
    return value
