"""Channel-wise V's column sums of ``P`` by the tensor core (``foscar.cute.config.COLUMN_SUM_MMA_COLS``: 8, 32
columns but on three consumers; ``Sm90Config.column_sum_mma``, :mod:`foscar.cute.pivot`): V^T's extra m64 block,
every row ``1 / v_factors[h]`` (rows + 8 half of it), multiplies the pass's ``P~`` beside the PV product, so each
thread's C elements of row ``row0`` are its columns' sums of ``P`` as consumed, where each warp's sums were gathered by
shuffles and through shared memory.

CPU: where the config takes it; the block's A values laid out as the wgmma's register fragment (PTX's ``m64nNk16``
A layout, independently of the kernel's indexing) sum ``P~`` to ``sum P`` in every row, exactly; fewer instructions a
tile; the kernels compile. GPU (sm_90): within float32 rounding of the warps' sums on the same cache; the oracle
cases, a step and V's magnitude cases are channel-wise V's (``tests/test_cute_channel_v_placement.py``, ``-k
column-sums``)."""
import os
import sys
from pathlib import Path

import pytest
import torch

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")  # compile for Hopper without a GPU
pytest.importorskip("cutlass", reason="needs nvidia-cutlass-dsl (pip install -e '.[test]')")

import foscar  # noqa: E402
from _cases import HOPPER, make  # noqa: E402
from _helpers import cute_switches, rel  # noqa: E402

ON, WARPS = {"COLUMN_SUM_MMA_COLS": (8, 16, 32)}, {"COLUMN_SUM_MMA_COLS": ()}  # every column count; the warps' sums


def _config(monkeypatch, switches: dict, fmt, gqa: int = 4, tiles: int = 2, k_operand: str = "e4m3"):
    from foscar.cute.config import config_for
    with cute_switches(monkeypatch, **switches):
        return config_for(fmt, gqa, 64, k_operand, tiles)


@pytest.mark.parametrize("bits", (2, 4))
def test_the_config_takes_it_for_channel_wise_v_placed(monkeypatch, bits):
    channel = foscar.KVFormat(bits=bits, head_dim=128, group_size=128, v_axis="channel")
    token = foscar.KVFormat(bits=bits, head_dim=128, group_size=128)
    assert _config(monkeypatch, {}, channel).column_sum_mma  # 8 columns, as shipped
    assert not _config(monkeypatch, {}, channel, 16, 1).column_sum_mma  # 16 columns: not shipped (two CTAs spill)
    assert _config(monkeypatch, ON, channel, 16, 1).column_sum_mma
    assert not _config(monkeypatch, WARPS, channel).column_sum_mma
    with cute_switches(monkeypatch, **ON):  # a step of 8 on three consumers: their 160 registers spill more with it
        from foscar.cute.config import config_for
        step = config_for(channel, 4, 64, "e4m3", 1, 8)
        assert step.wide and not step.column_sum_mma
    assert not _config(monkeypatch, ON, token).column_sum_mma
    # injected V^T: both halves' factors 1, whose four A registers could not differ
    assert not _config(monkeypatch, {**ON, "V_CHANNEL_PLACEMENT": False}, channel).column_sum_mma


@pytest.mark.parametrize("bits", (2, 4))
@pytest.mark.parametrize("head_dim", (64, 128, 256))
def test_the_blocks_rows_sum_p_as_consumed(monkeypatch, bits, head_dim):
    """Each k16 block of a pass: A (64 rows x 16 tokens) at each thread's fragment positions
    (``_helpers.block_a_matrix``), times ``P~ = fp16(P v_factors[h])`` (FP16, as the B operand): every row
    ``row0`` the sum of ``P~ / v_factors[h]`` (``P`` as consumed) exactly, rows ``+ 8`` half of it; four distinct
    register values."""
    from _helpers import block_a_matrix
    from foscar.cute.pivot import sum_values
    fmt = foscar.KVFormat(bits=bits, head_dim=head_dim, group_size=min(head_dim, 128), v_axis="channel")
    cfg = _config(monkeypatch, ON, fmt, 2, 1, "bf16")
    assert cfg.column_sum_mma and len(set(sum_values(cfg))) == 4
    A = block_a_matrix(cfg)
    gen = torch.Generator().manual_seed(bits * 7 + head_dim)
    f = torch.tensor(cfg.v_factors, dtype=torch.float64)[(torch.arange(16) >= 8).long()]  # token half of a k16 block
    for p in (torch.rand(16, 8, generator=gen, dtype=torch.float64) * 256, torch.full((16, 8), 2.0 ** -20)):
        pt = (p * f[:, None]).to(torch.float16).double()  # P~, the B operand
        got = A @ pt  # [64 rows, 8 columns]
        want = (pt / f[:, None]).sum(0)
        row = torch.arange(64) % 16 < 8
        assert torch.equal(got[row], want.expand(int(row.sum()), 8))
        assert torch.equal(got[~row], (want / 2).expand(int((~row).sum()), 8))


def _full_tile(monkeypatch, switches, args):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import sass_stats_cute as ss
    a = ss.kernel_parser("").parse_args(args)
    with cute_switches(monkeypatch, **switches):
        cfg, sass = ss.kernel_sass(a)
    return ss.full_tile(sass, cfg.p_tiles), ss.local_memory(sass)


