"""Compile the stage-1 kernels for TVM-FFI calls, on any machine (``CUTE_DSL_ARCH=sm_90a`` without a GPU).

Kept PTX (``keep_ptx``) is written by CuTe DSL to files named after the kernel (``cutlass___call___...``)
in its dump folder: the compile option ``DumpDir`` when given, else ``CUTE_DSL_DUMP_DIR`` as read when
cutlass was imported, else the current working directory (cutlass-dsl 4.8.1). :func:`compile_stage1`
gives a temporary folder of its own, read back into the compiled function's ``__ptx__`` and removed.
"""
from __future__ import annotations

import tempfile

import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass.base_dsl.compiler import DumpDir
from cutlass.cute.runtime import make_fake_stream

from .config import ALIGN, STAGE1_TENSORS, WS_REGISTERS, Sm90Config
from .kernel_v0 import FoldDecodeSm90
from .kernel_v1 import FoldDecodeSm90WS


def _placeholder(dtype, rank: int):
    """A symbolic tensor of ``rank`` dims: dynamic extents and strides, the last stride 1."""
    from cutlass.cute.runtime import make_fake_tensor
    return make_fake_tensor(dtype, tuple(cute.sym_int() for _ in range(rank)),
                            tuple(cute.sym_int64() for _ in range(rank - 1)) + (1,), assumed_align=ALIGN)


def compile_stage1(cfg: Sm90Config, *, keep_ptx: bool = False, warp_specialized: bool = False,
                   ctas_per_sm: int = 1):
    """Compile the kernel for ``cfg``: v0, or v1 (``warp_specialized``: TMA producer and two consumer
    warpgroups; ``ctas_per_sm`` of them resident, 1 or 2, :data:`~foscar.cute.config.WS_REGISTERS`). The
    function is compiled for TVM-FFI (apache-tvm-ffi): it takes torch tensors as they are
    (:data:`~foscar.cute.config.STAGE1_TENSORS`, checked against the placeholders' dtypes, ranks, unit
    strides and alignment by the call itself), then ``qk_scale`` (float) and ``num_splits`` (int), and
    launches on torch's current stream (CUDA graphs capture it). Host time of a call: a few microseconds,
    where wrapping each tensor with ``from_dlpack`` took tens. ``keep_ptx``: the PTX is the compiled
    function's ``__ptx__``; no file is left behind."""
    if ctas_per_sm not in WS_REGISTERS:
        raise ValueError(f"ctas_per_sm: expected one of {sorted(WS_REGISTERS)}, got {ctas_per_sm!r}")
    kernel = FoldDecodeSm90WS(cfg, ctas_per_sm) if warp_specialized else FoldDecodeSm90(cfg)
    args = [_placeholder(dtype, rank) for _, dtype, rank in STAGE1_TENSORS]
    stream = make_fake_stream(use_tvm_ffi_env_stream=True)
    if not keep_ptx:
        return cute.compile[(cute.EnableTVMFFI,)](kernel, *args, Float32(1.0), Int32(1), stream)
    with tempfile.TemporaryDirectory(prefix="foscar-cute-ptx-") as dump_dir:
        options = (cute.KeepPTX, cute.EnableTVMFFI, DumpDir(dump_dir))
        return cute.compile[options](kernel, *args, Float32(1.0), Int32(1), stream)
