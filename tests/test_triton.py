"""The Triton kernels against the float64 oracle.

On a CPU-only machine they run under TRITON_INTERPRET=1 (set by conftest) at small shapes: the
interpreter keeps the operands in float32 (its bf16 dot and casts are wrong, see
../shared/docs/triton-notes.md), so the kernel is held to the fold's float32 bound, 1e-5. On a GPU
the same cases run compiled, with BF16/FP16 operands, held to BF16 attention's error; the
paper-shape cases run there only.
"""
import itertools

import pytest
import torch
from _cases import DEV, GPU, make, run_and_check
from _helpers import V_MAGNITUDES, rel

import foscar
import foscar.triton as ft
from foscar.errors import InvalidArgumentError, UnsupportedError

AXES = ("token", "channel")


@pytest.mark.parametrize("bits,k_axis,v_axis", list(itertools.product((2, 4), AXES, AXES)))
def test_every_axis_combination(bits, k_axis, v_axis):
    """g = 32 < D exercises the group-local partials (token-wise) and 32-token groups (channel-wise);
    lengths end mid-group, mid-page and mid-tile; one sequence has length 1; pages shuffled."""
    fmt = foscar.KVFormat(bits=bits, head_dim=64, group_size=32, k_axis=k_axis, v_axis=v_axis)
    q, cache = make(fmt, [1, 77, 161], Hkv=2, G=4, page=64, seed=bits)
    run_and_check(q, cache, num_splits=3)


@pytest.mark.parametrize("bits,k_axis,v_axis", [(2, "token", "token"), (4, "channel", "token"),
                                                (2, "channel", "channel"), (4, "token", "channel")])
def test_windows_contiguous_and_gqa(bits, k_axis, v_axis):
    """BF16 sink and recent ring (merged by the combine), a contiguous cache, g = head dim, GQA 8."""
    fmt = foscar.KVFormat(bits=bits, head_dim=64, group_size=64, k_axis=k_axis, v_axis=v_axis, sink=4, recent=9)
    q, cache = make(fmt, [3, 70, 150], Hkv=1, G=8)
    run_and_check(q, cache, num_splits=2)


@pytest.mark.parametrize("k_axis,v_axis,windows,fused", [
    ("token", "token", False, True), ("channel", "token", False, False), ("token", "channel", True, True),
    ("channel", "channel", True, False)])
def test_a_rotated_cache_is_rotated_in_the_kernels(k_axis, v_axis, windows, fused):
    """A rotated cache (seeded signs) given the query as it is: stage 1 rotates it as it loads it, the split
    merge (in the epilogue, or its own kernel) rotates the output back; the BF16 windows take the query
    rotated too. The oracle decodes the unrotated values. The query is one whose rotation is BF16, so that
    the kernels' BF16 query operand rounds nothing away: the float32 bound holds under the interpreter."""
    from foscar.rotation import rotate
    fmt = foscar.KVFormat(bits=2, head_dim=64, group_size=32, k_axis=k_axis, v_axis=v_axis, rotation="hadamard",
                          rotation_seed=3, **({"sink": 4, "recent": 9} if windows else {}))
    q, cache = make(fmt, [1, 77, 161], Hkv=2, G=4, page=64, seed=5)
    q = rotate(rotate(q.double(), fmt).to(torch.bfloat16).double(), fmt, inverse=True).to(q.dtype if GPU else
                                                                                             torch.float32)
    run_and_check(q, cache, num_splits=3, fused_combine=fused)


@pytest.mark.parametrize("v_axis", ("token", "channel"))
@pytest.mark.parametrize("magnitude", V_MAGNITUDES)
def test_values_of_any_magnitude(magnitude, v_axis):
    """V of any FP32 magnitude the library takes, and constant V groups with an offset (scales 0) before
    tiny ones: the FP16 P' keeps its precision (its units follow the scales down) and the offset
    corrections stay finite."""
    from _helpers import magnitude_cache
    fmt = foscar.KVFormat(bits=2, head_dim=64, group_size=64, v_axis=v_axis)
    q, cache = magnitude_cache(fmt, magnitude, DEV)
    run_and_check(q, cache, num_splits=2, tol=2e-5)  # the interpreter: 700 tokens summed in float32, ~1e-5


@pytest.mark.parametrize("prefetch,fused", [(2, True), (1, False), (2, False)])
@pytest.mark.parametrize("k_axis,v_axis", [("token", "token"), ("channel", "token"), ("token", "channel")])
def test_prefetch_depth_and_merge_placement(prefetch, fused, k_axis, v_axis):
    """Two tiles in flight, and the split merge as a kernel of its own (the defaults, one tile and the
    merge in stage 1's epilogue, run everywhere else); with windows, so the merge takes their partials."""
    fmt = foscar.KVFormat(bits=4, head_dim=64, group_size=32, k_axis=k_axis, v_axis=v_axis, sink=2, recent=5)
    q, cache = make(fmt, [1, 77, 230], Hkv=2, G=4, page=32, seed=11)
    run_and_check(q, cache, num_splits=3, prefetch=prefetch, fused_combine=fused)


