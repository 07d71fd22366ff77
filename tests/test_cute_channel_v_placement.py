"""Channel-wise V^T by placement (``foscar.cute.config.V_CHANNEL_PLACEMENT``, on): each token half's codes at their own
bits of the FP16 operand (``q 2^(shl_h - 24)``, no offset), as token-wise V's are, where injection puts both halves
at one bit (``q + beta``) and takes more rotations a word. The halves' difference rides on ``P~`` (half ``h``:
``fp16(P v_factors[h])``, a power of two), the column sums take ``P~ / v_factors[h]`` (``P`` as consumed) and each
partial's scale is ``s' v_unit`` (:func:`foscar.cute.folds.v_acc_fold_product`).

CPU: the config's constants, and the acc-fold they drive emulated in float64 from the operands' bit patterns, equal
to ``sum_t P_t x_t`` over the dequantized values, with the switch on and off (injection); ``P~`` within FP16 under
the lazy rescale's headroom; fewer rotations a word and fewer instructions a tile. GPU (sm_90): against the float64
oracle (both K operands and axes, one and two tiles a pass, windows, channel groups of 64, GQA 8 and 32, a step,
head dims 64 and 256, v0, V's magnitude cases), and no worse than injection on the same cache."""
import os
import sys
from pathlib import Path

import pytest
import torch

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")  # compile for Hopper without a GPU
pytest.importorskip("cutlass", reason="needs nvidia-cutlass-dsl (pip install -e '.[test]')")

import foscar  # noqa: E402
from _cases import (CHANNEL_V_GPU_CASES, HOPPER, cute_against_the_oracle, cute_magnitude_case,  # noqa: E402
                    make)
from _helpers import V_MAGNITUDES, cute_switches, rel  # noqa: E402

ON, OFF = {"V_CHANNEL_PLACEMENT": True}, {"V_CHANNEL_PLACEMENT": False}
#: the GPU cases with the column sums by the tensor core too (tests/test_cute_column_sum_mma.py)
SHIPPED_AND_SUMS = pytest.mark.parametrize("switches", (ON, {**ON, "COLUMN_SUM_MMA_COLS": (8, 16, 32)}),
                                           ids=("placed", "column-sums"))


def _config(monkeypatch, switches: dict, fmt, gqa: int = 4):
    from foscar.cute.config import config_for
    with cute_switches(monkeypatch, **switches):
        return config_for(fmt, gqa, 64)


def _operands(cfg, q: torch.Tensor, half: torch.Tensor) -> torch.Tensor:
    """V^T's operand values as the tensor core reads them: the FP16 bits ``v_patterns[h] | q << v_shls[h]`` of each
    code (``half``: its token half), decoded."""
    pattern = torch.tensor(cfg.v_patterns)[half]
    shl = torch.tensor(cfg.v_shls)[half]
    return (pattern | (q << shl)).to(torch.int16).view(torch.float16).double()


@pytest.mark.parametrize("bits", (2, 4))
@pytest.mark.parametrize("head_dim", (64, 128, 256))
@pytest.mark.parametrize("switches", (ON, OFF), ids=("placed", "injected"))
def test_the_acc_fold_of_the_operands_is_the_attention_sum(monkeypatch, bits, head_dim, switches):
    """A tile's ``sum_t P_t x_t`` per channel (``x = s' y_cache(q) + z'``, float64) from what the kernel forms: the
    operands' bit patterns, ``P~`` by half, the column sums of ``P~ / v_factors[h]`` and ``s' v_unit part +
    (z' + (mid - c) s') sum P``, every constant from the config; equal to float64 rounding. By placement ``P~`` of
    ``P <= 2^RESCALE_HEADROOM`` stays within FP16, the higher half's factor 1."""
    from foscar.format import RESCALE_HEADROOM
    fmt = foscar.KVFormat(bits=bits, head_dim=head_dim, group_size=min(head_dim, 128), v_axis="channel")
    cfg = _config(monkeypatch, switches, fmt, 2)
    gen = torch.Generator().manual_seed(bits + head_dim)
    T, D, N = 64, head_dim, 8
    q = torch.randint(0, 1 << bits, (T, D), generator=gen)
    half = (torch.arange(T) % 16 >= 8).long()  # a k16 block's upper 8 tokens: token half 1 (fragment.v_token_half)
    sp = torch.rand(D, generator=gen, dtype=torch.float64) * 3 + 0.1
    zp = torch.randn(D, generator=gen, dtype=torch.float64) * 40
    p = torch.rand(T, N, generator=gen, dtype=torch.float64)
    x = sp * (fmt.op.alpha * q.double() + fmt.op.beta) + zp  # [T, D]
    want = p.T @ x  # [N, D]
    f = torch.tensor(cfg.v_factors, dtype=torch.float64)[half]
    pt = p * f[:, None]
    part = pt.T @ _operands(cfg, q, half[:, None].expand(T, D))
    psum = (pt / f[:, None]).sum(0)
    centre = cfg.v_mid - cfg.v_pivots[0] * cfg.v_factors[0]
    got = part * (sp * cfg.v_unit) + psum[:, None] * (zp + centre * sp)
    assert torch.allclose(got, want, rtol=1e-12, atol=1e-9 * float(want.abs().max()))
    assert cfg.acc_unit == 1.0
    if switches is ON:
        assert cfg.v_patterns == (0, 0) and min(cfg.v_factors) == 1.0
        assert max(cfg.v_factors) * 2.0 ** RESCALE_HEADROOM <= 2.0 ** 12
    else:
        assert cfg.v_factors == (1.0, 1.0) and cfg.v_unit == 1.0 and cfg.v_shls[0] == cfg.v_shls[1]


