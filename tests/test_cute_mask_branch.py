"""The scores' masks in a branch (``foscar.cute.config.MASK_BRANCH``, ``Sm90Config.mask_branch``): at 16 and 32
columns and in every step of several tokens, one tile a pass, only the tiles that reach the first limit (the
thread's least limit, or the length) select the masked scores and zero the V ``(s', z')`` of their rows past the
length, where every tile did both; with two tiles a pass (``PAIR_MASK_BRANCH``) the pass that reaches the length
does (:meth:`foscar.cute.warpgroup.TileKernel._mask_branch`, one mechanism for both). CPU: which configurations
take it, and that one token at 8 columns compiles to the same PTX with the switch on. GPU (sm_90): GQA 16 and 32
and steps of 2, 4 and 8 tokens (8, 16 and 32 columns) (lengths that end mid-tile, splits whose last tile reaches a
limit, BF16 windows), and two tiles a pass at GQA 1-4 on every axis pair (lengths that end mid-tile and mid-pass, a
pass without its second tile) against the float64 oracle."""
import os

import pytest

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")  # compile for Hopper without a GPU
pytest.importorskip("cutlass", reason="needs nvidia-cutlass-dsl (pip install -e '.[test]')")

import foscar  # noqa: E402
from _cases import HOPPER  # noqa: E402
from _helpers import cute_switches  # noqa: E402
from foscar.cute.compile import compile_stage1  # noqa: E402
from foscar.cute.config import config_for  # noqa: E402

FMT = foscar.KVFormat(bits=2, head_dim=128, group_size=128)


@pytest.mark.parametrize("gqa,step,tiles,taken", [
    (4, 1, 2, False), (8, 1, 1, False), (16, 1, 1, True), (32, 1, 1, True), (4, 4, 1, True), (4, 8, 1, True),
    (2, 4, 1, True), (4, 2, 1, True)])
def test_the_branch_is_taken_at_16_and_32_columns_and_in_steps(monkeypatch, gqa, step, tiles, taken):
    with cute_switches(monkeypatch, MASK_BRANCH=False, PAIR_MASK_BRANCH=False):
        assert not config_for(FMT, gqa, 64, "e4m3", tiles, step).mask_branch
    with cute_switches(monkeypatch, MASK_BRANCH=True, PAIR_MASK_BRANCH=False):
        assert config_for(FMT, gqa, 64, "e4m3", tiles, step).mask_branch is taken


@pytest.mark.parametrize("gqa,tiles,taken", [(4, 2, True), (1, 2, True), (4, 1, False), (8, 1, False)])
def test_two_tiles_a_pass_take_it_with_their_switch(monkeypatch, gqa, tiles, taken):
    with cute_switches(monkeypatch, MASK_BRANCH=False, PAIR_MASK_BRANCH=True):
        assert config_for(FMT, gqa, 64, "e4m3", tiles).mask_branch is taken


def test_two_tiles_a_pass_keep_the_selects_in_a_branch(monkeypatch):
    """The PTX of two tiles a pass (INT2, GQA 4, E4M3 K) with the switch: the same ``-inf`` selects and one more
    branch."""
    ptx = []
    for on in (False, True):
        with cute_switches(monkeypatch, PAIR_MASK_BRANCH=on):
            cfg = config_for(FMT, 4, 64, "e4m3", 2)
            ptx.append(compile_stage1(cfg, keep_ptx=True, warp_specialized=True, ctas_per_sm=2).__ptx__)
    assert ptx[1].count("0fFF800000") == ptx[0].count("0fFF800000")
    assert ptx[1].count("bra") > ptx[0].count("bra")


def test_one_token_at_eight_columns_is_the_kernel_without_the_switch(monkeypatch):
    off = config_for(FMT, 8, 64, "e4m3", 1)
    with cute_switches(monkeypatch, MASK_BRANCH=True):
        assert config_for(FMT, 8, 64, "e4m3", 1) == off


