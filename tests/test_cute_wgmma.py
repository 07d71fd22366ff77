"""Two-tile passes' and 32-column steps' own wgmma (``foscar.cute.config.OWN_WGMMA_BITS``, ``OWN_WGMMA_STEPS``,
:mod:`foscar.cute.wgmma`): which configurations take it (two-tile passes on every axis pair and token-wise steps of
32 columns at INT2 as shipped, INT4 with the switch); CPU: the PTX issues the same MMAs on the same A registers (the
same instructions forming them) as the tiled MMAs, with the B descriptors formed once, before the tile loop; GPU
(sm_90): token-wise K and V at GQA 1-4, INT2 and INT4, one and two channel groups, one and two CTAs an SM, odd
lengths and splits; channel-wise K, V and both; steps of 8 tokens at GQA 4 (32 columns), against the float64
oracle."""
import os
import re

import pytest

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")  # compile for Hopper without a GPU
pytest.importorskip("cutlass", reason="needs nvidia-cutlass-dsl (pip install -e '.[test]')")

import foscar  # noqa: E402
from _cases import HOPPER, sum_block_mmas  # noqa: E402
from _helpers import cute_switches  # noqa: E402
from foscar.cute.compile import compile_stage1  # noqa: E402
from foscar.cute.config import config_for, consumer_code_paths  # noqa: E402

FMT = foscar.KVFormat(bits=2, head_dim=128, group_size=128)
WGMMA = re.compile(r"wgmma\.mma_async\.sync\.aligned\.(\S+) \{([^}]*)\}, \{([^}]*)\}, (%rd\d+)")


@pytest.mark.parametrize("kw,k_operand,tiles,step,taken", [
    ({}, "e4m3", 2, 1, True), ({"bits": 4}, "e4m3", 2, 1, True), ({"group_size": 64}, "e4m3", 2, 1, True),
    ({}, "e4m3", 1, 8, True), ({"bits": 4}, "e4m3", 1, 8, True), ({}, "e4m3", 1, 1, False), ({}, "e4m3", 1, 4, False),
    ({}, "bf16", 2, 1, False), ({"head_dim": 64, "group_size": 64}, "e4m3", 2, 1, False),
    ({"v_axis": "channel"}, "e4m3", 2, 1, True), ({"k_axis": "channel"}, "e4m3", 2, 1, True),
    ({"k_axis": "channel", "v_axis": "channel"}, "e4m3", 2, 1, True), ({"v_axis": "channel"}, "e4m3", 1, 8, False),
    ({"k_axis": "channel", "producer_fold": True}, "e4m3", 2, 1, True)])
def test_two_tile_passes_and_token_wise_32_column_steps_at_head_dim_128_take_it(monkeypatch, kw, k_operand, tiles,
                                                                                step, taken):
    kw = dict(kw)
    fold = kw.pop("producer_fold", False)
    fmt = foscar.KVFormat(**{"bits": 2, "head_dim": 128, "group_size": 128, **kw})
    with cute_switches(monkeypatch, OWN_WGMMA_BITS=(2, 4), OWN_WGMMA_STEPS=True, PRODUCER_Q_FOLD=fold):
        assert config_for(fmt, 4, 64, k_operand, tiles, step).own_wgmma is taken
    with cute_switches(monkeypatch, OWN_WGMMA_BITS=()):
        assert not config_for(fmt, 4, 64, k_operand, tiles, step).own_wgmma


def _mmas(ptx: str) -> tuple[list, dict]:
    """Each wgmma's shape and the instructions that form its A registers (three levels deep, the registers past
    them unnamed, those of addresses renamed in order of first use), and the defining line of every register."""
    defs = {}
    for line in ptx.splitlines():
        m = re.match(r"\s*([a-z0-9_.]+)\s+(%r[d]?\d+),\s*(.*);", line)
        if m:
            defs[m.group(2)] = (m.group(1), m.group(3))

    def source(r, depth=3):
        if not r.startswith("%r"):
            return r
        if depth == 0 or r not in defs:
            return "%r"
        op, args = defs[r]
        return f"{op}({', '.join(source(x.strip(), depth - 1) for x in args.split(','))})"

    mmas = [(m.group(1), [source(a.strip()) for a in m.group(3).split(",")], m.group(4)) for m in WGMMA.finditer(ptx)]
    names: dict = {}  # the registers left named (addresses), renamed in order of first use

    def rename(text):
        return re.sub(r"%r\d+", lambda m: names.setdefault(m.group(0), f"%v{len(names)}"), text)

    return [(shape, [rename(a) for a in a_regs], desc) for shape, a_regs, desc in mmas], defs


@pytest.mark.parametrize("bits,tiles,step,ctas,mmas,axes", [
    (2, 2, 1, 2, 24, "token"), (4, 2, 1, 2, 24, "token"), (2, 1, 8, 1, 48, "token"), (4, 1, 8, 1, 16, "token"),
    (2, 2, 1, 2, 24, "channel-k"), (2, 2, 1, 2, 24, "channel-v"), (2, 2, 1, 2, 24, "channel")])
