"""Argument checks shared by every public function (one home for the wording)."""
from __future__ import annotations

import math
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


# --------------------------------------------------------------------------------------------
# A decode call
# --------------------------------------------------------------------------------------------
def check_num_splits(num_splits: object) -> int | None:
    """A decode's ``num_splits``: an int >= 1, or ``None`` (the kernel's heuristic)."""
    if num_splits is not None and (isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 1):
        raise InvalidArgumentError("num_splits", "an int >= 1 (or None)", num_splits)
    return num_splits


QUERY_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
COMPUTE_DTYPES = (torch.float64, torch.float32)


def check_decode_inputs(q: torch.Tensor, cache, sm_scale: float | None,
                        dtype: torch.dtype | None = None) -> tuple[int, float]:
    """Validate a decode call; return ``(gqa, sm_scale)`` (query heads per KV head, the softmax scale). On
    the CPU also the query's values and the cache's lengths (elsewhere that would wait for the device)."""
    from .cache import QuantKVCache  # the cache module imports this one
    if not isinstance(cache, QuantKVCache):
        raise InvalidArgumentError("cache", "a foscar.QuantKVCache", type(cache).__name__)
    B, Hkv, D = cache.batch_size, cache.num_kv_heads, cache.head_dim
    check_tensor("q", q, ndim=3, dtypes=QUERY_DTYPES, device=cache.device)
    if q.shape[0] != B or q.shape[2] != D:
        raise InvalidArgumentError("q", f"shape ({B}, Hq, {D}) for this cache", tuple(q.shape))
    Hq = q.shape[1]
    if Hq == 0 or Hq % Hkv:
        raise InvalidArgumentError("q", f"a head count that is a positive multiple of num_kv_heads={Hkv}", Hq)
    if q.device.type == "cpu" and not torch.compiler.is_compiling():
        check_finite("q", q)  # on a GPU (or in a compiled graph) it would wait for the values
        check_lengths(cache)
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(D)
    if isinstance(sm_scale, bool) or not isinstance(sm_scale, (int, float)):
        raise InvalidArgumentError("sm_scale", "a Python float (or None)", f"a {type(sm_scale).__name__}")
    if not math.isfinite(sm_scale) or sm_scale <= 0:
        raise InvalidArgumentError("sm_scale", "a finite float > 0", sm_scale)
    if dtype is not None and dtype not in COMPUTE_DTYPES:
        raise InvalidArgumentError("dtype", "torch.float64 or torch.float32", dtype)
    return Hq // Hkv, float(sm_scale)


def check_lengths(cache) -> None:
    """``cache.seq_lens`` (which a caller may have set) are lengths >= 0 whose quantized parts fit the
    pages each sequence has: a host read of the lengths, done where they already live on the host."""
    lens = cache.seq_lens.long().cpu()
    if lens.numel() and int(lens.min()) < 0:
        b = int(lens.argmin())
        raise InvalidArgumentError("cache.seq_lens", "lengths >= 0", f"{int(lens[b])} at sequence {b}")
    _, n_quant, _ = cache.fmt.split_length(lens)
    have = cache.page_table.num_pages.long().cpu() * cache.page_size
    over = (n_quant > have).nonzero()
    if over.numel():
        b = int(over[0])
        raise InvalidArgumentError("cache.seq_lens", f"lengths the pages hold (sequence {b}: {int(have[b])} "
                                   "quantized tokens)", f"{int(lens[b])} ({int(n_quant[b])} quantized)")


#: dtypes a decode writes its output in
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def decode_out_buffers(q: torch.Tensor, out: torch.Tensor | None, lse: torch.Tensor | None,
                       return_lse: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A decode's ``out [B, Hq, D]`` (checked when given; else ``q``'s dtype, float32 for other query
    dtypes) and ``lse [B, Hq]`` float32 (checked when given; allocated when ``return_lse``)."""
    B, Hq, D = q.shape
    if out is None:
        out = torch.empty(B, Hq, D, dtype=q.dtype if q.dtype in OUT_DTYPES else torch.float32, device=q.device)
    else:
        check_tensor("out", out, shape=(B, Hq, D), dtypes=OUT_DTYPES, device=q.device)
        if out.stride(-1) != 1:
            raise InvalidArgumentError("out", "unit stride in the last dim", tuple(out.stride()))
    if lse is not None:
        check_tensor("lse", lse, shape=(B, Hq), dtypes=(torch.float32,), device=q.device)
    elif return_lse:
        lse = torch.empty(B, Hq, dtype=torch.float32, device=q.device)
    return out, lse
