"""Hopper (sm_90a) split-KV decode stage 1 in CuTe DSL: the names the rest of foscar imports.

Every K/V axis combination with groups of ``g`` = 64 or 128 (a multiple of the 64-token tile; for a
token-wise axis, ``g`` channels dividing the head dim: one or two channel groups per token); INT2/INT4,
head dim 64/128 (256: token-wise K, g 128/256, up to 8 query rows), up to 32 query rows per KV head (its query heads times a step's tokens: the wgmma N, 8,
16 or 32 columns, ``Sm90Config.cols``), paged caches. Per 64-token KV tile, a computing
warpgroup (:class:`~foscar.cute.warpgroup.TileKernel`, shared by both kernels):

- builds K's A registers from the packed words (:mod:`foscar.cute.operands`, at the positions of
  :mod:`foscar.cute.fragment`) and computes ``S^T = K Q^T`` on ``wgmma.m64nNk16``, Q^T (rows padded to
  N) in shared memory;
- applies K's fold (:mod:`foscar.cute.folds`): the acc-fold of token-wise K, or the operand-fold
  ``Q' = bf16(Q s')`` of channel-wise K with its offset correction;
- runs the online softmax, base 2 (:mod:`foscar.cute.softmax`);
- computes ``O^T = V^T P'^T`` with FP16 operands, V^T built in registers like K, with V's fold: the
  operand-fold ``P' = P s'_V / sigma`` of token-wise V and its offset correction, added to the accumulator
  every :data:`~foscar.cute.config.CORRECTION_TILES` tiles, or the acc-fold of channel-wise V;
- and writes the partial output and LSE in the layout :mod:`foscar.triton.combine` merges.

v0 (:class:`~foscar.cute.kernel_v0.FoldDecodeSm90`): one warpgroup per CTA with a register prefetch of the
next tile. v1 (:class:`~foscar.cute.kernel_v1.FoldDecodeSm90WS`): a TMA producer warpgroup and two consumer
warpgroups on alternating tiles. :func:`~foscar.cute.compile.compile_stage1` compiles either for TVM-FFI
calls; :mod:`foscar.cute.config` holds the static configuration. Measured in ``docs/results-h200.md``.
"""
from __future__ import annotations

from .compile import compile_stage1
from .config import (
                     ALIGN,
                     CONSUMERS,
                     CORRECTION_TILES,
                     HEADS,
                     STAGE1_TENSORS,
                     STAGES,
                     THREADS,
                     TILE,
                     WS_REGISTERS,
                     Sm90Config,
                     config_for,
)
from .kernel_v0 import FoldDecodeSm90
from .kernel_v1 import FoldDecodeSm90WS

__all__ = ["ALIGN", "CONSUMERS", "CORRECTION_TILES", "HEADS", "STAGE1_TENSORS", "STAGES", "THREADS", "TILE",
           "WS_REGISTERS", "FoldDecodeSm90", "FoldDecodeSm90WS", "Sm90Config", "compile_stage1", "config_for"]
