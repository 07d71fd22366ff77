"""Three cuts of v1's tile loop, each a switch: token-wise V^T's FP16 operands placed from bit 0
(``foscar.cute.config.V_LOW_PLACEMENT``, on) and by channel-row class too (``V_ROW_SHIFTS``,
``Sm90Config.v_row_shls``, off), and a thread's K and V words of a stage read off one base (``FLAT_WORDS``, at
``FLAT_WORDS_COLS``' columns).

The first two place each register's codes at bit ``a_h + b_c`` of its FP16s (token half ``h``, channel-row class
``c``), one rotation a word by class where from bit 4 takes three or four. The halves' difference rides on P'; the
classes' on the accumulator's rows, taken off as the offset corrections join them and in the epilogue. Every change
of units is a power of two, and P' carries ``2^(V_PRODUCT_BIT - shl_h)`` so that every product stays in bit 4's
units (``q 2^-20``). From bit 0 the stress study's error is that of bit 4 (within 1.5%); by row class it rose
(``docs/results-h200.md``). The third reads the same words: no change of arithmetic.

CPU: the tile loop issues fewer instructions and spills no more (``tests/test_cute_fragment.py`` checks the
registers' values and rotations); a stage's 2-D layout is the flat run of words the third reads. GPU (sm_90):
against the float64 oracle (E4M3 and BF16 K, one and two tiles a pass, windows, GQA 32, a step of 4 tokens, head
dims 64 and 256, channel-wise K, v0, V's magnitude cases), and against the kernel with the switches off."""
import os
import sys
from pathlib import Path

import pytest
import torch

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")  # compile for Hopper without a GPU
pytest.importorskip("cutlass", reason="needs nvidia-cutlass-dsl (pip install -e '.[test]')")

import foscar  # noqa: E402
from _cases import (HOPPER, cute_against_the_oracle, cute_magnitude_case,  # noqa: E402
                    cute_step_against_the_oracle, make)
from _helpers import V_MAGNITUDES, cute_switches  # noqa: E402

ALL = {"V_LOW_PLACEMENT": True, "V_ROW_SHIFTS": True, "FLAT_WORDS": True}
OFF = dict.fromkeys(ALL, False)
FLAT = {"FLAT_WORDS": True}  #: the words off one base alone: no change of arithmetic
LOW_FLAT = {"V_LOW_PLACEMENT": True, "FLAT_WORDS": True}  #: without the row classes (the stress study's error as off)


def _full_tile(monkeypatch, switches: dict, bits: int, *args: str) -> tuple[float, int]:
    """``(instructions a full tile, local-memory instructions)`` of v1 (E4M3 K, GQA 4 unless ``args`` say
    otherwise) under ``switches`` (``benchmarks/sass_stats_cute.py``'s count)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import sass_stats_cute as ss
    a = ss.kernel_parser("").parse_args(["--bits", str(bits), "--k-operand", "e4m3", *args])
    with cute_switches(monkeypatch, **switches):
        cfg, sass = ss.kernel_sass(a)
    return ss.full_tile(sass, cfg.p_tiles), ss.local_memory(sass)


@pytest.mark.parametrize("bits,args", [(2, ("--tiles-per-pass", "2", "--ctas", "2")),
                                       (4, ("--tiles-per-pass", "2", "--ctas", "2")),
                                       (2, ("--gqa", "32", "--ctas", "1"))])
def test_one_rotation_a_word_takes_instructions_off_every_tile(monkeypatch, bits, args):
    shipped, spills = _full_tile(monkeypatch, OFF, bits, *args)
    both, spills_both = _full_tile(monkeypatch, ALL, bits, *args)
    print(f"\nINT{bits} {' '.join(args)}: {shipped:g} -> {both:g} instructions a full tile")
    assert both <= shipped - 8 and spills_both <= spills


@pytest.mark.parametrize("bits", (2, 4))
@pytest.mark.parametrize("head_dim", (64, 128, 256))
def test_a_stage_is_a_flat_run_of_words(bits, head_dim):
    """The stage layout v1's ring allocates (``((ci, co), slots)`` of stride ``((1, ci), tile_words)``, ``(ci, co)``
    the TMA box) is word ``w`` of slot ``s`` at ``w + s tile_words``: what ``FLAT_WORDS`` reads."""
    from foscar.cute.config import config_for
    fmt = foscar.KVFormat(bits=bits, head_dim=head_dim, group_size=min(head_dim, 128))
    cfg = config_for(fmt, 2, 64, "bf16" if head_dim == 256 else "e4m3", 1)
    ci, co = cfg.tma_box
    assert ci * co == cfg.tile_words


@pytest.mark.parametrize("bits", (2, 4))
def test_every_pv_product_takes_bit_fours_units(monkeypatch, bits):
    """By placement P' of token half ``h`` carries ``2^(V_PRODUCT_BIT - shl_h)`` (``v_factors``): a code's operand
    ``q 2^(shl_h - 24)`` times it is ``q 2^-20`` from any bit, the shipped kernel's units (``v_unit`` ``2^20``), and
    P' (at most ``2^8`` under the lazy rescale) stays far inside FP16's range. ``V_PRODUCT_BIT=0``: P' as from bit 4
    up, the codes' own units."""
    from foscar.cute.config import config_for
    from foscar.format import RESCALE_HEADROOM
    fmt = foscar.KVFormat(bits=bits, head_dim=128, group_size=128)
    for switches in (OFF, {"V_LOW_PLACEMENT": True}, ALL):
        with cute_switches(monkeypatch, **switches):
            cfg = config_for(fmt, 4, 64)
        assert cfg.v_unit == 2.0 ** 20
        assert all(2.0 ** (shl - 24) * f == 2.0 ** -20 for shl, f in zip(cfg.v_shls, cfg.v_factors))
        assert max(cfg.v_factors) * 2.0 ** RESCALE_HEADROOM <= 2.0 ** 12
    with cute_switches(monkeypatch, V_PRODUCT_BIT=0, **ALL):
        cfg = config_for(fmt, 4, 64)
    assert cfg.v_unit == 2.0 ** 24 and max(cfg.v_factors) == 1.0


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU (H100/H200)")
@pytest.mark.parametrize("bits", (2, 4))
@pytest.mark.parametrize("fmt_kw,G,lens,launch", [
    ({}, 4, [8192, 700, 1], {"warp_specialized": True, "k_operand": "e4m3", "tiles_per_pass": 2, "num_splits": 16}),
    ({"sink": 4, "recent": 100}, 4, [3000, 5], {"warp_specialized": True, "tiles_per_pass": 1, "num_splits": 3}),
    ({}, 32, [4100, 77], {"warp_specialized": True, "k_operand": "e4m3", "ctas_per_sm": 1}),
    ({"head_dim": 64, "group_size": 64}, 2, [1000, 64], {"warp_specialized": True}),
    ({"k_axis": "channel"}, 4, [4100, 260], {"warp_specialized": True}),
    ({}, 8, [2000, 33], {"warp_specialized": False})])
