"""Compile the stage-1 kernels for TVM-FFI calls, on any machine (``CUTE_DSL_ARCH=sm_90a`` without a GPU).

Kept PTX and cubin (``keep_ptx``, ``keep_cubin``) are written by CuTe DSL to files named after the kernel
(``cutlass___call___...``) in its dump folder: the compile option ``DumpDir`` when given, else
``CUTE_DSL_DUMP_DIR`` as read when cutlass was imported, else the current working directory
(cutlass-dsl 4.8.1). The compiles here give a temporary folder of their own, read back into the
compiled function's ``__ptx__`` / ``__cubin__`` and removed.
"""
from __future__ import annotations

import tempfile
import warnings

import cuda.bindings.driver as cuda
import cutlass.cute as cute
from cutlass import BFloat16, Float16, Float32, Int32
from cutlass.base_dsl.ast_helpers import DSLOptimizationWarning
from cutlass.base_dsl.compiler import DumpDir
from cutlass.cute.runtime import make_fake_stream

from .combine import CombineSm90, CombineWindowsSm90
from .combine_config import COMBINE_TENSORS, COMBINE_WINDOW_TENSORS, CombineConfig
from .config import ALIGN, WS_REGISTERS, Sm90Config
from .kernel_v0 import FoldDecodeSm90
from .kernel_v1 import FoldDecodeSm90WS


class FoldDecodeSm90WSMerged(FoldDecodeSm90WS):
    """v1 whose last CTA of each (sequence, KV head) merges the splits (``cfg.fused_merge``,
    :mod:`foscar.cute.tail_merge`): after :data:`~foscar.cute.config.STAGE1_TENSORS` it takes the output ``[B, rows,
    D]``, the LSE ``[B, rows]`` (any such tensor where ``cfg.fused_merge`` is 1: not written) and the counters
    ``[B Hkv]`` (int32, zero; left at zero)."""

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mKC: cute.Tensor, mVC: cute.Tensor, mKP: cute.Tensor, mVP: cute.Tensor,
                 mBT: cute.Tensor, mSEQ: cute.Tensor, mOP: cute.Tensor, mLP: cute.Tensor, mRot: cute.Tensor,
                 mTS: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor, mSEM: cute.Tensor, qk_scale: Float32,
                 num_splits: Int32, stream: cuda.CUstream):
        self._launch(mQ, mKC, mVC, mKP, mVP, mBT, mSEQ, mOP, mLP, mRot, mTS, (mO, mLSE, mSEM), qk_scale, num_splits,
                     stream)


#: The cutlass element type of each :data:`~foscar.cute.config.STAGE1_TENSORS` element type.
ELEMENT_TYPES = {"bf16": BFloat16, "f16": Float16, "i32": Int32, "f32": Float32}


