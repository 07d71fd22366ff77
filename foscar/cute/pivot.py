"""Token-wise V's pivot sums by the tensor core (``Sm90Config.pivot_mma``, :data:`~foscar.cute.config.PIVOT_MMA_COLS`).

Token-wise V's offset correction of an element is ``P mid - c_h sigma P'`` (:func:`~foscar.cute.folds.
gather_offset_corrections`; ``c_h`` the pivot of the token's half, ``P'`` the consumed FP16 operand). With the
pivot sums the gather keeps ``P mid``, and one more m64 block of V^T, whose row 0 holds each token's ``c_h``
(:func:`pivot_a_operand`), takes ``sum_t c_h P'`` of each column into an accumulator of its own
(``OutputAccumulator.pivot``) beside the PV product: the same sum of the same consumed ``P'``, where each element
widened its ``P'`` and took an FMA. The accumulator is scaled as the output is on a rescale and joins the gathered
corrections once, at the split's end (:func:`pivot_corrections`).
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float16

from .fragment import slot_elements


def pivot_corrections(out):
    """The pivot sums (``out.pivot``'s row 0: ``sum_t c_h P'`` of each column, in units of ``sigma``) into the
    gathered corrections of each thread's column slots (:func:`~foscar.cute.softmax.column_sums` then sums them by
    column), once, at the split's end: row 0 is warp 0's lanes 0-3, whose column slots are its columns, and the
    rows other threads hold are zeros. (Read by every thread and never reset inside the tile loop: an accumulator
    written in a branch there makes ptxas serialize every wgmma of the kernel.)"""
    c = out.corr[0]
    for k in range(cute.size(c)):
        c[k] = c[k] - out.sigma[0] * out.pivot[slot_elements(k)[0]]


@cute.jit
def pivot_a_operand(cfg, tidx) -> cute.Tensor:
    """The A registers of V^T's extra m64 block: row 0 holds each token's pivot ``c_h`` (its token half ``h``: the
    upper 8 of each k16 block), row 8 half of it, every other row 0; the same for every k16 block. Rows 0 and 8
    are warp 0's lanes 0-3: elements 0, 1 (row 0, half 0), 4, 5 (row 0, half 1), 2, 3 and 6, 7 (row 8) of the
    ``((2, 2, 2))`` fragment (element bit 1: row + 8, bit 2: k + 8). Row 8's sums are not read: its values keep
    the four registers distinct, where two copies of one register in a wgmma's A make ptxas serialize every wgmma
    of the kernel (``benchmarks/ptxas_info.py``)."""
    a = cute.make_rmem_tensor(cute.make_layout(((2, 2, 2), 1), stride=((1, 2, 4), 8)), Float16)
    a.fill(0.0)
    if tidx < 4:  # warp 0, lanes 0-3
        for i in cutlass.range_constexpr(2):
            a[i] = Float16(cfg.v_pivots[0])
            a[4 + i] = Float16(cfg.v_pivots[1])
            a[2 + i] = Float16(cfg.v_pivots[0] / 2)
            a[6 + i] = Float16(cfg.v_pivots[1] / 2)
    return a