def test_the_same_mmas_on_the_same_registers_with_descriptors_formed_once(monkeypatch, bits, tiles, step, ctas,
                                                                          mmas, axes):
    """Two tiles a pass at two CTAs an SM, on every axis pair; a step of 8 tokens on three consumers (INT2: a copy
    of their code each, INT4 one copy)."""
    k_axis = "channel" if axes in ("channel", "channel-k") else "token"
    v_axis = "channel" if axes in ("channel", "channel-v") else "token"
    fmt = foscar.KVFormat(bits=bits, head_dim=128, group_size=128, k_axis=k_axis, v_axis=v_axis)
    ptx = {}
    for on in (False, True):
        with cute_switches(monkeypatch, OWN_WGMMA_BITS=(bits,) if on else (), OWN_WGMMA_STEPS=on):
            cfg = config_for(fmt, 4, 64, "e4m3", tiles, step)
            ptx[on] = compile_stage1(cfg, keep_ptx=True, warp_specialized=True, ctas_per_sm=ctas).__ptx__
    off, _ = _mmas(ptx[False])
    on, _ = _mmas(ptx[True])
    assert [(s, a) for s, a, _ in on] == [(s, a) for s, a, _ in off] and len(on) == mmas + sum_block_mmas(cfg)
    # Q's first descriptor and P''s, each through one opaque move, made once a copy of the consumers' code
    moves = re.findall(r"mov\.b64 (%rd\d+), %rd\d+;", ptx[True])
    assert len(moves) == len(set(moves)) == 2 * consumer_code_paths(cfg, ctas)
    assert not re.findall(r"mov\.b64 %rd\d+, %rd\d+;", ptx[False])


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU (H100/H200)")
@pytest.mark.parametrize("bits", (2, 4))
@pytest.mark.parametrize("fmt_kw,gqa,lens,num_splits,ctas", [
    ({}, 4, [8192, 700, 1], 16, 2), ({}, 4, [4097, 63, 130], 5, 1), ({}, 2, [3000, 190, 5], None, 2),
    ({}, 1, [1000, 64, 129], 3, 2), ({"group_size": 64}, 3, [2000, 333], 4, 2),
    ({"group_size": 64}, 4, [1500, 65], None, 1),
    ({"k_axis": "channel"}, 4, [5000, 700, 130], None, 2), ({"k_axis": "channel"}, 3, [700, 129, 1], 7, 1),
    ({"v_axis": "channel"}, 4, [3000, 900, 65], 3, 2), ({"v_axis": "channel"}, 2, [1000, 1], None, 1),
    ({"k_axis": "channel", "v_axis": "channel"}, 4, [4100, 300], 5, 2),
    ({"k_axis": "channel", "v_axis": "channel", "sink": 2, "recent": 7}, 1, [2000, 3], 3, 2)])
def test_two_tile_passes_with_their_own_wgmma_against_the_oracle_gpu(monkeypatch, bits, fmt_kw, gqa, lens, num_splits,
                                                                     ctas):
    """Token-wise K and V (one and two channel groups), channel-wise K (``Q'``'s buffer by an offset of its
    descriptor), channel-wise V (the pass's partial by a first step that overwrites it), both, windows."""
    from _cases import cute_against_the_oracle
    fmt = foscar.KVFormat(**{"bits": bits, "head_dim": 128, "group_size": 128, **fmt_kw})
    with cute_switches(monkeypatch, OWN_WGMMA_BITS=(2, 4)):
        cute_against_the_oracle(fmt, lens, gqa, f"{fmt_kw}, GQA {gqa}, own wgmma, {ctas} CTA(s) an SM: error",
                                num_splits=num_splits, warp_specialized=True, k_operand="e4m3", tiles_per_pass=2,
                                ctas_per_sm=ctas)


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU (H100/H200)")
@pytest.mark.parametrize("bits", (2, 4))
@pytest.mark.parametrize("num_splits", (None, 64))
@pytest.mark.parametrize("copies", (1, 3))
def test_steps_of_32_columns_with_their_own_wgmma_against_the_oracle_gpu(monkeypatch, bits, num_splits, copies):
    """A step of 8 tokens at GQA 4 on three consumers, on one copy of their code or one each."""
    from _cases import cute_step_against_the_oracle
    with cute_switches(monkeypatch, OWN_WGMMA_BITS=(2, 4), OWN_WGMMA_STEPS=True,
                       ONE_COPY_BITS=(2, 4) if copies == 1 else ()):
        cfg = config_for(foscar.KVFormat(bits=bits, head_dim=128, group_size=128), 4, 64, "e4m3", 1, 8)
        assert cfg.own_wgmma and consumer_code_paths(cfg, 1) == copies
        cute_step_against_the_oracle(bits, 4, 8, num_splits, {})
