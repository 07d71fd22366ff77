"""V^T's extra m64 block: sums of ``P'`` by column by the tensor core, beside the PV product, its A operand a
constant in registers and its B the pass's ``P'`` (the same descriptors).

- Token-wise V's pivot sums (``Sm90Config.pivot_mma``, :data:`~foscar.cute.config.PIVOT_MMA_COLS`): token-wise V's
  offset correction of an element is ``P mid - c_h sigma P'`` (:func:`~foscar.cute.folds.gather_offset_corrections`;
  ``c_h`` the pivot of the token's half, ``P'`` the consumed FP16 operand). With the pivot sums the gather keeps
  ``P mid``, and the block, whose row 0 holds each token's ``c_h`` (:func:`pivot_a_operand`), takes ``sum_t c_h P'``
  of each column into an accumulator of its own (``OutputAccumulator.pivot``): the same sum of the same consumed
  ``P'``, where each element widened its ``P'`` and took an FMA. The accumulator is scaled as the output is on a
  rescale and joins the gathered corrections once, at the split's end (:func:`pivot_corrections`).
- Channel-wise V's column sums (``Sm90Config.column_sum_mma``, :data:`~foscar.cute.config.COLUMN_SUM_MMA_COLS`): the
  acc-fold's offset term is ``z'`` times the sum of the pass's ``P`` as consumed (``P~ / v_factors[h]``,
  :func:`~foscar.cute.folds.p_tilde`) by column. The block's rows all hold ``1 / v_factors[h]`` (rows + 8 half of it,
  :func:`column_sum_a_operand`), so every thread's C elements of row ``row0`` are the sums of its own columns: no
  shuffles, no exchange through shared memory, where the warps' sums were gathered.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float16, Uint32

from .fragment import slot_elements
from .wgmma import mma_rs_into, p_descriptor, tiled_pv_mma


def pivot_corrections(out):
    """The pivot sums (``out.pivot``'s row 0: ``sum_t c_h P'`` of each column, in units of ``sigma``) into the
    gathered corrections of each thread's column slots (:func:`~foscar.cute.softmax.column_sums` then sums them by
    column), once, at the split's end: row 0 is warp 0's lanes 0-3, whose column slots are its columns, and the
    rows other threads hold are zeros. (Read by every thread and never reset inside the tile loop: an accumulator
    written in a branch there makes ptxas serialize every wgmma of the kernel.)"""
    c = out.corr[0]
    for k in range(cute.size(c)):
        c[k] = c[k] - out.sigma[0] * out.pivot[slot_elements(k)[0]]


def sum_a_operand(cfg, tidx):
    """The A registers of V^T's extra m64 block: the pivot sums' or the column sums' (None: no such block)."""
    if cfg.pivot_mma:
        return pivot_a_operand(cfg, tidx)
    return column_sum_a_operand(cfg) if cfg.column_sum_mma else None


def a_fragment() -> cute.Tensor:
    """An m64 block's A registers for one k16 step: the ``((2, 2, 2))`` FP16 fragment (element bit 1: row + 8, bit 2:
    k + 8, the token half; register ``j`` elements ``2 j``, ``2 j + 1``), the same for every k16 block."""
    return cute.make_rmem_tensor(cute.make_layout(((2, 2, 2), 1), stride=((1, 2, 4), 8)), Float16)


@cute.jit
def pivot_a_operand(cfg, tidx) -> cute.Tensor:
    """Row 0 holds each token's pivot ``c_h`` (its token half ``h``: the upper 8 of each k16 block), row 8 half of
    it, every other row 0. Rows 0 and 8 are warp 0's lanes 0-3: elements 0, 1 (row 0, half 0), 4, 5 (row 0, half
    1), 2, 3 and 6, 7 (row 8). Row 8's sums are not read: its values keep the four registers distinct, where two
    copies of one register in a wgmma's A make ptxas serialize every wgmma of the kernel
    (``benchmarks/ptxas_info.py``)."""
    a = a_fragment()
    a.fill(0.0)
    if tidx < 4:  # warp 0, lanes 0-3
        for i in cutlass.range_constexpr(2):
            a[i] = Float16(cfg.v_pivots[0])
            a[4 + i] = Float16(cfg.v_pivots[1])
            a[2 + i] = Float16(cfg.v_pivots[0] / 2)
            a[6 + i] = Float16(cfg.v_pivots[1] / 2)
    return a


def column_sum_values(cfg) -> tuple[float, float, float, float]:
    """The column sums' A value of each register (row ``row0``, ``row0 + 8``; token half 0, then half 1): ``1 /
    v_factors[h]`` and half of it, four distinct values (the halves' factors differ: ``config_for``), so that four
    registers hold them (two copies of one register in a wgmma's A serialize every wgmma of the kernel)."""
    f = cfg.v_factors
    values = (1.0 / f[0], 0.5 / f[0], 1.0 / f[1], 0.5 / f[1])
    assert len(set(values)) == 4, f"the column sums take token halves of unequal factors, not {f}"
    return values


def column_sum_element(cfg, i: int) -> float:
    """The column sums' A value of fragment element ``i`` (:func:`a_fragment`: bit 1 row + 8, bit 2 token half 1)."""
    return column_sum_values(cfg)[((i >> 1) & 1) + 2 * ((i >> 2) & 1)]


@cute.jit
def column_sum_a_operand(cfg) -> cute.Tensor:
    """Every row ``1 / v_factors[h]`` (rows + 8 half of it, :func:`column_sum_element`), every thread the same."""
    a = a_fragment()
    for i in cutlass.range_constexpr(8):
        a[i] = Float16(column_sum_element(cfg, i))
    return a


@cute.jit
def sum_mma(cfg, wg, acc: cute.Tensor, kb, kb0, overwrite: cutlass.Constexpr = False):
    """One k16 step of V^T's extra m64 block into ``acc`` (its C fragment): ``acc (+)= A P'^T`` with A
    ``wg.frags.sum_a`` and ``P'``'s k-block ``kb0 + kb`` (``overwrite``: the accumulator's first step), by the
    kernel's own wgmma where the warpgroup holds the descriptors (:func:`~foscar.cute.wgmma.pv_mma`'s), else by the
    tiled MMA."""
    a = wg.frags.sum_a
    if cutlass.const_expr(wg.descs is not None):
        desc = p_descriptor(cfg, wg, kb, kb0)
        mma_rs_into("k16.f32.f16.f16", acc, cute.recast_tensor(a, Uint32), desc, not overwrite, cfg.p_column_major)
    else:
        tiled_pv_mma(cfg, wg, acc, a, wg.frags.tOrP[0][None, None, kb0 + kb], overwrite)
