"""v1's pipeline: its depth (stages per consumer) as a launch and tuning choice, the prologue that puts a
CTA's first copies in flight while Q is staged, E4M3 K's QK steps promoted to FP32, V^T's operands, channel-wise K's
``Q'`` folded by the consumers or by the producer. CPU:
the choices, the shared-memory check, each variant compiles for sm_90a without spills. GPU (sm_90): each against the float64 oracle, and a ring that cannot fit
the CTAs of an SM refused by name."""
import os
import re

import pytest
import torch

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")  # compile for Hopper without a GPU
pytest.importorskip("cutlass", reason="needs nvidia-cutlass-dsl (pip install -e '.[test]')")

import foscar  # noqa: E402
from _cases import HOPPER  # noqa: E402
from _helpers import cute_switches  # noqa: E402
from foscar.cute.budget import fits_shared_memory, shared_bytes  # noqa: E402
from foscar.cute.config import DEEP_STAGES, STAGES, config_for, default_stages  # noqa: E402
from foscar.errors import InvalidArgumentError  # noqa: E402


def test_stages_are_a_power_of_two_of_the_choices():
    fmt = foscar.KVFormat(bits=4, head_dim=128, group_size=128)
    assert config_for(fmt, 4, 64).stages == default_stages(4, 128) == STAGES
    assert config_for(foscar.KVFormat(bits=2, head_dim=128, group_size=128), 4, 64).stages == DEEP_STAGES
    assert config_for(fmt, 4, 64, stages=8).stages == 8
    for bad in (2, 6, 32, "8"):
        with pytest.raises(InvalidArgumentError, match="^stages: expected one of"):
            config_for(fmt, 4, 64, stages=bad)


@pytest.mark.parametrize("bits", (2, 4))
@pytest.mark.parametrize("head_dim,gqa,k_operand,tiles", [(64, 4, "e4m3", 2), (128, 4, "e4m3", 2),
                                                          (128, 8, "e4m3", 1), (128, 16, "bf16", 1)])
def test_the_default_ring_fits_two_ctas_and_a_deeper_one_fits_one(bits, head_dim, gqa, k_operand, tiles):
    """The defaults keep two CTAs an SM (the shipped variant); twice the stages fit one CTA an SM (the tuner's
    deeper candidate), and the estimate grows with the stages."""
    fmt = foscar.KVFormat(bits=bits, head_dim=head_dim, group_size=head_dim)
    cfg = config_for(fmt, gqa, 64, k_operand, tiles)
    deep = config_for(fmt, gqa, 64, k_operand, tiles, stages=2 * cfg.stages)
    assert fits_shared_memory(cfg, 2) and fits_shared_memory(deep, 1)
    assert shared_bytes(deep) > shared_bytes(cfg)
    assert not fits_shared_memory(config_for(fmt, gqa, 64, k_operand, tiles, stages=16), 2) or bits == 2


@pytest.mark.parametrize("bits,stages", [(4, 8), (2, 16)])
def test_a_deeper_ring_compiles_for_sm90a(bits, stages):
    """A ring of ``stages`` slots per consumer (one CTA an SM): as many full and empty barriers, no spills."""
    from foscar.cute.compile import compile_stage1
    cfg = config_for(foscar.KVFormat(bits=bits, head_dim=128, group_size=128), 4, 64, "e4m3", 2, stages=stages)
    ptx = compile_stage1(cfg, keep_ptx=True, warp_specialized=True, ctas_per_sm=1).__ptx__
    assert "mbarrier.try_wait" in ptx or "mbarrier.wait" in ptx
    assert not re.search(r"\b(ld|st)\.local", ptx), "local memory (spills) in the kernel"


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU (H100/H200)")
@pytest.mark.parametrize("bits,stages,k_operand,tiles", [(4, 8, "e4m3", 2), (2, 16, "e4m3", 2), (4, 8, "bf16", 1),
                                                         (2, 16, "bf16", 2)])