@pytest.mark.parametrize("switches", [ALL, FLAT, LOW_FLAT], ids=["all", "flat", "low-flat"])
def test_v_bits_against_the_oracle_gpu(monkeypatch, bits, fmt_kw, G, lens, launch, switches):
    fmt = foscar.KVFormat(bits=bits, **{"head_dim": 128, "group_size": 128, **fmt_kw})
    with cute_switches(monkeypatch, **switches):
        cute_against_the_oracle(fmt, lens, G, "V^T by row class, flat words: error", **launch)


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU (H100/H200)")
@pytest.mark.parametrize("bits", (2, 4))
def test_v_bits_head_dim_256_and_a_step_gpu(monkeypatch, bits):
    with cute_switches(monkeypatch, **ALL):
        fmt = foscar.KVFormat(bits=bits, head_dim=256, group_size=128)
        cute_against_the_oracle(fmt, [3000, 9], 2, "V^T by row class, flat words, head dim 256: error",
                                warp_specialized=True, ctas_per_sm=1)
        cute_step_against_the_oracle(bits, 4, 4, 64, {})


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU (H100/H200)")
@pytest.mark.parametrize("magnitude", V_MAGNITUDES)
def test_v_bits_magnitudes_gpu(monkeypatch, magnitude):
    with cute_switches(monkeypatch, **ALL):
        cute_magnitude_case(magnitude, warp_specialized=True)


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU (H100/H200)")
@pytest.mark.parametrize("bits", (2, 4))
@pytest.mark.parametrize("launch", [{"k_operand": "e4m3", "tiles_per_pass": 2}, {"tiles_per_pass": 1}])
@pytest.mark.parametrize("switches", [ALL, FLAT, LOW_FLAT], ids=["all", "flat", "low-flat"])
def test_v_bits_match_the_kernel_without_them_gpu(monkeypatch, bits, launch, switches):
    """The same decode with the switches off and on: the words off one base alone bit for bit; all three within FP32
    rounding (every unit a power of two; the smallest P' rounded below FP16's normal range), V^T from bit 0 with the
    words off one base too."""
    from foscar.cute.launch import decode
    fmt = foscar.KVFormat(bits=bits, head_dim=128, group_size=128)
    q, cache = make(fmt, [6000, 300, 1], Hkv=2, G=4, page=64, seed=11)
    outs = []
    for chosen in (OFF, switches):
        out = torch.full(q.shape, float("nan"), dtype=torch.float32, device=q.device)
        with cute_switches(monkeypatch, **chosen):
            decode(q, cache, out=out, warp_specialized=True, num_splits=4, **launch)
        outs.append(out)
    assert torch.isfinite(outs[1]).all()
    diff = float((outs[1].double() - outs[0].double()).norm() / outs[0].double().norm())
    print(f"\nINT{bits} {launch}: relative difference to the kernel without the switches {diff:.3e}")
    assert torch.equal(outs[0], outs[1]) if switches == FLAT else diff <= 1e-5