@pytest.mark.parametrize("args,fewer", [
    (["--k-operand", "e4m3", "--tiles-per-pass", "2"], 12),
    (["--k-operand", "e4m3", "--tiles-per-pass", "2", "--k-axis", "channel"], 12),
    (["--k-operand", "e4m3", "--gqa", "32", "--ctas", "1"], 60)], ids=("token-k", "channel-k", "gqa32"))
def test_fewer_instructions_a_tile(monkeypatch, args, fewer):
    """INT2, channel-wise V (``benchmarks/sass_stats_cute.py``'s count of a full tile): fewer instructions, no more
    local memory."""
    args = ["--bits", "2", "--v-axis", "channel", *args]
    (n0, l0), (n1, l1) = (_full_tile(monkeypatch, s, args) for s in (WARPS, ON))
    print(f"\n{' '.join(args)}: warps' sums {n0:g} -> the tensor core's {n1:g} instructions a full tile")
    assert n1 <= n0 - fewer and l1 <= l0


@pytest.mark.parametrize("bits,gqa,tiles,ctas,copies", [(2, 4, 2, 2, 1), (4, 4, 2, 2, 1), (2, 32, 1, 1, 2)])
def test_the_blocks_wgmma_take_the_factors(monkeypatch, bits, gqa, tiles, ctas, copies):
    """In the compiled kernel as shipped (two tiles a pass at 8 columns; GQA 32, each consumer its own copy of the
    code) every MMA of the extra block takes A registers holding ``(1 / f_0, 1 / (2 f_0), 1 / f_1, 1 / (2 f_1))``
    (``f_h = v_factors[h]``), both halves of each register: four a tile, a pass's two tiles' included."""
    from _helpers import constant_a_operands
    from foscar.cute.pivot import sum_values
    fmt = foscar.KVFormat(bits=bits, head_dim=128, group_size=128, v_axis="channel")
    cfg = _config(monkeypatch, {}, fmt, gqa, tiles)
    assert cfg.column_sum_mma
    found = constant_a_operands(cfg, ctas)
    assert found and all(a == list(sum_values(cfg)) for a in found), found
    assert len(found) == 4 * tiles * copies, len(found)


@pytest.mark.parametrize("args", [
    dict(bits=4, k_operand="e4m3", tiles_per_pass=2), dict(bits=2, head_dim=256, gqa=2),
    dict(bits=2, head_dim=64, group_size=64, gqa=4), dict(bits=2, gqa=4, step=4, k_operand="e4m3")])
def test_the_kernels_compile(monkeypatch, args):
    from foscar.cute.compile import compile_stage1
    from foscar.cute.config import config_for
    a = {"head_dim": 128, "group_size": 128, "gqa": 4, "k_operand": "bf16", "tiles_per_pass": 1, "step": 1, **args}
    fmt = foscar.KVFormat(bits=a["bits"], head_dim=a["head_dim"], group_size=a["group_size"], v_axis="channel")
    with cute_switches(monkeypatch, **ON):
        cfg = config_for(fmt, a["gqa"], 64, a["k_operand"], a["tiles_per_pass"], a["step"])
        assert cfg.column_sum_mma
        assert compile_stage1(cfg, warp_specialized=True, ctas_per_sm=1) is not None


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU (H100/H200)")
@pytest.mark.parametrize("bits", (2, 4))
@pytest.mark.parametrize("k_axis", ("token", "channel"))
@pytest.mark.parametrize("gqa,tiles", [(4, 2), (32, 1)])
def test_column_sums_by_mma_as_the_warps_sums_gpu(monkeypatch, bits, k_axis, gqa, tiles):
    """The same decode with the warps' sums and the tensor core's (float32 outputs): the same sums of the same
    ``P~`` in another order, so the outputs within 1e-5 of each other and the errors against the float64 oracle
    within 2% of each other."""
    from foscar.cute.launch import decode
    if k_axis == "channel" and gqa > 4:
        pytest.skip("E4M3 K operands take channel-wise K up to 4 query rows")
    fmt = foscar.KVFormat(bits=bits, head_dim=128, group_size=128, k_axis=k_axis, v_axis="channel")
    q, cache = make(fmt, [6000, 300, 1], Hkv=2, G=gqa, page=64, seed=13)
    exact = foscar.decode_exact(q, cache)
    outs = []
    for switches in (WARPS, ON):
        out = torch.full(q.shape, float("nan"), dtype=torch.float32, device=q.device)
        with cute_switches(monkeypatch, **switches):
            decode(q, cache, out=out, warp_specialized=True, k_operand="e4m3", tiles_per_pass=tiles)
        assert torch.isfinite(out).all()
        outs.append(out)
    errs = [rel(o, exact) for o in outs]
    print(f"\nINT{bits} {k_axis}-wise K, GQA {gqa}: warps' sums {errs[0]:.3e}  tensor core's {errs[1]:.3e}")
    assert rel(outs[1], outs[0]) <= 1e-5 and errs[1] <= 1.02 * errs[0]