def test_fused_merge_counters_reset_and_workspace_checked():
    """The fused merge's counters are left at zero (so a CUDA-graph replay finds them so), and a
    workspace of the wrong kind is refused by name."""
    fmt = foscar.KVFormat(bits=2, head_dim=64, group_size=64, recent=3)
    q, cache = make(fmt, [50, 130, 7], Hkv=2, G=2, page=32, seed=2)
    ws = foscar.splitkv.new_workspace(3, 4, 2, 4 + 1, 64, q.device)
    ws[0].fill_(float("nan"))
    first = ft.decode(q, cache, num_splits=4, workspace=ws)
    assert int(ws[2].abs().sum()) == 0
    again = ft.decode(q, cache, num_splits=4, workspace=ws)
    assert torch.equal(first, again)
    with pytest.raises(InvalidArgumentError, match="workspace"):
        ft.decode(q, cache, num_splits=4, workspace=ws[:2])
    with pytest.raises(InvalidArgumentError, match=r"workspace\[2\]"):
        ft.decode(q, cache, num_splits=4, workspace=(ws[0], ws[1], ws[2][:-1]))


@pytest.mark.parametrize("D,G,page", [(128, 1, 32), (256, 2, 16), (128, 32, 48)])
def test_head_dims_gqa_pages(D, G, page):
    fmt = foscar.KVFormat(bits=4, head_dim=D, group_size=64, k_axis="token", v_axis="token")
    q, cache = make(fmt, [40, 97], Hkv=1, G=G, page=page)
    run_and_check(q, cache, num_splits=2)


@pytest.mark.parametrize("bits", (2, 4))
def test_reconstruction_kernel(bits):
    fmt = foscar.KVFormat(bits=bits, head_dim=64, group_size=32, k_axis="token", v_axis="channel")
    q, cache = make(fmt, [64, 100], Hkv=2, G=2, page=32)
    run_and_check(q, cache, kernel="reconstruct", num_splits=2)


