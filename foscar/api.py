"""``foscar.decode``: one call over a foscar cache, the backend chosen for the machine.

The backends live in :mod:`foscar.backends` (each states its limits once, in its ``status``); in the order
``backend="auto"`` tries them (:func:`backend_status` says which are usable here and why the others are
not):

- ``"cute"``: the CuTe DSL sm_90a kernels (:mod:`foscar.cute`), on Hopper with nvidia-cutlass-dsl and
  apache-tvm-ffi installed (``foscar[cute]``), for the formats they support; ``auto`` takes them for
  token-wise K, faster than Triton on every shape of the paper grid (``docs/results-h200.md``).
- ``"triton"``: the Triton kernels, on any CUDA GPU.
- ``"reference"``: :func:`foscar.decode_folded` in PyTorch (BF16 QK and FP16 PV operands, float32
  accumulation: the kernels' arithmetic), on any device. ``auto`` uses it on the CPU.

An explicit choice (``backend=`` or the ``FOSCAR_BACKEND`` environment variable) that cannot run is an
error that says why, never a silent switch to another backend.

A call is validated once (:class:`foscar.problem.DecodeProblem`); the chosen backend runs it without
checking again. The call is the custom op ``torch.ops.foscar.decode`` (``torch.library``, with a fake
implementation), so ``torch.compile`` traces a decode step without a graph break; it writes ``out`` and
``lse`` in place and allocates nothing else on the GPU paths given a plan, so CUDA graphs capture it.
The backend choice is made once per call signature (:func:`clear_selection_cache`).
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch

from . import backends
from ._checks import check_tensor
from .backends import AUTO_ORDER, BACKENDS, BackendStatus, LaunchPlan, ProblemKey
from .cache import PageTable, QuantKVCache
from .errors import InvalidArgumentError, UnsupportedError
from .quantize import FP4_QUANTIZERS, WRITE_KERNEL_QUANTIZERS
from .format import KVFormat
from .problem import DecodeProblem

ENV = "FOSCAR_BACKEND"
__all__ = ["AUTO_ORDER", "BACKENDS", "BackendStatus", "DecodePlan", "append", "backend_status", "decode", "plan",
           "select_backend"]


def backend_status(device: torch.device | str | None = None, fmt: KVFormat | None = None,
                   gqa: int | None = None, page_size: int | None = None) -> list[BackendStatus]:
    """Every backend, usable or not on ``device`` (default: the current CUDA device, else the CPU), and for
    a cache of format ``fmt`` (GQA ratio ``gqa``, ``page_size``) when given."""
    dev = torch.device(device) if device is not None else (
        torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu"))
    return backends.statuses(ProblemKey(dev, fmt, gqa, page_size))


def select_backend(q: torch.Tensor, cache: QuantKVCache, backend: str = "auto") -> str:
    """The backend a call runs on: ``backend`` (or ``$FOSCAR_BACKEND`` when ``backend="auto"``) if it can
    run, else an :class:`UnsupportedError` saying why; ``"auto"``: the first usable of
    :data:`AUTO_ORDER` (the reference only on the CPU)."""
    G = q.shape[-2] // cache.num_kv_heads  # q [B, Hq, D] or a step's [B, q_len, Hq, D]
    ring_step = q.dim() == 4 and q.shape[1] > 1 and cache.fmt.recent_capacity > 0
    return _select(str(q.device), _fmt_values(cache.fmt), G, cache.page_size, backend, os.environ.get(ENV, "auto"),
                   ring_step)


def _fmt_values(fmt: KVFormat) -> tuple:
    """The format as plain values (what the custom op takes, and what ``torch.compile`` can hold as a
    constant: older Dynamo cannot rebuild a frozen dataclass)."""
    return (fmt.bits, fmt.head_dim, fmt.group_size, fmt.k_axis, fmt.v_axis, fmt.mapping, fmt.sink, fmt.recent,
            fmt.scheme, fmt.rollback)


def _fmt_from_values(values: tuple) -> KVFormat:
    """The :class:`KVFormat` of :func:`_fmt_values` (a rotation is applied outside the custom op)."""
    *head, scheme, rollback = values
    return KVFormat(*head, scheme=scheme, rollback=rollback)


def _constant_for_compile(fn):
    """``fn`` marked as ``torch.compiler.assume_constant_result`` marks it (the attribute it sets, as
    ``tests/test_compile.py`` checks), without importing Dynamo: that import takes seconds of a
    process's start, and a process that never compiles does not need it."""
    fn._dynamo_marked_constant = True
    return fn


