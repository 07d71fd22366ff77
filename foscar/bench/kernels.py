"""The decode benchmark's kernel table, :data:`KERNELS`: the things it times, each a small object with a
name, the cache it reads (``family``: ``"quant"``, the packed foscar cache; ``"bf16"``, the BF16 paged
cache), whether it is timed by default, and ``build(inputs, args)``, which returns a :class:`Runner` or
raises :class:`KernelMissing` saying why the kernel cannot run here.

- foscar's kernels go through the backend registry (:mod:`foscar.backends`): :class:`BackendKernel` is
  a backend with fixed launch options, available where the backend's ``status`` says it is usable (its
  ``why`` otherwise) and run by its ``launch``; :class:`AutoKernel` is ``foscar.decode``, with the
  backend and launch config the library picks.
- the baselines are :class:`Baseline` kernels of their own: the per-value reconstruction and plain BF16
  Triton kernels, FlashInfer (BF16, FP8 and NVFP4 KV), cuDNN SDPA and FlashAttention-4.

Every runner writes a NaN-poisoned output (or returns a fresh one), which the slice check then reads
(:mod:`foscar.bench.measure`).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from .. import backends
from ..backends.base import ProblemKey
from ..errors import UnsupportedError
from .grid import FI_WORKSPACE_BYTES
from .inputs import Bf16Inputs, QuantInputs


class KernelMissing(Exception):
    """The kernel is not there (not installed, not written, not supported): reported, never skipped."""


@dataclass
class Runner:
    fn: Callable[[], object]  # the timed call
    out: torch.Tensor | None = None  # the NaN-poisoned buffer it writes; None: check what fn returns
    to_bhd: Callable[[torch.Tensor], torch.Tensor] = lambda o: o  # its output as [B, Hq, D]
    keep: tuple = ()  # objects that must outlive the runner (workspaces, wrappers)
    judged: str | None = None  # why the output is not held to the slice check (a lossy or random-code peer)

    def output(self, returned) -> torch.Tensor:
        return self.to_bhd(self.out if self.out is not None else returned)


def _never(e: BaseException) -> bool:
    return False


def _foscar_unavailable(e: BaseException) -> bool:
    return isinstance(e, (NotImplementedError, UnsupportedError))


def _cudnn_unavailable(e: BaseException) -> bool:
    """torch's "no kernel can run this" (CUDA: "No available kernel", CPU: "No viable backend")."""
    return isinstance(e, RuntimeError) and ("No available kernel" in str(e) or "No viable backend" in str(e))


def _nan_like(t: torch.Tensor) -> torch.Tensor:
    return torch.full_like(t, float("nan"))


def _splits(args) -> dict:
    """``--num-splits``, as the decode entry points take it."""
    return {} if args.num_splits is None else {"num_splits": args.num_splits}