@pytest.mark.parametrize("lens,num_splits", [([8192, 4001, 129, 1], None), ([3000, 5, 200], 3), ([2500, 70], 1)])
def test_deeper_rings_against_the_oracle_gpu(bits, stages, k_operand, tiles, lens, num_splits):
    """One CTA an SM with a ring twice the default's (the ring wraps many times, splits shorter than it):
    every element against the float64 oracle within the kernels' bound, LSE within 1e-2."""
    from _cases import cute_against_the_oracle
    fmt = foscar.KVFormat(bits=bits, head_dim=128, group_size=128)
    cute_against_the_oracle(fmt, lens, 4, f"{stages} stages: error", num_splits=num_splits,
                               warp_specialized=True, ctas_per_sm=1, k_operand=k_operand, tiles_per_pass=tiles,
                               stages=stages)


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU (H100/H200)")
def test_a_ring_too_deep_for_the_ctas_is_refused_gpu():
    from _cases import make

    from foscar.cute.launch import decode
    from foscar.errors import UnsupportedError
    fmt = foscar.KVFormat(bits=4, head_dim=128, group_size=128)
    q, cache = make(fmt, [700], Hkv=2, G=4, page=64, seed=1)
    out = torch.full(q.shape, float("nan"), dtype=torch.bfloat16, device=q.device)
    with pytest.raises(UnsupportedError, match="stages=8 with ctas_per_sm=2"):
        decode(q, cache, out=out, warp_specialized=True, ctas_per_sm=2, stages=8)
    assert torch.isnan(out).all()  # refused before any launch


@pytest.fixture(params=["q_first", "consumer_q"])
def prologue(request, monkeypatch):
    """``foscar.cute.config.PROLOGUE_BY_BITS`` set to one prologue for both bit widths (``config_for``'s cache
    cleared around the test)."""
    with cute_switches(monkeypatch, PROLOGUE_BY_BITS={2: request.param, 4: request.param}):
        yield request.param


def test_a_misspelt_prologue_is_refused_by_name(monkeypatch):
    with cute_switches(monkeypatch, PROLOGUE_BY_BITS={2: "consumer-q", 4: "q_first"}):
        with pytest.raises(InvalidArgumentError, match="^foscar.cute.config.PROLOGUE_BY_BITS: expected values of"):
            config_for(foscar.KVFormat(bits=2, head_dim=128, group_size=128), 4, 64)


def test_each_bit_width_takes_its_prologue_and_a_rotation_q_first():
    from foscar.cute.config import PROLOGUE_BY_BITS, PROLOGUES
    for bits in (2, 4):
        assert config_for(foscar.KVFormat(bits=bits, head_dim=128, group_size=128), 4, 64, "e4m3", 2).prologue == \
            PROLOGUE_BY_BITS[bits] in PROLOGUES
        assert config_for(foscar.KVFormat(bits=bits, head_dim=128, group_size=128, rotation="hadamard"), 4, 64,
                          "e4m3", 2).prologue == "q_first"


def test_one_cta_an_sm_takes_its_own_prologue(monkeypatch):
    """``PROLOGUE_ONE_CTA`` (INT4 ``consumer_q`` as shipped): a v1 launch at one CTA an SM and 8 columns takes its
    bit width's prologue; at two CTAs, at 16 or 32 columns, with Q staged first (a rotated cache) or where the switch
    names none, its config's; a misspelt name is refused by name."""
    from foscar.cute.launch import prologue_at
    fmt = foscar.KVFormat(bits=4, head_dim=128, group_size=128)
    cfg = config_for(fmt, 4, 64, "e4m3", 2)
    assert cfg.prologue == "q_first" and prologue_at(cfg, True, 1).prologue == "consumer_q"
    with cute_switches(monkeypatch, PROLOGUE_ONE_CTA={}):
        assert prologue_at(cfg, True, 1) is cfg
    with cute_switches(monkeypatch, PROLOGUE_ONE_CTA={4: "consumer_q"}):
        assert prologue_at(cfg, True, 1).prologue == "consumer_q"
        assert prologue_at(cfg, True, 2) is cfg and prologue_at(cfg, False, 1) is cfg
        for gqa in (16, 32):
            wide = config_for(fmt, gqa, 64, "e4m3", 1)
            assert prologue_at(wide, True, 1) is wide
        rotated = config_for(foscar.KVFormat(bits=4, head_dim=128, group_size=128, rotation="hadamard"), 4, 64)
        assert prologue_at(rotated, True, 1) is rotated
    with cute_switches(monkeypatch, PROLOGUE_ONE_CTA={4: "consumer-q"}):
        with pytest.raises(InvalidArgumentError, match="^foscar.cute.config.PROLOGUE_ONE_CTA: expected values of"):
            prologue_at(cfg, True, 1)


@pytest.mark.parametrize("bits,gqa,k_operand,tiles,ctas", [(2, 4, "e4m3", 2, 2), (4, 8, "bf16", 1, 1),
                                                           (2, 16, "e4m3", 1, 2), (4, 4, "e4m3", 2, 1)])
