"""Channel-wise K with E4M3 K operands (``foscar.cute.config.CHANNEL_K_E4M3``): each token group's ``Q' = Q s'``
folded into two E4M3 terms (``foscar.cute.folds.fold_q_terms``), one tile or two tiles of one token group a
softmax pass; beyond 4 query rows (``CHANNEL_K_E4M3_ROWS``, 8 here) the terms in two column blocks of 16 columns. CPU: refused while the switch is off, and two tiles a pass where a pass would span two token
groups; with it, v1 compiles for sm_90a with the E4M3 QK products and no BF16 one, no local memory; v0 refuses it;
each fold thread's channels are the fragment's contraction indices ``4 k .. 4 k + 3``. GPU (sm_90): decodes
against the float64 oracle."""
import os
import re
from types import SimpleNamespace

import pytest

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")  # compile for Hopper without a GPU
pytest.importorskip("cutlass", reason="needs nvidia-cutlass-dsl (pip install -e '.[test]')")

import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402

import foscar  # noqa: E402
from _cases import HOPPER  # noqa: E402
from _helpers import cute_switches  # noqa: E402
from foscar.cute.compile import compile_stage1  # noqa: E402
from foscar.cute.config import config_for, consumer_code_paths, default_stages  # noqa: E402
from foscar.cute.fold_terms import term_word_offset  # noqa: E402
from foscar.cute.operands_e4m3 import sq_layout_e4m3  # noqa: E402
from foscar.errors import UnsupportedError  # noqa: E402

E4M3_WGMMA = re.compile(r"wgmma\.mma_async\.sync\.aligned\.m64n(8|16)k32\.f32\.e4m3\.e4m3")


@pytest.fixture
def switch(monkeypatch):
    with cute_switches(monkeypatch, CHANNEL_K_E4M3=True, CHANNEL_K_E4M3_ROWS=8):
        yield


@pytest.fixture(params=[False, True], ids=("consumer_fold", "producer_fold"))
def pass_switch(monkeypatch, request):
    """Two tiles a pass: ``Q'`` folded by each consumer, or by the producer warpgroup (``PRODUCER_Q_FOLD``)."""
    with cute_switches(monkeypatch, CHANNEL_K_E4M3=True, PRODUCER_Q_FOLD=request.param):
        yield request.param


def test_refused_while_the_switch_is_off(monkeypatch):
    fmt = foscar.KVFormat(bits=2, head_dim=128, group_size=128, k_axis="channel")
    with cute_switches(monkeypatch, CHANNEL_K_E4M3=False):
        with pytest.raises(UnsupportedError, match="CHANNEL_K_E4M3"):
            config_for(fmt, 4, 64, "e4m3")
    with cute_switches(monkeypatch, CHANNEL_K_E4M3=True, CHANNEL_K_E4M3_ROWS=4):  # past the rows: refused by name
        with pytest.raises(UnsupportedError, match="CHANNEL_K_E4M3_ROWS"):
            config_for(fmt, 5, 64, "e4m3")
        assert config_for(fmt, 5, 64).k_channel  # BF16 K operands take it