def problem_key(inp: QuantInputs) -> ProblemKey:
    """What a backend's ``status`` is asked about for a decode of ``inp``."""
    return ProblemKey(inp.q.device, inp.cache.fmt, inp.q.shape[1] // inp.cache.num_kv_heads, inp.cache.page_size)


# ---------------------------------------------------------------------------------------------
# foscar's kernels: through the backend registry
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class BackendKernel:
    """Backend ``backend`` of :mod:`foscar.backends` with launch ``options`` (the rest of the launch config
    from the autotune cache or the backend's heuristics, as a user's call gets it; ``--num-splits``
    passed on), writing a NaN-poisoned ``out``."""

    name: str
    backend: str
    options: dict = field(default_factory=dict)
    default: bool = True
    family: ClassVar[str] = "quant"

    def build(self, inp: QuantInputs, args) -> Runner:
        backend = backends.get(self.backend)
        status = backend.status(problem_key(inp))
        if not status.usable:
            raise KernelMissing(status.why)
        out = _nan_like(inp.q)
        config = {**self.options, **_splits(args), "out": out}
        return Runner(lambda: backend.launch(inp.q, inp.cache, config), keep=(out,))

    def unavailable(self, e: BaseException) -> bool:
        return _foscar_unavailable(e)


@dataclass(frozen=True)
class AutoKernel:
    """What a user's call runs: ``foscar.decode`` with the backend (``backend="auto"``), variant and launch
    config it picks, where :func:`foscar.select_backend` finds a usable backend."""

    name: str
    default: bool = True
    #: decode a view of the same codes as a rotated (Hadamard, seeded signs) and centred cache: what the
    #: rotation and the centring cost (their correctness: tests/test_rotation.py, tests/test_centring.py)
    rotated: bool = False
    family: ClassVar[str] = "quant"

    def build(self, inp: QuantInputs, args) -> Runner:
        import foscar
        cache = rotated_view(inp.cache) if self.rotated else inp.cache
        try:
            foscar.select_backend(inp.q, cache)
        except UnsupportedError as e:
            raise KernelMissing(str(e)) from e
        out = _nan_like(inp.q)
        kw = {**_splits(args), "out": out}
        judged = "a rotated, centred view of the same codes: timing only" if self.rotated else None
        return Runner(lambda: foscar.decode(inp.q, cache, **kw), out, keep=(cache,), judged=judged)

    def unavailable(self, e: BaseException) -> bool:
        return _foscar_unavailable(e)


def rotated_view(cache, rotated: bool = True, centred: bool = True):
    """``cache``'s tensors (no copy) as a cache of the same format with a Hadamard rotation (seed 0:
    ``rotated``) and a random key mean (seed 0: ``centred``)."""
    import copy
    import dataclasses
    view = copy.copy(cache)
    if rotated:
        view.fmt = dataclasses.replace(cache.fmt, rotation="hadamard", rotation_seed=0)
    if centred:
        gen = torch.Generator(device=cache.k_codes.device).manual_seed(0)
        view.k_mean = torch.randn(cache.seq_lens.shape[0], cache.num_kv_heads, cache.fmt.head_dim, generator=gen,
                                  device=cache.k_codes.device)
        view.k_mean_pending = False
    return view


def windowed_view(cache, sink: int = 4, recent: int = 64, seed: int = 0):
    """``cache``'s codes (no copy) as a cache of the same format with BF16 windows of ``sink`` and ``recent``
    tokens (random values, seed ``seed``) around them: each sequence ``sink + recent`` tokens longer, its
    quantized tokens those of ``cache``. Token-wise formats (one token a flush)."""
    import copy
    import dataclasses
    fmt = dataclasses.replace(cache.fmt, sink=sink, recent=recent)
    if fmt.flush != 1:
        raise ValueError(f"cache: expected a token-wise format (flush 1), got flush {fmt.flush}")
    view = copy.copy(cache)
    view.fmt = fmt
    B, H, D = cache.seq_lens.shape[0], cache.num_kv_heads, fmt.head_dim
    dev = cache.k_codes.device
    gen = torch.Generator(device=dev).manual_seed(seed)
    view.k_sink, view.v_sink, view.k_recent, view.v_recent = (
        torch.randn(B, H, n, D, generator=gen, device=dev).to(torch.bfloat16)
        for n in (sink, sink, fmt.recent_capacity, fmt.recent_capacity))
    view.seq_lens = cache.seq_lens + sink + recent
    return view


# ---------------------------------------------------------------------------------------------
# Baselines: one builder each; a builder returns a Runner or raises KernelMissing
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Baseline:
    name: str
    family: str  # "quant" (reads the foscar cache) or "bf16" (reads the BF16 paged cache)
    make: Callable[[object, object], Runner]
    missing_on: Callable[[BaseException], bool] = _never  # first-call errors that mean "missing"
    default: bool = True  # timed unless --kernels says otherwise

    def build(self, inp, args) -> Runner:
        return self.make(inp, args)

    def unavailable(self, e: BaseException) -> bool:
        return self.missing_on(e)


def _foscar_triton(name: str):
    try:
        import foscar.triton as ft
    except Exception as e:
        raise KernelMissing(f"import foscar.triton failed: {type(e).__name__}: {e}") from e
    fn = getattr(ft, name, None)
    if fn is None:
        raise KernelMissing(f"foscar.triton has no {name}()")
    return fn


def _flashinfer():
    try:
        import flashinfer
    except Exception as e:
        raise KernelMissing(f"import flashinfer failed: {type(e).__name__}: {e}") from e
    return flashinfer


def flashinfer_version() -> str:
    """FlashInfer's version, or ``missing: <why>``."""
    try:
        return _flashinfer().__version__
    except KernelMissing as e:
        return f"missing: {e}"


def build_foscar_reconstruct(inp: QuantInputs, args) -> Runner:
    """The per-value reconstruction baseline of the paper's ablation: the Triton kernel's tiling,
    ``kernel="reconstruct"``, into a NaN-poisoned ``out``."""
    decode = _foscar_triton("decode")
    out = _nan_like(inp.q)
    kw = {**_splits(args), "out": out, "kernel": "reconstruct"}
    return Runner(lambda: decode(inp.q, inp.cache, **kw), out)


def build_foscar_bf16(inp: Bf16Inputs, args) -> Runner:
    """decode_bf16 takes ``[pages, Hkv, page, D]`` and reads strides: the NHD pages FlashInfer reads, as a view."""
    decode_bf16 = _foscar_triton("decode_bf16")
    out = _nan_like(inp.q)
    k, v = (c.permute(0, 2, 1, 3) for c in (inp.k_cache, inp.v_cache))
    return Runner(lambda: decode_bf16(inp.q, k, v, inp.block_table, inp.seq_lens, out=out), out)


def _fi_plan(fi, inp: Bf16Inputs, kv_data_type, **wrapper_kw):
    """A FlashInfer paged decode wrapper, planned for ``inp``'s pages (every page full: lengths are page
    multiples); returns it with the buffers it holds."""
    B, pages = inp.block_table.shape
    _, page, kv_heads, head_dim = inp.k_cache.shape
    dev = inp.q.device
    ws = torch.zeros(FI_WORKSPACE_BYTES, dtype=torch.uint8, device=dev)
    wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", **wrapper_kw)
    indptr = torch.arange(B + 1, dtype=torch.int32, device=dev) * pages
    last_page_len = torch.full((B,), page, dtype=torch.int32, device=dev)
    wrapper.plan(indptr, inp.block_table.reshape(-1).contiguous(), last_page_len, inp.q.shape[1], kv_heads,
                 head_dim, page, q_data_type=torch.bfloat16, kv_data_type=kv_data_type)
    return wrapper, (ws, wrapper, indptr, last_page_len)


def build_flashinfer(tensor_cores: bool):
    def build(inp: Bf16Inputs, args) -> Runner:
        wrapper, keep = _fi_plan(_flashinfer(), inp, torch.bfloat16, use_tensor_cores=tensor_cores)
        out = _nan_like(inp.q)
        kv = (inp.k_cache, inp.v_cache)
        return Runner(lambda: wrapper.run(inp.q, kv, out=out), out, keep=keep)
    return build


# FlashInfer's low-bit KV decode, the peers of the paper's comparison. Their outputs are not held to BF16
# attention's error.
def build_flashinfer_fp8(inp: Bf16Inputs, args) -> Runner:
    """FP8 (e4m3) KV on tensor cores: the benchmark's BF16 values rounded to e4m3."""
    wrapper, keep = _fi_plan(_flashinfer(), inp, torch.float8_e4m3fn, use_tensor_cores=True)
    out = _nan_like(inp.q)
    kv = (inp.k_cache.to(torch.float8_e4m3fn), inp.v_cache.to(torch.float8_e4m3fn))
    return Runner(lambda: wrapper.run(inp.q, kv, out=out), out, keep=keep + (kv,),
                  judged="FP8 e4m3 KV: lossy, not held to BF16 attention's error")


def build_flashinfer_nvfp4(inp: Bf16Inputs, args) -> Runner:
    """NVFP4 KV (the fa2 backend; D/2 + D/16 bytes per token and KV head per tensor, the head dim D from the
    cache's shape: at D = 128 and 256 exactly what foscar INT4 with g = 128 and FP32 scale and offset
    stores), random codes and scales: timing only."""
    wrapper, keep = _fi_plan(_flashinfer(), inp, torch.uint8, use_tensor_cores=True, backend="fa2")
    n, page, kv_heads, head_dim = inp.k_cache.shape
    dev = inp.q.device
    codes = [torch.randint(0, 256, (n, page, kv_heads, head_dim // 2), dtype=torch.uint8, device=dev)
             for _ in range(2)]
    sfs = [(torch.rand(n, page, kv_heads, head_dim // 16, device=dev) + 0.5).to(torch.float8_e4m3fn)
           for _ in range(2)]
    out = _nan_like(inp.q)
    return Runner(lambda: wrapper.run(inp.q, tuple(codes), kv_cache_sf=tuple(sfs), out=out), out,
                  keep=keep + (codes, sfs), judged="NVFP4 KV with random codes: timing only")


def build_cudnn_sdpa(inp: Bf16Inputs, args) -> Runner:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    backend = getattr(SDPBackend, "CUDNN_ATTENTION", None)
    if backend is None:
        raise KernelMissing("this torch has no SDPBackend.CUDNN_ATTENTION")
    B = inp.q.shape[0]
    _, _, kv_heads, head_dim = inp.k_cache.shape
    q4 = inp.q.unsqueeze(2)  # [B, Hq, 1, D]
    k4, v4 = (c.view(B, -1, kv_heads, head_dim).transpose(1, 2) for c in (inp.k_cache, inp.v_cache))  # [B, Hkv, L, D]

    def run():
        with sdpa_kernel(backend):
            return torch.nn.functional.scaled_dot_product_attention(q4, k4, v4, enable_gqa=True)
    return Runner(run, None, to_bhd=lambda o: o.squeeze(2))


def build_fa4(inp: Bf16Inputs, args) -> Runner:
    """FlashAttention-4 (``flash_attn.cute.flash_attn_func``, needs cutlass-dsl) over an unpaged copy of
    the BF16 cache (``[B, L, Hkv, D]``, gathered through the block table once, not timed): it takes no
    page table and does not split the KV sequence on sm_90."""
    try:
        from flash_attn.cute import flash_attn_func
    except Exception as e:
        raise KernelMissing(f"import flash_attn.cute failed: {type(e).__name__}: {e}") from e
    B = inp.q.shape[0]
    _, _, kv_heads, head_dim = inp.k_cache.shape
    k, v = (c[inp.block_table.long()].reshape(B, -1, kv_heads, head_dim) for c in (inp.k_cache, inp.v_cache))
    q = inp.q.unsqueeze(1)  # [B, 1, Hq, D]
    return Runner(lambda: flash_attn_func(q, k, v), None,
                  to_bhd=lambda o: (o[0] if isinstance(o, tuple) else o).squeeze(1), keep=(k, v))


Kernel = BackendKernel | AutoKernel | Baseline

KERNELS: dict[str, Kernel] = {k.name: k for k in (
    BackendKernel("foscar_folded", "triton", {"kernel": "folded"}),
    Baseline("foscar_reconstruct", "quant", build_foscar_reconstruct, _foscar_unavailable),
    BackendKernel("foscar_cute", "cute", {"warp_specialized": False, "k_operand": "bf16"}, default=False),  # v0
    BackendKernel("foscar_cute_ws", "cute", {"warp_specialized": True, "k_operand": "bf16", "tiles_per_pass": 1},
                  default=False),  # v1
    BackendKernel("foscar_cute_e4m3", "cute", {"warp_specialized": True, "k_operand": "e4m3", "tiles_per_pass": 1},
                  default=False),
    BackendKernel("foscar_cute_pair", "cute", {"warp_specialized": True, "k_operand": "e4m3", "tiles_per_pass": 2},
                  default=False),  # two tiles per softmax pass
    BackendKernel("foscar_cute_e4m3x3", "cute", {"warp_specialized": True, "k_operand": "e4m3x3", "tiles_per_pass": 1},
                  default=False),  # the query as three E4M3 terms
    BackendKernel("foscar_cute_e4m3d4", "cute", {"warp_specialized": True, "k_operand": "e4m3d4", "tiles_per_pass": 1},
                  default=False),  # the query as four integer digits: the accuracy option
    AutoKernel("foscar_auto", default=False),
    AutoKernel("foscar_auto_rotated", default=False, rotated=True),
    Baseline("foscar_bf16", "bf16", build_foscar_bf16, _foscar_unavailable),
    Baseline("flashinfer_tc", "bf16", build_flashinfer(True)),
    Baseline("flashinfer", "bf16", build_flashinfer(False)),
    Baseline("cudnn_sdpa", "bf16", build_cudnn_sdpa, _cudnn_unavailable),
    Baseline("flashinfer_fp8", "bf16", build_flashinfer_fp8, default=False),
    Baseline("flashinfer_nvfp4", "bf16", build_flashinfer_nvfp4, default=False),
    Baseline("fa4", "bf16", build_fa4, default=False),
)}