def test_prologues_compile_for_sm90a(prologue, bits, gqa, k_operand, tiles, ctas):
    """Each prologue compiles without spills; ``consumer_q``'s consumers meet at their own named barrier (both
    warpgroups: 256 threads)."""
    from foscar.cute.compile import compile_stage1
    cfg = config_for(foscar.KVFormat(bits=bits, head_dim=128, group_size=128), gqa, 64, k_operand, tiles)
    assert cfg.prologue == prologue
    ptx = compile_stage1(cfg, keep_ptx=True, warp_specialized=True, ctas_per_sm=ctas).__ptx__
    assert not re.search(r"\b(ld|st)\.local", ptx), "local memory (spills) in the kernel"
    assert bool(re.search(r"bar\.sync\s+4,\s*256", ptx)) == (prologue == "consumer_q")
    assert len(re.findall(r"cp\.async\.bulk\.tensor", ptx)) == 4


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU (H100/H200)")
@pytest.mark.parametrize("bits", (2, 4))
@pytest.mark.parametrize("lens,G,num_splits,fmt_kw,launch", [
    ([8192, 4001, 129, 1], 4, None, {}, {"k_operand": "e4m3", "tiles_per_pass": 2}),
    ([3000, 5, 200], 3, 3, {}, {"k_operand": "e4m3", "tiles_per_pass": 2, "ctas_per_sm": 1}),
    ([2500, 70], 8, 1, {}, {"k_operand": "bf16", "tiles_per_pass": 1}),
    ([3000, 64], 16, 3, {}, {"k_operand": "e4m3"}),
    ([5000, 700, 130], 8, None, {"k_axis": "channel"}, {}),
    ([3000, 5], 4, 3, {"sink": 4, "recent": 100}, {"tiles_per_pass": 1}),
    ([2000, 33], 4, 2, {"rotation": "hadamard"}, {})])
def test_prologues_against_the_oracle_gpu(prologue, bits, lens, G, num_splits, fmt_kw, launch):
    """Each prologue: every element against the float64 oracle within the kernels' bound, LSE within 1e-2 (one-tile
    splits, splits past the sequence, windows, a rotated cache, channel-wise K)."""
    from _cases import cute_against_the_oracle
    fmt = foscar.KVFormat(bits=bits, **{"head_dim": 128, "group_size": 128, **fmt_kw})
    cute_against_the_oracle(fmt, lens, G, f"prologue {prologue}: error", num_splits=num_splits,
                               warp_specialized=True, **launch)


@pytest.fixture
def qk_promote(monkeypatch):
    """``foscar.cute.config.QK_PROMOTE_BITS`` set for both widths (``config_for``'s cache cleared around the test)."""
    with cute_switches(monkeypatch, QK_PROMOTE_BITS=(2, 4)):
        yield


@pytest.mark.parametrize("bits,k_operand,tiles", [(2, "e4m3", 2), (4, "e4m3x3", 1)])
def test_promoted_qk_steps_compile_for_sm90a(qk_promote, bits, k_operand, tiles):
    """Each FP8 k-step of S^T into its own accumulator: as many wgmma as one chain, no spills; BF16 K and
    channel-wise K are left as they are."""
    from foscar.cute.compile import compile_stage1
    fmt = foscar.KVFormat(bits=bits, head_dim=128, group_size=128)
    cfg = config_for(fmt, 4, 64, k_operand, tiles)
    assert cfg.qk_promote
    assert not config_for(fmt, 4, 64, "bf16", tiles).qk_promote
    assert not config_for(foscar.KVFormat(bits=bits, head_dim=128, group_size=64), 4, 64, k_operand, tiles).qk_promote
    ptx = compile_stage1(cfg, keep_ptx=True, warp_specialized=True, ctas_per_sm=2).__ptx__
    assert not re.search(r"\b(ld|st)\.local", ptx), "local memory (spills) in the kernel"


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU (H100/H200)")
@pytest.mark.parametrize("bits", (2, 4))
@pytest.mark.parametrize("lens,G,num_splits,launch", [
    ([8192, 4001, 129, 1], 4, None, {"k_operand": "e4m3", "tiles_per_pass": 2}),
    ([3000, 5, 200], 3, 3, {"k_operand": "e4m3x3", "tiles_per_pass": 1}),
    ([2500, 70], 8, 1, {"k_operand": "e4m3"}), ([3000, 64], 16, 3, {"k_operand": "e4m3"})])