@pytest.mark.parametrize("bits", (2, 4))
@pytest.mark.parametrize("head_dim", (64, 128, 256))
def test_each_half_at_its_own_bits_takes_fewer_rotations(monkeypatch, bits, head_dim):
    from foscar.cute.fragment import v_rotations
    fmt = foscar.KVFormat(bits=bits, head_dim=head_dim, group_size=min(head_dim, 128), v_axis="channel")
    placed, injected = (_config(monkeypatch, s, fmt, 2) for s in (ON, OFF))
    n = [len(v_rotations(bits, head_dim, c.v_shls) - {0}) for c in (placed, injected)]
    assert n[0] < n[1], n


def test_fewer_instructions_a_tile(monkeypatch):
    """INT2, token-wise K on E4M3, two tiles a pass (``benchmarks/sass_stats_cute.py``'s count of a full tile)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import sass_stats_cute as ss
    a = ss.kernel_parser("").parse_args(["--bits", "2", "--k-operand", "e4m3", "--tiles-per-pass", "2", "--ctas", "2",
                                         "--v-axis", "channel"])
    counts = []
    for switches in (OFF, ON):
        with cute_switches(monkeypatch, **switches):
            cfg, sass = ss.kernel_sass(a)
        counts.append((ss.full_tile(sass, cfg.p_tiles), ss.local_memory(sass)))
    print(f"\ninjected {counts[0][0]:g} -> placed {counts[1][0]:g} instructions a full tile")
    assert counts[1][0] <= counts[0][0] - 8 and counts[1][1] <= counts[0][1]


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU (H100/H200)")
@pytest.mark.parametrize("bits", (2, 4))
@pytest.mark.parametrize("fmt_kw,G,lens,launch", CHANNEL_V_GPU_CASES)
@SHIPPED_AND_SUMS
def test_placed_channel_v_against_the_oracle_gpu(monkeypatch, bits, fmt_kw, G, lens, launch, switches):
    fmt = foscar.KVFormat(bits=bits, **{"head_dim": 128, "group_size": 128, "v_axis": "channel", **fmt_kw})
    with cute_switches(monkeypatch, **switches):
        cute_against_the_oracle(fmt, lens, G, "channel-wise V^T by placement: error", **launch)


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU (H100/H200)")
@pytest.mark.parametrize("bits,T", [(2, 8), (4, 4)])
@SHIPPED_AND_SUMS
def test_placed_channel_v_a_step_gpu(monkeypatch, bits, T, switches):
    """A step over channel-wise V's recent ring (each token's window as it was at that token: ``rollback``)."""
    from _cases import check_windowed_step
    with cute_switches(monkeypatch, **switches):
        check_windowed_step(dict(bits=bits, group_size=128, v_axis="channel", rollback=8), 128, 4, T, "cute")


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU (H100/H200)")
@pytest.mark.parametrize("ws", (False, True), ids=("v0", "v1"))
@pytest.mark.parametrize("magnitude", V_MAGNITUDES)
@SHIPPED_AND_SUMS
def test_placed_channel_v_magnitudes_gpu(monkeypatch, magnitude, ws, switches):
    """V of any magnitude the library takes, constant groups before tiny ones: finite, within the kernels' bound."""
    with cute_switches(monkeypatch, **switches):
        cute_magnitude_case(magnitude, "channel", warp_specialized=ws)


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU (H100/H200)")
@pytest.mark.parametrize("bits", (2, 4))
@pytest.mark.parametrize("k_axis", ("token", "channel"))
def test_placed_channel_v_no_worse_than_injected_gpu(monkeypatch, bits, k_axis):
    """The same decode with V^T injected and placed (float32 outputs): placed within 1.25 times injection's error
    against the float64 oracle, the two within 1e-3 of each other."""
    from foscar.cute.launch import decode
    fmt = foscar.KVFormat(bits=bits, head_dim=128, group_size=128, k_axis=k_axis, v_axis="channel")
    q, cache = make(fmt, [6000, 300, 1], Hkv=2, G=4, page=64, seed=11)
    exact = foscar.decode_exact(q, cache)
    outs = []
    for switches in (OFF, ON):
        out = torch.full(q.shape, float("nan"), dtype=torch.float32, device=q.device)
        with cute_switches(monkeypatch, **switches):
            decode(q, cache, out=out, warp_specialized=True, k_operand="e4m3", tiles_per_pass=2)
        assert torch.isfinite(out).all()
        outs.append(out)
    errs = [rel(o, exact) for o in outs]
    print(f"\nINT{bits} {k_axis}-wise K: injected {errs[0]:.3e}  placed {errs[1]:.3e}")
    assert errs[1] <= 1.25 * errs[0] and rel(outs[1], outs[0]) <= 1e-3