@pytest.mark.parametrize("gqa,step,ctas", [(32, 1, 1), (4, 4, 2), (4, 8, 1), (4, 2, 2)])
def test_the_masks_sit_in_a_branch(monkeypatch, gqa, step, ctas):
    """The PTX of 16 and 32 columns and of a step of 2 tokens at 8 with the switch: the same ``-inf`` selects, one more branch (taken by the tiles
    that reach no limit)."""
    ptx = []
    for on in (False, True):
        with cute_switches(monkeypatch, MASK_BRANCH=on):
            cfg = config_for(FMT, gqa, 64, "e4m3", 1, step)
            ptx.append(compile_stage1(cfg, keep_ptx=True, warp_specialized=True, ctas_per_sm=ctas).__ptx__)
    neg_inf = [p.count("0fFF800000") for p in ptx]
    branches = [p.count("bra") for p in ptx]
    assert neg_inf[1] == neg_inf[0] and branches[1] > branches[0]


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU (H100/H200)")
@pytest.mark.parametrize("bits", (2, 4))
@pytest.mark.parametrize("gqa,lens,num_splits,fmt_kw", [
    (16, [8192, 700, 1], 16, {}), (32, [4097, 63, 130], 5, {}), (32, [3000, 5], None, {"sink": 4, "recent": 100}),
    (16, [1000, 64], 3, {"head_dim": 64, "group_size": 64})])
def test_heads_with_the_masks_in_a_branch_against_the_oracle_gpu(monkeypatch, bits, gqa, lens, num_splits, fmt_kw):
    from _cases import cute_against_the_oracle
    fmt = foscar.KVFormat(bits=bits, **{"head_dim": 128, "group_size": 128, **fmt_kw})
    with cute_switches(monkeypatch, MASK_BRANCH=True):
        cute_against_the_oracle(fmt, lens, gqa, f"GQA {gqa}, masks in a branch: error", num_splits=num_splits,
                                   warp_specialized=True, k_operand="e4m3", tiles_per_pass=1)


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU (H100/H200)")
@pytest.mark.parametrize("bits", (2, 4))
@pytest.mark.parametrize("G,T,num_splits", [(4, 4, None), (4, 8, None), (4, 4, 64), (8, 4, 5), (4, 2, None),
                                            (4, 2, 64), (2, 4, 5)])
def test_steps_with_the_masks_in_a_branch_against_the_oracle_gpu(monkeypatch, bits, G, T, num_splits):
    from _cases import cute_step_against_the_oracle
    with cute_switches(monkeypatch, MASK_BRANCH=True):
        cute_step_against_the_oracle(bits, G, T, num_splits, {})


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU (H100/H200)")
@pytest.mark.parametrize("kw,G,T", [(dict(bits=2, group_size=128, sink=4, recent=16, rollback=8), 4, 4),
                                    (dict(bits=4, group_size=128, k_axis="channel", rollback=8), 4, 8)])
def test_windowed_steps_with_the_masks_in_a_branch_against_the_oracle_gpu(monkeypatch, kw, G, T):
    from _cases import check_windowed_step
    with cute_switches(monkeypatch, MASK_BRANCH=True):
        check_windowed_step(kw, 128, G, T, "cute")


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU (H100/H200)")
@pytest.mark.parametrize("bits", (2, 4))
@pytest.mark.parametrize("gqa,lens,num_splits,axes", [
    (4, [8192, 700, 1], 16, ("token", "token")), (4, [4097, 63, 130], 5, ("token", "token")),
    (2, [3000, 190, 5], None, ("token", "token")), (1, [1000, 64, 129], 3, ("token", "token")),
    (4, [4097, 63, 130], 5, ("channel", "token")), (4, [2000, 190, 5], 3, ("token", "channel")),
    (3, [1500, 129], None, ("channel", "channel"))])
def test_two_tiles_a_pass_with_the_masks_in_a_branch_against_the_oracle_gpu(monkeypatch, bits, gqa, lens,
                                                                           num_splits, axes):
    from _cases import cute_against_the_oracle
    fmt = foscar.KVFormat(bits=bits, head_dim=128, group_size=128, k_axis=axes[0], v_axis=axes[1])
    with cute_switches(monkeypatch, PAIR_MASK_BRANCH=True):
        cute_against_the_oracle(fmt, lens, gqa, f"GQA {gqa} {axes}, two tiles a pass, masks in a branch: error",
                                num_splits=num_splits, warp_specialized=True, k_operand="e4m3", tiles_per_pass=2)