def test_promoted_qk_steps_against_the_oracle_gpu(qk_promote, bits, lens, G, num_splits, launch):
    from _cases import cute_against_the_oracle
    fmt = foscar.KVFormat(bits=bits, head_dim=128, group_size=128)
    cute_against_the_oracle(fmt, lens, G, "promoted QK steps: error", num_splits=num_splits,
                               warp_specialized=True, **launch)


def test_int4_promotes_its_qk_steps_and_int2_does_not():
    from foscar.cute.config import QK_PROMOTE_BITS
    assert QK_PROMOTE_BITS == (4,)
    for bits in (2, 4):
        fmt = foscar.KVFormat(bits=bits, head_dim=128, group_size=128)
        assert config_for(fmt, 4, 64, "e4m3", 2).qk_promote == (bits == 4)


@pytest.mark.parametrize("bits,group_size,k_operand,tiles,gqa", [(2, 128, "e4m3", 2, 4), (4, 64, "bf16", 1, 8),
                                                                 (4, 128, "e4m3", 2, 4)])
def test_v_operands_compile_for_sm90a(bits, group_size, k_operand, tiles, gqa):
    """V^T by placement (no offset): no spills in the PTX (two tiles a pass, two channel groups of V); channel-wise V
    placed too (``V_CHANNEL_PLACEMENT``), its accumulator in the output's units."""
    from foscar.cute.compile import compile_stage1
    fmt = foscar.KVFormat(bits=bits, head_dim=128, group_size=group_size)
    cfg = config_for(fmt, gqa, 64, k_operand, tiles)
    assert cfg.v_patterns == (0, 0) and cfg.v_unit > 1
    channel = config_for(foscar.KVFormat(bits=bits, head_dim=128, group_size=128, v_axis="channel"), 4, 64)
    assert channel.v_patterns == (0, 0) and channel.v_unit > 1 and channel.acc_unit == 1
    ptx = compile_stage1(cfg, keep_ptx=True, warp_specialized=True, ctas_per_sm=2).__ptx__
    assert not re.search(r"\b(ld|st)\.local", ptx), "local memory (spills) in the kernel"


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU (H100/H200)")
@pytest.mark.parametrize("bits", (2, 4))
@pytest.mark.parametrize("lens,G,num_splits,fmt_kw,launch", [
    ([8192, 4001, 129, 1], 4, None, {}, {"k_operand": "e4m3", "tiles_per_pass": 2}),
    ([16384, 3000], 4, 1, {}, {"k_operand": "bf16", "tiles_per_pass": 1}),
    ([3000, 5, 200], 8, 3, {"group_size": 64}, {"k_operand": "bf16"}),
    ([3000, 5], 4, 3, {"sink": 4, "recent": 100}, {"tiles_per_pass": 1}),
    ([2000, 33], 4, 2, {"rotation": "hadamard"}, {}),
    ([3000, 70], 4, 2, {}, {"warp_specialized": False})])
def test_v_operands_against_the_oracle_gpu(bits, lens, G, num_splits, fmt_kw, launch):
    from _cases import cute_against_the_oracle
    fmt = foscar.KVFormat(bits=bits, **{"head_dim": 128, "group_size": 128, **fmt_kw})
    cute_against_the_oracle(fmt, lens, G, "V^T placed: error", num_splits=num_splits,
                            **{"warp_specialized": True, **launch})


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU (H100/H200)")
@pytest.mark.parametrize("bits,quantizer", [(4, "minmax"), (2, "mse")])
def test_placed_v_keeps_a_long_split_accurate_gpu(bits, quantizer):
    """The stress input at L 16K in one split (128 tiles a consumer, 16 folds of the corrections): V^T by
    placement keeps the arithmetic error against the float64 oracle near one tile's (about 2.2e-4 measured;
    by injection 8.3e-4 INT4, 1.7e-3 INT2), every element finite."""
    from foscar.bench.common import rel_l2
    from foscar.cache_io import quantize_kv
    from foscar.cute.launch import decode
    from foscar.synthetic import stress_inputs
    q, k, v = stress_inputs(1, 32, 8, 16384, 128, seed=1, dtype=torch.bfloat16, device="cuda")
    cache = quantize_kv(k, v, foscar.KVFormat(bits, 128, 128), quantizer=quantizer)
    out = torch.full(q.shape, float("nan"), dtype=torch.float32, device=q.device)
    decode(q, cache, out=out, num_splits=1, warp_specialized=True, k_operand="bf16", tiles_per_pass=1)
    assert torch.isfinite(out).all()
    err = rel_l2(out, foscar.decode_exact(q, cache))
    print(f"\nINT{bits} L 16K, one split: error {err:.3e}")
    assert err < 4e-4