@pytest.mark.parametrize("k_axis,v_axis", [("token", "token"), ("channel", "channel")])
def test_long_split_does_not_drift(k_axis, v_axis):
    """128 tiles in one split: an offset correction kept apart from the accumulator until the end of
    the split cancels a sum that grows with the length (measured: 5e-5 at 8K tokens, 2e-4 at 32K)."""
    fmt = foscar.KVFormat(bits=4, head_dim=128, group_size=128, k_axis=k_axis, v_axis=v_axis)
    q, cache = make(fmt, [8192], Hkv=1, G=4, page=64, seed=5)
    # float32 under the interpreter: 1.0e-5 here (the output shrinks like 1/sqrt(L) on random data,
    # 10x from 64 to 8K tokens); the drifting kernel gave 1.1e-4
    run_and_check(q, cache, num_splits=1, tol=3e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("bits", (2, 4))
def test_long_split_gpu(bits):
    """1024 tiles in one split, 64K tokens."""
    fmt = foscar.KVFormat(bits=bits, head_dim=128, group_size=128)
    q, cache = make(fmt, [65536, 3], Hkv=2, G=4, page=64, seed=9)
    run_and_check(q, cache, num_splits=1, sdpa=True)


def test_empty_sequence_and_more_splits_than_tiles():
    fmt = foscar.KVFormat(bits=4, head_dim=64, group_size=64)
    q, cache = make(fmt, [0, 20], Hkv=1, G=2, page=16)
    out, lse = ft.decode(q, cache, num_splits=5, return_lse=True)
    assert torch.equal(out[0].float(), torch.zeros_like(out[0].float())) and bool(torch.isneginf(lse[0]).all())
    exact = foscar.decode_exact(q, cache)
    assert rel(out[1], exact[1]) < 1e-2


def test_bf16_decode_kernel():
    gen = torch.Generator().manual_seed(3)
    P, Hkv, page, D, G = 6, 2, 16, 64, 4
    kc = torch.randn(P, Hkv, page, D, generator=gen).bfloat16().to(DEV)
    vc = torch.randn(P, Hkv, page, D, generator=gen).bfloat16().to(DEV)
    bt = torch.tensor([[5, 1, 3], [0, 2, 4]], dtype=torch.int32, device=DEV)
    lens = torch.tensor([40, 17], dtype=torch.int32, device=DEV)
    q = torch.randn(2, Hkv * G, D, generator=gen).bfloat16().to(DEV)
    out = ft.decode_bf16(q, kc, vc, bt, lens, num_splits=2, block_n=16)
    for b in range(2):
        L = int(lens[b])
        k = kc[bt[b].long()].permute(1, 0, 2, 3).reshape(Hkv, -1, D)[:, :L].double()
        v = vc[bt[b].long()].permute(1, 0, 2, 3).reshape(Hkv, -1, D)[:, :L].double()
        ref, _ = foscar.reference.attend(q[b].double().reshape(Hkv, G, D), k, v, D ** -0.5)
        assert rel(out[b], ref.reshape(-1, D)) < 1e-2


def test_triton_rejects_what_it_cannot_run():
    fmt = foscar.KVFormat(bits=4, head_dim=64, group_size=64, mapping="e4m3")
    q, cache = make(fmt, [20], Hkv=1, G=1)
    with pytest.raises(UnsupportedError, match="mapping='e4m3'"):
        ft.decode(q, cache)
    fmt = foscar.KVFormat(bits=4, head_dim=64, group_size=64)
    q, cache = make(fmt, [20], Hkv=1, G=1)
    with pytest.raises(InvalidArgumentError, match="^kernel: expected"):
        ft.decode(q, cache, kernel="fast")
    with pytest.raises(InvalidArgumentError, match="^out: expected"):
        ft.decode(q, cache, out=torch.empty(1, 2, 64, device=q.device))
    with pytest.raises(InvalidArgumentError, match="^block_n: expected"):
        ft.decode(q, cache, block_n=48)
    with pytest.raises(InvalidArgumentError, match="^num_splits: expected"):
        ft.decode(q, cache, num_splits=0)


def test_tile_where_ptxas_loses_the_pv_operand_base(monkeypatch):
    """Channel-wise K from 9 rows a program (wgmma products): 32-token tiles under ptxas before 12.9, 64 under 12.9
    and for token-wise K or 8 rows; a step's rows count, and a tile the caller names stands."""
    from foscar.triton import launch
    monkeypatch.setattr(launch, "interpreting", lambda: False)
    fmt = foscar.KVFormat(bits=4, head_dim=64, group_size=64, k_axis="channel")
    token_k = foscar.KVFormat(bits=4, head_dim=64, group_size=64)
    for release, tile in (((12, 9), 64), ((12, 8), 32)):  # 12.8 stands for the launches below
        monkeypatch.setattr(launch, "_ptxas_release", lambda release=release: release)
        assert launch.block_n_for(fmt, 64, 16) == tile
        assert launch.block_n_for(fmt, 64, 8) == launch.block_n_for(token_k, 64, 16) == 64
    q, cache = make(fmt, [200], Hkv=1, G=4, page=64)
    assert launch.launch_config(q, cache, 4, step=4, use_tuned=False).block_n == 32
    assert launch.launch_config(q, cache, 4, use_tuned=False).block_n == 64
    assert launch.launch_config(q, cache, 4, step=4, block_n=64, use_tuned=False).block_n == 64


@pytest.mark.gpu
@pytest.mark.parametrize("bits,k_axis,v_axis", list(itertools.product((2, 4), AXES, AXES)))
def test_paper_shape_gpu(bits, k_axis, v_axis):
    """The paper's shape: Hq = 32, Hkv = 8, D = 128, g = 128, page 64; mixed lengths up to 8K."""
    fmt = foscar.KVFormat(bits=bits, head_dim=128, group_size=128, k_axis=k_axis, v_axis=v_axis)
    q, cache = make(fmt, [8192, 4001, 129, 1], Hkv=8, G=4, page=64, seed=7)
    run_and_check(q, cache, sdpa=True)
    run_and_check(q, cache, num_splits=1, sdpa=True)
    run_and_check(q, cache, sdpa=True, prefetch=2)
    run_and_check(q, cache, sdpa=True, fused_combine=False)


@pytest.mark.gpu
@pytest.mark.parametrize("bits,k_axis,v_axis,D,g,G,page", [
    (2, "channel", "token", 128, 64, 1, 128), (4, "token", "channel", 256, 128, 8, 64),
    (2, "token", "token", 64, 32, 32, 32), (4, "channel", "channel", 128, 256, 4, 64)])
def test_odd_shapes_gpu(bits, k_axis, v_axis, D, g, G, page):
    fmt = foscar.KVFormat(bits=bits, head_dim=D, group_size=g, k_axis=k_axis, v_axis=v_axis, sink=4, recent=100)
    q, cache = make(fmt, [3000, 1, 517, 64 * 7 + 5], Hkv=2, G=G, page=page, seed=11)
    run_and_check(q, cache, sdpa=True)
    run_and_check(q, cache, sdpa=True, prefetch=2)
    run_and_check(q, cache, kernel="reconstruct", sdpa=True)