def test_each_fold_thread_builds_four_consecutive_contraction_indices():
    from foscar.cute.fold_map import TERM_CHANNELS, term_channels, term_chunk
    from foscar.cute.operands_e4m3 import contraction_index
    from foscar.e4m3 import contraction_order
    for bits in (2, 4):
        for D in (64, 128):
            order = contraction_order(bits, D).tolist()
            assert [contraction_index(bits, order[k]) for k in range(D)] == list(range(D))
            lanes = D // TERM_CHANNELS
            for t in range(128):  # a warpgroup: row t // lanes, a row's builders consecutive lanes of one warp
                h, k = term_chunk(D, t)
                assert (h, k) == (t // lanes, t % lanes) and lanes <= 32 and 32 % lanes == 0
                d, off = term_channels(bits, k)
                assert d % 2 == 0 and order[4 * k: 4 * k + 4] == [d, d + off, d + 1, d + off + 1]


@pytest.mark.parametrize("g,v_axis,k_operand", [(64, "token", "e4m3"), (128, "channel", "e4m3"), (128, "token", "bf16")])
def test_two_tiles_a_pass_within_one_token_group(monkeypatch, pass_switch, g, v_axis, k_operand):
    fmt = foscar.KVFormat(bits=2, head_dim=128, group_size=g, k_axis="channel", v_axis=v_axis)
    with cute_switches(monkeypatch, PAIR_CHANNEL_V=False):  # channel-wise V's pass: its own switch
        with pytest.raises(UnsupportedError, match="tiles_per_pass=2"):
            config_for(fmt, 4, 64, k_operand, 2)
    cfg = config_for(foscar.KVFormat(bits=2, head_dim=128, group_size=128, k_axis="channel"), 4, 64, "e4m3", 2)
    assert cfg.tiles_per_pass == 2 and cfg.tile_run == 2 and cfg.lazy_rescale and cfg.producer_fold == pass_switch
    from foscar.cute.launch import default_variant  # an untuned launch takes the pass
    assert default_variant(foscar.KVFormat(bits=4, head_dim=128, group_size=128, k_axis="channel"), 3, 64) == ("e4m3", 2)
    if pass_switch:  # the producer folds a pass's Q' once: one tile a pass would fold every tile
        with pytest.raises(UnsupportedError, match="two tiles a pass where the producer folds"):
            config_for(foscar.KVFormat(bits=2, head_dim=128, group_size=128, k_axis="channel"), 4, 64, "e4m3", 1)


@pytest.mark.parametrize("bits,gqa", [(2, 4), (4, 3), (2, 1)])
def test_the_producer_folds_a_pass_for_sm90a(monkeypatch, bits, gqa):
    with cute_switches(monkeypatch, CHANNEL_K_E4M3=True, PRODUCER_Q_FOLD=True):
        fmt = foscar.KVFormat(bits=bits, head_dim=128, group_size=128, k_axis="channel")
        cfg = config_for(fmt, gqa, 64, "e4m3", 2)
        assert cfg.producer_fold and cfg.prologue == "q_first"
        from foscar.cute.budget import default_ring  # a Q' a pass, one byte a term: the default ring at two CTAs
        assert default_ring(fmt, gqa, 64, "e4m3", 2, ctas_per_sm=2).stages == cfg.stages == default_stages(bits, 128)
        ptx = compile_stage1(cfg, keep_ptx=True, warp_specialized=True, ctas_per_sm=2).__ptx__
    assert len(E4M3_WGMMA.findall(ptx)) == 2 * 128 // 32  # one code path: both tiles' QK products
    # the fold's row maxima: a warp a consumer folds a row a turn, the turns a loop at run time (one row's registers)
    assert len(re.findall(r"redux\.sync\.max\.u32", ptx)) == 1
    assert not re.search(r"\b(ld|st)\.local", ptx), "local memory (spills) in the kernel"


def test_the_unrolled_producer_fold_for_sm90a(monkeypatch):
    """``FOLD_UNROLLED_BITS``: INT2's producer fold builds a pass's four rows unrolled (four row maxima in the PTX)
    at 48 producer and 96 consumer registers at two CTAs an SM; INT4 keeps a row a turn at 32 / 104."""
    from foscar.cute.config import ws_registers
    with cute_switches(monkeypatch, CHANNEL_K_E4M3=True, PRODUCER_Q_FOLD=True, FOLD_UNROLLED_BITS=(2,)):
        cfgs = {bits: config_for(foscar.KVFormat(bits=bits, head_dim=128, group_size=128, k_axis="channel"), 4, 64,
                                 "e4m3", 2) for bits in (2, 4)}
        assert cfgs[2].fold_unrolled and not cfgs[4].fold_unrolled
        assert ws_registers(cfgs[2], 2) == (48, 96) and ws_registers(cfgs[4], 2) == (32, 104)
        ptx = compile_stage1(cfgs[2], keep_ptx=True, warp_specialized=True, ctas_per_sm=2).__ptx__
    assert len(re.findall(r"redux\.sync\.max\.u32", ptx)) == 4
    assert re.search(r"setmaxnreg\.dec\.sync\.aligned\.u32\s+48\b", ptx)
    assert not re.search(r"\b(ld|st)\.local", ptx), "local memory (spills) in the kernel"


@pytest.mark.parametrize("bits,head_dim,group_size,gqa,v_axis,tiles", [
    (2, 128, 128, 4, "token", 1), (4, 128, 128, 3, "channel", 1), (2, 64, 64, 1, "token", 1),
    (2, 128, 128, 4, "token", 2), (4, 128, 128, 2, "token", 2), (2, 128, 128, 1, "token", 2),
    (2, 128, 128, 8, "token", 1), (4, 128, 64, 6, "channel", 1)])
def test_compiles_for_sm90a(switch, bits, head_dim, group_size, gqa, v_axis, tiles):
    fmt = foscar.KVFormat(bits=bits, head_dim=head_dim, group_size=group_size, k_axis="channel", v_axis=v_axis)
    cfg = config_for(fmt, gqa, 64, "e4m3", tiles)
    assert cfg.k_e4m3 and cfg.k_channel and not cfg.q_as_terms and cfg.term_blocks == (gqa > 4)
    assert cfg.qk_cols == (16 if gqa > 4 else 8)
    ptx = compile_stage1(cfg, keep_ptx=True, warp_specialized=True, ctas_per_sm=2).__ptx__
    copies = consumer_code_paths(cfg, 2)  # one chain per copy of the consumers' code, a QK product per tile of a pass
    assert len(E4M3_WGMMA.findall(ptx)) == copies * tiles * head_dim // 32
    assert not re.search(r"m64n8k16\.f32\.bf16", ptx), "no BF16 QK product left"
    assert not re.search(r"\b(ld|st)\.local", ptx), "local memory (spills) in the kernel"
    with pytest.raises(ValueError, match="v0"):
        compile_stage1(cfg, warp_specialized=False)


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU (H100/H200)")
@pytest.mark.parametrize("bits", (2, 4))
@pytest.mark.parametrize("lens,G,num_splits,fmt_kw", [
    ([5000, 700, 130], 4, None, {}), ([3000, 900], 1, 2, {"v_axis": "channel"}),
    ([2500, 64], 2, None, {"v_axis": "channel", "group_size": 64}), ([2000, 3], 4, 3, {"sink": 2, "recent": 7}),
    ([1500, 90], 3, 2, {"group_size": 64, "head_dim": 64}), ([4000, 260], 4, None, {"group_size": 256, "v_axis": "channel"}),
    ([5000, 700, 130], 8, None, {}), ([3000, 77], 6, 3, {"group_size": 64}), ([2500, 64], 5, 2, {"v_axis": "channel"}),
    ([2000, 3], 8, 3, {"sink": 2, "recent": 7})])
def test_against_the_oracle_gpu(switch, bits, lens, G, num_splits, fmt_kw):
    from _cases import cute_against_the_oracle
    fmt = foscar.KVFormat(bits=bits, k_axis="channel", **{"head_dim": 128, "group_size": 128, **fmt_kw})
    cute_against_the_oracle(fmt, lens, G, "channel-wise K, E4M3 terms of Q': error", num_splits=num_splits,
                               warp_specialized=True, k_operand="e4m3", tiles_per_pass=1)


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU (H100/H200)")
@pytest.mark.parametrize("bits", (2, 4))
@pytest.mark.parametrize("lens,G,num_splits,fmt_kw,ctas", [
    ([5000, 700, 130], 4, None, {}, 2), ([700, 129, 1], 4, 7, {}, 2), ([2000, 3], 4, 3, {"sink": 2, "recent": 7}, 2),
    ([3000, 900], 3, 2, {}, 1)])
def test_two_tiles_a_pass_against_the_oracle_gpu(pass_switch, bits, lens, G, num_splits, fmt_kw, ctas):
    """Two tiles of one token group a pass (one fold for both): lengths past, at and short of a pass, splits of
    a tile or two, windows, a padded head at one CTA an SM (three kernels a bit width and fold)."""
    from _cases import cute_against_the_oracle
    fmt = foscar.KVFormat(bits=bits, k_axis="channel", **{"head_dim": 128, "group_size": 128, **fmt_kw})
    cute_against_the_oracle(fmt, lens, G, "channel-wise K, E4M3 terms, two tiles a pass: error",
                               num_splits=num_splits, warp_specialized=True, k_operand="e4m3", tiles_per_pass=2,
                               ctas_per_sm=ctas)


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU (H100/H200)")
@pytest.mark.parametrize("bits", (2, 4))
@pytest.mark.parametrize("stages,ctas", [(4, 2), (8, 2), (16, 1)])
def test_the_producer_fold_over_deep_rings_gpu(monkeypatch, bits, stages, ctas):
    """``Q'`` folded by the producer, a buffer a pass, over rings of 4-16 stages a consumer (each wrapped many times
    by a split of one sequence; INT4 at 8 stages and two CTAs past an SM's shared memory: refused by name)."""
    from _cases import cute_against_the_oracle
    from foscar.cute.budget import fits_shared_memory
    with cute_switches(monkeypatch, CHANNEL_K_E4M3=True, PRODUCER_Q_FOLD=True):
        fmt = foscar.KVFormat(bits=bits, head_dim=128, group_size=128, k_axis="channel")
        launch = dict(num_splits=1, warp_specialized=True, k_operand="e4m3", tiles_per_pass=2, ctas_per_sm=ctas,
                      stages=stages)
        if not fits_shared_memory(config_for(fmt, 4, 64, "e4m3", 2, stages=stages), ctas):
            with pytest.raises(UnsupportedError, match="stages"):
                cute_against_the_oracle(fmt, [700], 4, "", **launch)
            return
        cute_against_the_oracle(fmt, [5000, 700, 130], 4, f"Q' by the producer, {stages} stages: error", **launch)


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU (H100/H200)")
@pytest.mark.parametrize("bits", (2, 4))
def test_the_producer_fold_over_long_splits_replays_in_a_graph_gpu(monkeypatch, bits):
    """``Q'`` folded by the producer over splits of 96 tiles, as the benchmarks run it: a CUDA graph replayed 12 times
    with 512 MiB written between replays (each TMA copy of a stage lands on a barrier some thread waits for, so no
    copy outlives its stage's next use or the CTA): every replay bit for bit the eager decode, which is within the
    kernels' bound of the float64 oracle."""
    import torch
    from _cases import make
    from _helpers import bf16_attention, kernel_error_bound, rel
    from foscar.bench import as_graph
    from foscar.cute.launch import decode
    with cute_switches(monkeypatch, CHANNEL_K_E4M3=True, PRODUCER_Q_FOLD=True):
        fmt = foscar.KVFormat(bits=bits, head_dim=128, group_size=128, k_axis="channel")
        q, cache = make(fmt, [6144, 6100, 3000, 6144, 5000, 6144, 4097, 6144], Hkv=8, G=4, page=64, seed=bits)
        out = torch.full(q.shape, float("nan"), dtype=torch.bfloat16, device=q.device)
        launch = dict(out=out, num_splits=1, warp_specialized=True, k_operand="e4m3", tiles_per_pass=2, ctas_per_sm=2)
        decode(q, cache, **launch)
        eager = out.clone()
        exact = foscar.decode_exact(q, cache)
        assert torch.isfinite(eager).all()
        assert rel(eager, exact) <= kernel_error_bound(fmt, rel(bf16_attention(q, cache, sdpa=True), exact))
        replay = as_graph(lambda: decode(q, cache, **launch))
        flush = torch.empty(512 * 2 ** 20, dtype=torch.uint8, device=q.device)
        for i in range(12):
            flush.fill_(i)
            out.fill_(float("nan"))
            replay()
            torch.cuda.synchronize()
            assert torch.equal(out, eager), f"replay {i}"


@cute.jit
def _term_offsets_mismatched(head_dim: cutlass.Constexpr, out: cutlass.Constexpr):
    """Every word :func:`foscar.cute.fold_terms.store_hoisted` addresses in two buffers of ``Q'`` (each term's
    column of each head at each padding ``gp``) against the swizzled layout's own offset (appended to ``out`` where
    they differ)."""
    layout = sq_layout_e4m3(head_dim, 8, 2)
    buffers = SimpleNamespace(layout=layout.outer)
    stride = cute.crd2idx((0, 0, 1), layout.outer)
    for gp in cutlass.range_constexpr(3):
        for h in cutlass.range_constexpr(1 << gp):
            for blk in cutlass.range_constexpr(head_dim // 32):  # the words of a row, eight a block of 32 bytes
                for j in cutlass.range_constexpr(8):
                    for b in cutlass.range_constexpr(2):
                        k = 8 * blk + j
                        hi = term_word_offset(head_dim, buffers, h, k)
                        lo = hi ^ term_word_offset(head_dim, buffers, 1 << gp, 0)
                        for col, off in ((h, hi), ((1 << gp) + h, lo)):
                            if cutlass.const_expr(off + b * stride != cute.crd2idx((col, 4 * k, b), layout)):
                                out.append((gp, col, k, b))


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_term_words_land_where_the_swizzled_layout_puts_them(head_dim):
    """The fold's stores address a word from its thread's swizzled offset within a buffer (the lo term's a bit
    flip of the hi term's) plus the buffer's offset, all but the last hoisted out of the pass loop: the same byte
    as the layout's own swizzled offset, every column, word and buffer."""
    out = []
    _term_offsets_mismatched(head_dim, out)
    assert out == []


@pytest.mark.parametrize("bits", [2, 4])
def test_the_fp16_split_for_sm90a(monkeypatch, bits):
    """``FOLD_F16_SPLIT``: the fold's E4M3 terms from FP16 pairs (``cvt.rn.satfinite.e4m3x2.f16x2``, no FP32 pair
    left in the fold), and no local memory."""
    fmt = foscar.KVFormat(bits=bits, head_dim=128, group_size=128, k_axis="channel")
    with cute_switches(monkeypatch, CHANNEL_K_E4M3=True, FOLD_F16_SPLIT=True):
        cfg = config_for(fmt, 4, 64, "e4m3", 2)
        assert cfg.fold_f16_split
        ptx = compile_stage1(cfg, keep_ptx=True, warp_specialized=True, ctas_per_sm=2).__ptx__
    copies = consumer_code_paths(cfg, 2)
    assert len(re.findall(r"cvt\.rn\.satfinite\.e4m3x2\.f16x2", ptx)) == 4 * copies
    assert not re.search(r"cvt\.rn\.satfinite\.e4m3x2\.f32", ptx)
    assert not re.search(r"\b(ld|st)\.local", ptx), "local memory (spills) in the kernel"