@pytest.fixture(params=[False, True], ids=["consumer_fold", "producer_fold"])
def producer_fold(monkeypatch, request):
    """``foscar.cute.config.PRODUCER_Q_FOLD`` off (the default: each consumer folds ``Q'``) and on (a warp of the
    producer's a consumer folds a ``Q'`` per stage), ``config_for``'s cache cleared around the test."""
    with cute_switches(monkeypatch, PRODUCER_Q_FOLD=request.param):
        yield request.param


@pytest.mark.parametrize("bits,head_dim,gqa,v_axis,ctas", [(2, 128, 4, "token", 2), (4, 64, 8, "channel", 1),
                                                           (4, 128, 16, "token", 1)])
def test_q_folds_compile_for_sm90a(producer_fold, bits, head_dim, gqa, v_axis, ctas):
    """Channel-wise K's ``Q'`` folded by the consumers or by the producer: the same four TMA copies a tile, the
    producer's register budget (32 at two CTAs an SM when it folds), the deepest ring the CTAs of an SM hold
    (:func:`~foscar.cute.budget.default_ring`, as a launch takes it) and Q staged first where the producer folds;
    no spills."""
    from foscar.cute.budget import default_ring
    from foscar.cute.compile import compile_stage1
    from foscar.cute.config import ws_registers
    fmt = foscar.KVFormat(bits=bits, head_dim=head_dim, group_size=head_dim, k_axis="channel", v_axis=v_axis)
    cfg = default_ring(fmt, gqa, 64, ctas_per_sm=ctas)
    assert cfg.producer_fold == producer_fold
    if producer_fold:  # Q staged before the producer's loop
        assert cfg.prologue == "q_first"
    assert fits_shared_memory(cfg, ctas) and cfg.stages >= STAGES
    ptx = compile_stage1(cfg, keep_ptx=True, warp_specialized=True, ctas_per_sm=ctas).__ptx__
    producer, _ = ws_registers(cfg, ctas)
    assert re.search(rf"setmaxnreg\.dec\.sync\.aligned\.u32\s+{producer}\b", ptx)
    assert len(re.findall(r"cp\.async\.bulk\.tensor", ptx)) == 4
    assert not re.search(r"\b(ld|st)\.local", ptx), "local memory (spills) in the kernel"


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU (H100/H200)")
@pytest.mark.parametrize("bits", (2, 4))
@pytest.mark.parametrize("lens,G,num_splits,fmt_kw,launch", [
    ([5000, 700, 130], 4, None, {"k_axis": "channel"}, {}),
    ([2000, 3], 8, 3, {"k_axis": "channel", "sink": 2, "recent": 7}, {"ctas_per_sm": 1}),
    ([3000, 900], 1, 2, {"k_axis": "channel", "v_axis": "channel"}, {}),
    ([2500, 64], 4, None, {"k_axis": "channel", "v_axis": "channel", "group_size": 64}, {}),
    ([1500, 90], 8, 2, {"k_axis": "channel", "group_size": 64}, {}),
    ([2000, 700], 16, 2, {"k_axis": "channel"}, {"ctas_per_sm": 1}),
    ([2200, 65], 4, 3, {"k_axis": "channel", "v_axis": "channel", "group_size": 256}, {}),
    ([2000, 130], 4, 7, {"k_axis": "channel"}, {})])  # splits of 5 tiles rounded to runs of 2: the last ones empty
def test_q_folds_against_the_oracle_gpu(producer_fold, bits, lens, G, num_splits, fmt_kw, launch):
    """Channel-wise K's ``Q'`` folded by the consumers and by the producer: every element against the float64
    oracle within the kernels' bound (token groups of 64, 128 and 256 tokens, windows, channel-wise V, 16 rows,
    one and two CTAs an SM, splits rounded to the consumers' runs of two tiles with empty splits past the end)."""
    from _cases import cute_against_the_oracle
    fmt = foscar.KVFormat(bits=bits, **{"head_dim": 128, "group_size": 128, **fmt_kw})
    cute_against_the_oracle(fmt, lens, G, f"Q' by the {'producer' if producer_fold else 'consumers'}: error",
                               num_splits=num_splits, warp_specialized=True, **launch)
