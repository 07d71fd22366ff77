"""V^T's extra m64 block: sums of ``P'`` by column by the tensor core, beside the PV product, its A operand a
constant in registers and its B the pass's ``P'`` (the same descriptors).

- Token-wise V's pivot sums (``Sm90Config.pivot_mma``, :data:`~foscar.cute.config.PIVOT_MMA_COLS`): token-wise V's
  offset correction of an element is ``P mid - c_h sigma P'`` (:func:`~foscar.cute.folds.gather_offset_corrections`;
  ``c_h`` the pivot of the token's half, ``P'`` the consumed FP16 operand). With the pivot sums the gather keeps
  ``P mid``, and the block, whose rows hold each token's ``c_h`` (:func:`sum_values`), takes ``sum_t c_h P'``
  of each column into an accumulator of its own (``OutputAccumulator.pivot``): the same sum of the same consumed
  ``P'``, where each element widened its ``P'`` and took an FMA. The accumulator is scaled as the output is on a
  rescale and joins the gathered corrections once, at the split's end (:func:`pivot_corrections`).
- Channel-wise V's column sums (``Sm90Config.column_sum_mma``, :data:`~foscar.cute.config.COLUMN_SUM_MMA_COLS`): the
  acc-fold's offset term is ``z'`` times the sum of the pass's ``P`` as consumed (``P~ / v_factors[h]``,
  :func:`~foscar.cute.folds.p_tilde`) by column. The block's rows all hold ``1 / v_factors[h]`` (rows + 8 half of it,
  :func:`sum_values`), so every thread's C elements of row ``row0`` are the sums of its own columns: no
  shuffles, no exchange through shared memory, where the warps' sums were gathered.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float16, Float32, Uint32

from .fragment import slot_elements
from .ptx import f16_pair_word
from .wgmma import mma_rs_into, opaque, p_descriptor, tiled_pv_mma


def pivot_corrections(out, thr):
    """The pivot sums (``out.pivot``: ``sum_t c_h P'`` of each column in every row ``row0``, in units of ``sigma``)
    into the gathered corrections of each thread's column slots (:func:`~foscar.cute.softmax.column_sums` then sums
    them by column), once, at the split's end, by the threads of row 0 (warp 0's lanes 0-3, whose column slots are
    its columns; ``thr`` this thread); the other rows hold the same sums and add zero. (A factor, not a branch, and
    never reset inside the tile loop: an accumulator read or written in a branch makes ptxas serialize every wgmma
    of the kernel.)"""
    c = out.corr[0]
    w = out.sigma[0] * Float32(thr.tidx < 4)
    for k in range(cute.size(c)):
        c[k] = c[k] - w * out.pivot[slot_elements(k)[0]]


def sum_a_operand(cfg):
    """The A registers of V^T's extra m64 block (:func:`a_fragment`, written by :func:`set_sum_a` before each pass's
    MMAs): the pivot sums' or the column sums' (None: no such block)."""
    return a_fragment() if cfg.pivot_mma or cfg.column_sum_mma else None


@cute.jit
def set_sum_a(cfg, a: cute.Tensor):
    """The A registers ``a`` of V^T's extra m64 block (:func:`sum_values`, :func:`block_element`; every thread the
    same), each word a constant through :func:`~foscar.cute.wgmma.opaque`, in the pass, before its MMA group:
    constants LLVM would otherwise materialize inside the group, before each wgmma, where ptxas serializes every
    wgmma of the kernel; and kept across the loop in registers of their own, they cost more moves a tile than the
    four moves here."""
    words = cute.recast_tensor(a, Uint32)
    values = sum_values(cfg)
    for j in cutlass.range_constexpr(4):  # register j: elements 2 j and 2 j + 1, one value
        words[j] = opaque(Uint32(f16_pair_word(block_element(values, 2 * j))))


def a_fragment() -> cute.Tensor:
    """An m64 block's A registers for one k16 step: the ``((2, 2, 2))`` FP16 fragment (element bit 1: row + 8, bit 2:
    k + 8, the token half; register ``j`` elements ``2 j``, ``2 j + 1``), the same for every k16 block."""
    return cute.make_rmem_tensor(cute.make_layout(((2, 2, 2), 1), stride=((1, 2, 4), 8)), Float16)


def sum_values(cfg) -> tuple[float, float, float, float]:
    """The extra block's A value of each register (row ``row0``, ``row0 + 8``; token half 0, then half 1), in every
    row alike: a value ``x_h`` per token half and half of it. The pivot sums' ``x_h`` is the half's pivot ``c_h``,
    the column sums' ``1 / v_factors[h]``. Four distinct values (the halves' factors differ, ``config_for``; their
    pivots with V^T placed from bit 0), so that four registers hold them: two copies of one register in a wgmma's A
    serialize every wgmma of the kernel."""
    x = cfg.v_pivots if cfg.pivot_mma else tuple(1.0 / f for f in cfg.v_factors)
    values = (x[0], x[0] / 2, x[1], x[1] / 2)
    assert len(set(values)) == 4, f"V^T's extra block takes token halves of unequal values, not {x}"
    return values


def block_element(values: tuple, i: int) -> float:
    """The A value of fragment element ``i`` (:func:`a_fragment`: bit 1 row + 8, bit 2 token half 1) of
    :func:`sum_values`' ``values``."""
    return values[((i >> 1) & 1) + 2 * ((i >> 2) & 1)]


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