@_constant_for_compile  # host facts only: a compiled graph bakes the choice in
def _select(device: str, fmt_values: tuple, G: int, page_size: int, backend: str, env: str,
            ring_step: bool = False) -> str:
    return _cached_select(device, fmt_values, G, page_size, backend, env, ring_step)


@functools.lru_cache(maxsize=256)
def _cached_select(device: str, fmt_values: tuple, G: int, page_size: int, backend: str, env: str,
                   ring_step: bool = False) -> str:
    """The choice, made once per process and call signature (the status checks cost an eager decode
    call host time: imports looked up, the device queried). An error is not cached.
    :func:`clear_selection_cache` forgets the choices (after installing a backend, say). ``ring_step``: a step
    of several tokens over a cache with a BF16 recent ring, which ``auto`` gives a backend that takes it as it
    is (the causal view's rows would copy the ring once per token)."""
    fmt = _fmt_from_values(fmt_values)
    choice = backend
    source = "backend"
    if backend == "auto" and env != "auto":
        choice, source = env, ENV
    if choice != "auto" and choice not in BACKENDS:
        raise InvalidArgumentError(source, f"'auto' or one of {BACKENDS}", repr(choice))
    dev = torch.device(device)
    status = {s.name: s for s in backend_status(dev, fmt, G, page_size)}
    if choice != "auto":
        s = status[choice]
        if not s.usable:
            raise UnsupportedError(f"{source}={choice!r}", s.why)
        return choice
    for name in AUTO_ORDER:
        b = backends.get(name)
        if status[name].usable and dev.type in b.auto_devices and b.preferred(fmt) and (not ring_step or b.steps(fmt)):
            return name
    raise UnsupportedError(f"backend='auto' on {dev}",
                           "; ".join(f"{s.name}: {s.why}" for s in status.values() if not s.usable))


def clear_selection_cache() -> None:
    """Forget the backend choices :func:`decode`, :func:`plan` and :func:`select_backend` made."""
    _cached_select.cache_clear()


# --------------------------------------------------------------------------------------------
# The custom op: tensors and plain values in, out and lse written in place
# --------------------------------------------------------------------------------------------
def _cache_from_parts(fmt_args, tensors) -> QuantKVCache:
    *fmt_values, page_size, contiguous = fmt_args
    (k_codes, v_codes, k_params, v_params, tensor_scales, seq_lens, block_table, num_pages,
     k_sink, v_sink, k_recent, v_recent) = tensors
    fmt = _fmt_from_values(tuple(fmt_values))
    cache = QuantKVCache.__new__(QuantKVCache)  # validated when the caller built it: no host reads here
    cache.fmt = fmt
    cache.k_codes, cache.v_codes, cache.k_params, cache.v_params = k_codes, v_codes, k_params, v_params
    cache.tensor_scales = tensor_scales
    cache.k_sink, cache.v_sink, cache.k_recent, cache.v_recent = k_sink, v_sink, k_recent, v_recent
    cache.seq_lens = seq_lens
    cache.page_table = PageTable(block_table, num_pages, None, page_size)
    cache.page_size = page_size
    cache.contiguous = contiguous
    return cache