def _placeholder(dtype, rank: int, unit_last: bool = True, aligned_rows: bool = False):
    """A symbolic tensor of ``rank`` dims: dynamic extents and strides, the last stride 1 (``unit_last``;
    on a 16-byte aligned base), else dynamic too (on a base aligned to the element); ``aligned_rows``: the
    other strides multiples of 16 bytes too (every row a 16-byte aligned vector)."""
    from cutlass.cute.runtime import make_fake_tensor
    last = (1,) if unit_last else (cute.sym_int64(),)
    div = ALIGN * 8 // dtype.width if aligned_rows else 1
    return make_fake_tensor(dtype, tuple(cute.sym_int() for _ in range(rank)),
                            tuple(cute.sym_int64(divisibility=div) for _ in range(rank - 1)) + last,
                            assumed_align=ALIGN if unit_last else dtype.width // 8)


def compile_stage1(cfg: Sm90Config, *, keep_ptx: bool = False, warp_specialized: bool = False,
                   ctas_per_sm: int = 1, keep_cubin: bool = False):
    """Compile the kernel for ``cfg``: v0, or v1 (``warp_specialized``: TMA producer and two consumer
    warpgroups; ``ctas_per_sm`` of them resident, 1 or 2, :data:`~foscar.cute.config.WS_REGISTERS`). The
    function is compiled for TVM-FFI (apache-tvm-ffi): it takes torch tensors as they are
    (:data:`~foscar.cute.config.STAGE1_TENSORS`, checked against the placeholders' dtypes, ranks, unit
    strides and alignment by the call itself), then ``qk_scale`` (float) and ``num_splits`` (int), and
    launches on torch's current stream (CUDA graphs capture it). Host time of a call: a few microseconds,
    where wrapping each tensor with ``from_dlpack`` took tens. ``keep_ptx`` / ``keep_cubin``: the PTX
    is the compiled function's ``__ptx__``, the cubin its ``__cubin__``; no file is left behind."""
    if ctas_per_sm not in WS_REGISTERS:
        raise ValueError(f"ctas_per_sm: expected one of {sorted(WS_REGISTERS)}, got {ctas_per_sm!r}")
    if cfg.k_channel and cfg.k_e4m3 and not warp_specialized:
        raise ValueError("warp_specialized: v0 takes channel-wise K with BF16 K operands (E4M3 terms of Q' are v1's)")
    if cfg.tiles_per_pass != 1 and not warp_specialized:
        raise ValueError(f"tiles_per_pass: v0 takes 1, got {cfg.tiles_per_pass!r} (two tiles per pass are v1's)")
    if cfg.fused_merge and not warp_specialized:
        raise ValueError("warp_specialized: the fused merge (cfg.fused_merge) is v1's")
    kernel = ((FoldDecodeSm90WSMerged if cfg.fused_merge else FoldDecodeSm90WS)(cfg, ctas_per_sm) if warp_specialized
              else FoldDecodeSm90(cfg))
    from .launch import stage1_tensors
    args = [_placeholder(ELEMENT_TYPES[dtype], rank) for _, dtype, rank in stage1_tensors(cfg)]
    return _compile(kernel, (*args, Float32(1.0), Int32(1)), keep_ptx, keep_cubin)


def _compile(kernel, args, keep_ptx: bool, keep_cubin: bool):
    """``cute.compile`` of ``kernel`` for TVM-FFI calls on torch's current stream (the last argument),
    keeping the PTX and the cubin in a temporary dump folder when asked."""
    stream = make_fake_stream(use_tvm_ffi_env_stream=True)
    keep = ((cute.KeepPTX,) if keep_ptx else ()) + ((cute.KeepCUBIN,) if keep_cubin else ())
    if not keep:
        return cute.compile[(cute.EnableTVMFFI,)](kernel, *args, stream)
    with tempfile.TemporaryDirectory(prefix="foscar-cute-ptx-") as dump_dir:
        return cute.compile[(*keep, cute.EnableTVMFFI, DumpDir(dump_dir))](kernel, *args, stream)


def compile_combine(cfg: CombineConfig, *, keep_ptx: bool = False):
    """Compile the combine of ``cfg`` (:class:`~foscar.cute.combine.CombineSm90`) for TVM-FFI calls: it
    takes the :data:`~foscar.cute.combine_config.COMBINE_TENSORS` as torch tensors (the partials with unit
    stride in the last dim on 16-byte aligned bases; ``out`` and ``lse`` with any strides) and launches
    on torch's current stream."""
    out_type = ELEMENT_TYPES[cfg.out_dtype]
    args = [_placeholder(ELEMENT_TYPES[dtype or cfg.out_dtype], rank, unit_last=name.startswith("partial"))
            for name, dtype, rank in COMBINE_TENSORS]
    if cfg.windows:  # then the windows' tensors (rows of 16-byte vectors) and the softmax scale
        window_type = ELEMENT_TYPES[cfg.window_dtype]
        kernel = CombineWindowsSm90(cfg, out_type, window_type)
        args += [_placeholder(ELEMENT_TYPES[dtype or cfg.window_dtype], rank, aligned_rows=rank == 4)
                 for name, dtype, rank in COMBINE_WINDOW_TENSORS]
        args.append(Float32(1.0))
    else:
        kernel = CombineSm90(cfg, out_type)
    with warnings.catch_warnings():  # the 64-partial chunk's unrolled loops: CuTe DSL warns at 64 iterations
        warnings.simplefilter("ignore", DSLOptimizationWarning)  # of slow compiles; this one takes 0.7 s
        return _compile(kernel, args, keep_ptx, False)
