"""v1's TMA copies into its stage ring (:class:`~foscar.cute.kernel_v1.FoldDecodeSm90WS`): the TMA atoms of the
paged pools, built on the host side of the launch, and their partitions over the ring's stages, in the kernel."""
from __future__ import annotations

import cutlass.cute as cute
from cutlass.cute.nvgpu import cpasync

from .config import TILE
from .ring import StageRing


def tma_atoms(cfg, mKC: cute.Tensor, mVC: cute.Tensor, mKP: cute.Tensor, mVP: cute.Tensor) -> list:
    """The TMA (atom, tensor) pairs of the pools, by (tile in page, KV head, page): K words, V words (a tile's
    words as ``co`` boxes of ``ci <= 256``), then K and V ``(s', z')`` (a tile's rows; channel-wise: its token
    group's)."""
    chunk = cfg.tile_words
    ci, co = cfg.tma_box
    tpp = cfg.page // TILE
    words = cute.make_layout((ci, co), stride=(1, ci))
    atoms = []
    for m in (mKC, mVC):
        g = cute.make_tensor(m.iterator, cute.make_layout(
            (ci, co, tpp, cute.size(m, mode=[1]), cute.size(m, mode=[0])),
            stride=(1, ci, chunk, m.stride[1], m.stride[0])))
        atoms.append(cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), g, words, (ci, co)))
    for m, width, rows in ((mKP, cfg.k_param_words, cfg.k_param_rows), (mVP, cfg.v_param_words, cfg.v_param_rows)):
        g = cute.make_tensor(m.iterator, cute.make_layout(
            (width, rows, cute.size(m, mode=[1]), cute.size(m, mode=[0])),
            stride=(1, width, m.stride[1], m.stride[0])))
        atoms.append(cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), g, cute.make_layout(width),
                                                 (width,)))
    return atoms


def tma_views(cfg, tma: tuple, ring: StageRing):
    """The TMA partitions of the pools and of the ring's stages: ``(tKs, tKg, tVs, tVg, tKPs, tKPg, tVPs,
    tVPg)``, from ``tma``, the (atom, tensor) pairs of K words, V words, K and V ``(s', z')``."""
    ci, co = cfg.tma_box
    (atom_kc, tma_kc), (atom_vc, tma_vc), (atom_kp, tma_kp), (atom_vp, tma_vp) = tma
    gKC = cute.local_tile(tma_kc, (ci, co), (0, 0, None, None, None))
    gVC = cute.local_tile(tma_vc, (ci, co), (0, 0, None, None, None))
    gKP = cute.local_tile(tma_kp, (cfg.k_param_words,), (0, None, None, None))
    gVP = cute.local_tile(tma_vp, (cfg.v_param_words,), (0, None, None, None))
    one = cute.make_layout(1)
    tKs, tKg = cpasync.tma_partition(atom_kc, 0, one, ring.sK, cute.group_modes(gKC, 0, 2))
    tVs, tVg = cpasync.tma_partition(atom_vc, 0, one, ring.sV, cute.group_modes(gVC, 0, 2))
    tKPs, tKPg = cpasync.tma_partition(atom_kp, 0, one, ring.sKP, cute.group_modes(gKP, 0, 1))
    tVPs, tVPg = cpasync.tma_partition(atom_vp, 0, one, ring.sVP, cute.group_modes(gVP, 0, 1))
    return tKs, tKg, tVs, tVg, tKPs, tKPg, tVPs, tVPg