@torch.library.custom_op("foscar::decode", mutates_args=("out", "lse"))
def _decode_op(q: torch.Tensor, k_codes: torch.Tensor, v_codes: torch.Tensor, k_params: torch.Tensor,
               v_params: torch.Tensor, tensor_scales: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor,
               num_pages: torch.Tensor, k_sink: torch.Tensor, v_sink: torch.Tensor, k_recent: torch.Tensor,
               v_recent: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, bits: int, head_dim: int, group: int,
               k_axis: str, v_axis: str, mapping: str, sink: int, recent: int, scheme: str, rollback: int,
               page_size: int, contiguous: bool, sm_scale: float, backend: str, num_splits: int, q_len: int) -> None:
    cache = _cache_from_parts((bits, head_dim, group, k_axis, v_axis, mapping, sink, recent, scheme, rollback,
                               page_size, contiguous),
                              (k_codes, v_codes, k_params, v_params, tensor_scales, seq_lens, block_table, num_pages,
                               k_sink, v_sink, k_recent, v_recent))
    run = backends.get(backend)
    if q_len > 1 and not run.steps(cache.fmt):  # a step's rows over the causal view (:mod:`foscar.multitoken`)
        from .multitoken import causal_view
        cache, q_len = causal_view(cache, q_len), 1
    problem = DecodeProblem(q, cache, out, lse, sm_scale, None if num_splits <= 0 else num_splits,
                            q.shape[1] // cache.num_kv_heads, q_len)  # validated by the caller
    run.run(problem)


@_decode_op.register_fake
def _(q, k_codes, v_codes, k_params, v_params, tensor_scales, seq_lens, block_table, num_pages, k_sink, v_sink,
      k_recent, v_recent, out, lse, bits, head_dim, group, k_axis, v_axis, mapping, sink, recent, scheme, rollback,
      page_size, contiguous, sm_scale, backend, num_splits, q_len) -> None:
    return None


@dataclass
class DecodePlan:
    """A decode prepared on the host, FlashInfer style: :func:`plan` validates, picks the backend and the
    launch config, and allocates the workspace; :meth:`run` then neither reads the device back nor
    allocates (given ``out``), so a CUDA graph captures it and replays it for every step of one
    batch shape, whatever the lengths (they are read on the device)."""

    backend: str
    fmt: KVFormat
    shape: tuple[int, int, int]  # q: [B, Hq, D] (a step of q_len tokens: its rows, [B q_len, Hq, D])
    sm_scale: float
    launch: LaunchPlan  # the backend's config (num_splits; the CuTe variant) and workspace
    q_len: int = 0  #: planned for steps ``q [B, q_len, Hq, D]`` (:mod:`foscar.multitoken`); 0: ``q [B, Hq, D]``

    @property
    def num_splits(self) -> int | None:
        return self.launch.config.get("num_splits")

    @property
    def workspace(self):
        return self.launch.workspace

    @property
    def options(self) -> dict:
        """The planned kernel variant beyond the split count (CuTe: warp_specialized, ctas_per_sm)."""
        return {k: v for k, v in self.launch.config.items() if k != "num_splits"}

    def run(self, q: torch.Tensor, cache: QuantKVCache, out: torch.Tensor | None = None,
            lse: torch.Tensor | None = None):
        """Decode ``q`` over ``cache`` (same batch shape and format as planned) into ``out`` (and ``lse``).
        Without ``out`` the call allocates it (outside a CUDA graph). Planned for steps of ``q_len`` tokens:
        ``q [B, q_len, Hq, D]``, ``out`` and ``lse`` shaped per token (:mod:`foscar.multitoken`)."""
        if self.q_len:
            from .multitoken import flatten_step, unflatten
            check_tensor("q", q, ndim=4)
            B, T = q.shape[:2]
            if (B * T, *q.shape[2:]) != self.shape or T != self.q_len:
                raise InvalidArgumentError("q", f"the planned step of {self.q_len} tokens, rows {self.shape}",
                                           tuple(q.shape))
            if _steps_natively(self.backend, self.fmt):
                from .multitoken import check_step, step_rows
                check_step(q, cache)
                out_rows, lse_rows = step_rows(q, out, lse)
                return unflatten(self._run_rows(q.reshape(-1, *q.shape[2:]), cache, out_rows, lse_rows, T), B, T)
            q_rows, view, out_rows, lse_rows = flatten_step(q, cache, out, lse)
            return unflatten(self._run_rows(q_rows, view, out_rows, lse_rows), B, T)
        return self._run_rows(q, cache, out, lse)

    def _run_rows(self, q: torch.Tensor, cache: QuantKVCache, out: torch.Tensor | None, lse: torch.Tensor | None,
                  q_len: int = 1):
        check_tensor("q", q, ndim=3)
        if not isinstance(cache, QuantKVCache):
            raise InvalidArgumentError("cache", "a foscar.QuantKVCache", type(cache).__name__)
        if tuple(q.shape) != self.shape or cache.fmt != self.fmt:
            raise InvalidArgumentError("q/cache", f"the planned shape {self.shape} and format",
                                       f"{tuple(q.shape)}, {cache.fmt}")
        from ._checks import decode_out_buffers
        out, lse = decode_out_buffers(q, out, lse, False)  # checks what was given; allocates only a missing out
        problem = DecodeProblem(q, cache, out, lse, self.sm_scale, self.num_splits, q.shape[1] // cache.num_kv_heads,
                                q_len)
        chosen = backends.get(self.backend)
        solved = problem if chosen.rotates(cache.fmt) else problem.in_cache_space()
        chosen.run(solved, self.launch)
        problem.finish(solved)
        return out if lse is None else (out, lse)


def plan(q: torch.Tensor, cache: QuantKVCache, *, sm_scale: float | None = None, backend: str = "auto",
         num_splits: int | None = None) -> DecodePlan:
    """Prepare decodes of queries shaped like ``q`` over caches like ``cache`` (:class:`DecodePlan`); ``q [B,
    q_len, Hq, D]``: steps of ``q_len`` tokens (:mod:`foscar.multitoken`)."""
    q_len = 0
    if isinstance(q, torch.Tensor) and q.dim() == 4:
        from .multitoken import flatten_step, step_problem
        q_len = q.shape[1]
        if not isinstance(cache, QuantKVCache):
            raise InvalidArgumentError("cache", "a foscar.QuantKVCache", type(cache).__name__)
        chosen = select_backend(q, cache, backend)
        if _steps_natively(chosen, cache.fmt):
            problem = step_problem(q, cache, sm_scale=sm_scale, num_splits=num_splits)
            launch = backends.get(chosen).plan(problem)
            return DecodePlan(chosen, cache.fmt, tuple(problem.q.shape), problem.sm_scale, launch, q_len)
        q, cache, _, _ = flatten_step(q, cache, None, None)
    problem = DecodeProblem.build(q, cache, sm_scale=sm_scale, num_splits=num_splits)
    chosen = _select(str(q.device), _fmt_values(cache.fmt), problem.gqa, cache.page_size, backend,
                     os.environ.get(ENV, "auto"))
    launch = backends.get(chosen).plan(problem)
    return DecodePlan(chosen, cache.fmt, tuple(q.shape), problem.sm_scale, launch, q_len)


def op_args(q, cache: QuantKVCache, out, lse, sm_scale: float, backend: str, num_splits: int | None,
            q_len: int = 1) -> tuple:
    """The arguments of ``torch.ops.foscar.decode`` for a (validated) call: the cache as its tensors and
    its format as plain values; ``q_len > 1``: ``q`` holds the rows of steps of ``q_len`` tokens."""
    fmt = cache.fmt
    pt = cache.page_table
    return (q, cache.k_codes, cache.v_codes, cache.k_params, cache.v_params, cache.tensor_scales, cache.seq_lens,
            pt.block_table,
            pt.num_pages, cache.k_sink, cache.v_sink, cache.k_recent, cache.v_recent, out, lse, *_fmt_values(fmt),
            cache.page_size, cache.contiguous, float(sm_scale), backend, 0 if num_splits is None else int(num_splits),
            int(q_len))


def decode(q: torch.Tensor, cache: QuantKVCache, *, sm_scale: float | None = None, out: torch.Tensor | None = None,
           lse: torch.Tensor | None = None, return_lse: bool = False, backend: str = "auto",
           num_splits: int | None = None):
    """Decode attention of ``q [B, Hq, D]`` (one new token per sequence) over ``cache``.

    Returns ``out [B, Hq, D]`` (``q``'s dtype for BF16/FP16/FP32 queries; or the given ``out``), and
    ``lse [B, Hq]`` (float32, natural log) when ``return_lse`` or ``lse`` is given. ``backend``: ``"auto"``
    (default), ``"cute"``, ``"triton"`` or ``"reference"`` (module docstring). ``num_splits``: KV splits
    per sequence for the GPU kernels (default: the kernel's heuristic). ``q [B, q_len, Hq, D]``: a step of
    ``q_len`` tokens per sequence, appended to the cache before the call, causal among themselves
    (:mod:`foscar.multitoken`); ``out [B, q_len, Hq, D]``, ``lse [B, q_len, Hq]``.
    """
    if isinstance(q, torch.Tensor) and q.dim() == 4:  # a step of several tokens
        return _decode_step(q, cache, sm_scale=sm_scale, out=out, lse=lse, return_lse=return_lse, backend=backend,
                            num_splits=num_splits)
    want_lse = return_lse or lse is not None
    problem = DecodeProblem.build(q, cache, sm_scale=sm_scale, out=out, lse=lse, return_lse=True,
                                  num_splits=num_splits)
    chosen = _select(str(q.device), _fmt_values(cache.fmt), problem.gqa, cache.page_size, backend,
                     os.environ.get(ENV, "auto"))
    # a rotated cache: the query rotated in, the output rotated back (by the kernels, where they do it; the
    # custom op's cache names no rotation)
    compiling = torch.compiler.is_compiling()
    in_kernel = backends.get(chosen).rotates(cache.fmt) and not compiling
    solved = problem if in_kernel else problem.in_cache_space()
    if compiling:  # the custom op: what torch.compile traces
        torch.ops.foscar.decode(*op_args(solved.q, cache, solved.out, solved.lse, solved.sm_scale, chosen,
                                         num_splits))
    else:  # eager: the same implementation without the dispatcher's host time
        backends.get(chosen).run(solved)
    problem.finish(solved, lse_wanted=want_lse)
    return (problem.out, problem.lse) if want_lse else problem.out


def _steps_natively(backend: str, fmt: KVFormat) -> bool:
    """Whether a step of several tokens goes to ``backend`` as it is (else as the rows of a causal view)."""
    return backends.get(backend).steps(fmt)


def _decode_step(q: torch.Tensor, cache: QuantKVCache, *, sm_scale, out, lse, return_lse: bool, backend: str,
                 num_splits):
    """:func:`decode` of a step ``q [B, q_len, Hq, D]`` (:mod:`foscar.multitoken`): to a backend that takes
    steps as they are, else one decode of the step's rows over a causal view of the cache (in a compiled
    graph the custom op makes the view: it is a Python object, not a tensor)."""
    from .multitoken import flatten_step, step_problem, unflatten
    if not isinstance(cache, QuantKVCache):
        raise InvalidArgumentError("cache", "a foscar.QuantKVCache", type(cache).__name__)
    B, T = q.shape[:2]
    chosen = select_backend(q, cache, backend)
    compiling = torch.compiler.is_compiling()
    if not compiling and not _steps_natively(chosen, cache.fmt):
        q_rows, view, out_rows, lse_rows = flatten_step(q, cache, out, lse)
        return unflatten(decode(q_rows, view, sm_scale=sm_scale, out=out_rows, lse=lse_rows, return_lse=return_lse,
                                backend=chosen, num_splits=num_splits), B, T)
    want_lse = return_lse or lse is not None
    problem = step_problem(q, cache, sm_scale=sm_scale, out=out, lse=lse, return_lse=True, num_splits=num_splits)
    run_backend = backends.get(chosen)
    if compiling:  # the custom op (the cache it rebuilds names no rotation: the query goes in rotated)
        solved = problem.in_cache_space()
        torch.ops.foscar.decode(*op_args(solved.q, cache, solved.out, solved.lse, solved.sm_scale, chosen,
                                         num_splits, T))
    else:
        solved = problem if run_backend.rotates(cache.fmt) else problem.in_cache_space()
        run_backend.run(solved)
    problem.finish(solved, lse_wanted=want_lse)
    return unflatten((problem.out, problem.lse) if want_lse else problem.out, B, T)


WRITE_BACKENDS = ("triton", "reference")


def append(cache: QuantKVCache, k_new: torch.Tensor, v_new: torch.Tensor, *, backend: str = "auto",
           quantizer: str = "minmax", check: bool = True) -> None:
    """Append ``T`` tokens per sequence, ``k_new, v_new [B, Hkv, T, D]``, to ``cache`` (a prefill, or a
    decode step with ``T = 1``).

    ``backend``: ``"triton"`` (the fused kernels of :mod:`foscar.triton.write`: a CUDA device, the
    ``bf16`` mapping, the quantizers of :data:`foscar.quantize.WRITE_KERNEL_QUANTIZERS` (min-max, a clip
    preset, the ``"mse"`` search), and the FP4 block formats with ``"minmax"`` or ``"mse"``; graph-safe with
    ``check=False``), ``"reference"``
    (:meth:`QuantKVCache.append`, PyTorch, every mapping and quantizer, the query-weighted rounding of a
    cache's ``key_weights``, any device), or ``"auto"`` (default): Triton where it can write this cache, else
    the reference. Both write the same cache bit
    for bit. An explicit choice that cannot run raises :class:`UnsupportedError` saying why.
    """
    if backend not in ("auto", *WRITE_BACKENDS):
        raise InvalidArgumentError("backend", f"'auto' or one of {WRITE_BACKENDS}", repr(backend))
    if not isinstance(cache, QuantKVCache):
        raise InvalidArgumentError("cache", "a foscar.QuantKVCache", type(cache).__name__)
    check_tensor("k_new", k_new, ndim=4)  # the rest (shape, dtype, device, values) as each writer checks it
    status = backends.get("triton").status(ProblemKey(cache.device, cache.fmt))
    why_not = None if status.usable else status.why
    takes = FP4_QUANTIZERS if cache.fmt.is_fp4 else WRITE_KERNEL_QUANTIZERS
    if why_not is None and quantizer not in takes:
        why_not = f"quantizes with {takes} only (quantizer={quantizer!r})"
    if why_not is None and cache.k_weights is not None:
        why_not = "rounds to nearest: the query-weighted rounding of a cache's key_weights is the PyTorch path's"
    if backend == "triton" and why_not:
        raise UnsupportedError("backend='triton'", why_not)
    if backend == "reference" or why_not:
        cache.append(k_new, v_new, quantizer=quantizer)
        return
    from .triton import append as triton_append
    from .write_path import tokens_to_store
    with tokens_to_store(cache, k_new, v_new) as (k_new, v_new):  # as the reference path's cache.append does
        if k_new.dim() == 4 and k_new.shape[2] == 1 and cache.batch_size:
            from .triton import append_step
            append_step(cache, k_new[:, :, 0], v_new[:, :, 0], check=check, quantizer=quantizer)  # a launch per tensor
        else:
            triton_append(cache, k_new, v_new, check=check, quantizer=quantizer)
