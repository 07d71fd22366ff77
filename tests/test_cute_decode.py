"""The CuTe DSL Hopper kernels (v0 and v1) with BF16 K operands, 8 to 32 query rows, three consumers, CUDA graphs,
the split heuristic, contiguous caches. CPU: each compiles for sm_90a, and its PTX has the register-A wgmma of both
products and no local memory. GPU (sm_90): against the float64 oracle, no worse than BF16 attention on the same
dequantized cache. The kernels' variants (E4M3 K, two tiles a pass, ...): ``test_cute_variants.py``."""
import os
import re

import pytest
import torch

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")  # compile for Hopper without a GPU
pytest.importorskip("cutlass", reason="needs nvidia-cutlass-dsl (pip install -e '.[test]')")

import foscar  # noqa: E402
from _cases import HOPPER, WGMMA_RS, cute_against_the_oracle, sum_block_mmas  # noqa: E402
from _helpers import V_MAGNITUDES, cute_switches  # noqa: E402
from foscar.cute.compile import compile_stage1  # noqa: E402
from foscar.cute.config import config_for, consumer_code_paths, consumers_for  # noqa: E402
from foscar.errors import UnsupportedError  # noqa: E402


@pytest.mark.parametrize("head_dim", (64, 128))
@pytest.mark.parametrize("bits", (2, 4))
def test_compiles_for_sm90a(bits, head_dim):
    cfg = config_for(foscar.KVFormat(bits=bits, head_dim=head_dim, group_size=head_dim), 4, 64)
    ptx = compile_stage1(cfg, keep_ptx=True).__ptx__
    mmas = WGMMA_RS.findall(ptx)
    kb = head_dim // 16
    assert sum(op == "bf16" for op, _ in mmas) == kb, "S^T = K Q^T: one wgmma per k16 block of the head dim"
    assert sum(op == "f16" for op, _ in mmas) == (head_dim // 64) * 4, "O^T = V^T P^T: m64 halves x k16 blocks"
    assert all(len(a.split(",")) == 4 for _, a in mmas), "A from registers: four 32-bit registers"
    assert len(re.findall(r"wgmma\.mma_async", ptx)) == len(mmas)
    assert not re.search(r"\b(ld|st)\.local", ptx), "local memory (spills) in the kernel"
    assert "fence.proxy.async" in ptx, "P^T stored to shared memory must be fenced before the wgmma reads it"


@pytest.mark.parametrize("ws", (pytest.param(False, marks=pytest.mark.slow), True), ids=("v0", "v1"))  # v0: slow
@pytest.mark.parametrize("head_dim,page", [(64, 64), (128, 64), (128, 256)])
@pytest.mark.parametrize("bits", (2, 4))
@pytest.mark.parametrize("k_axis,v_axis", [("channel", "token"), ("token", "channel"), ("channel", "channel")])
def test_channel_wise_axes_compile_for_sm90a(k_axis, v_axis, bits, head_dim, page, ws):
    """Channel-wise K (the operand-fold Q' = Q s' rebuilt per token group in shared memory) and channel-wise
    V (the acc-fold of each tile's PV partial per channel): the same products, no spills; pages shorter
    or longer than a group."""
    fmt = foscar.KVFormat(bits=bits, head_dim=head_dim, group_size=head_dim, k_axis=k_axis, v_axis=v_axis)
    cfg = config_for(fmt, 4, page)
    if k_axis == v_axis == "channel" and head_dim == 128:  # token groups of 64 tokens: one tile per group
        config_for(foscar.KVFormat(bits=bits, head_dim=128, group_size=64, k_axis=k_axis, v_axis=v_axis), 4, page)
    ptx = compile_stage1(cfg, keep_ptx=True, warp_specialized=ws).__ptx__
    copies = consumer_code_paths(cfg, 1) if ws else 1  # copies of the consumers' code
    assert len(WGMMA_RS.findall(ptx)) == copies * (head_dim // 16 + (head_dim // 64) * 4 + sum_block_mmas(cfg))
    assert len(re.findall(r"cp\.async\.bulk\.tensor", ptx)) == (4 if ws else 0)
    assert not re.search(r"\b(ld|st)\.local", ptx), "local memory (spills) in the kernel"


@pytest.mark.parametrize("ws", (False, True), ids=("v0", "v1"))
@pytest.mark.parametrize("bits", (2, 4))
@pytest.mark.parametrize("k_axis,v_axis", [("token", "token"), ("channel", "token"), ("token", "channel")])
def test_two_channel_groups_compile_for_sm90a(k_axis, v_axis, bits, ws):
    """g = 64 at head dim 128: token-wise K as two group-local partials, token-wise V as two P' operands
    (one per m64 half of V^T); the same number of wgmma, no spills."""
    cfg = config_for(foscar.KVFormat(bits=bits, head_dim=128, group_size=64, k_axis=k_axis, v_axis=v_axis), 4, 64)
    ptx = compile_stage1(cfg, keep_ptx=True, warp_specialized=ws).__ptx__
    assert len(WGMMA_RS.findall(ptx)) == (consumer_code_paths(cfg, 1) if ws else 1) * (128 // 16 + 2 * 4
                                                                                        + sum_block_mmas(cfg))
    assert not re.search(r"\b(ld|st)\.local", ptx), "local memory (spills) in the kernel"


@pytest.mark.parametrize("ctas", (1, 2))
@pytest.mark.parametrize("head_dim", (64, 128))
@pytest.mark.parametrize("bits", (2, 4))
def test_warp_specialized_variant_compiles_for_sm90a(bits, head_dim, ctas):
    """v1: one producer warpgroup issuing four TMA copies per tile (K and V words, their (s', z')), two
    consumer warpgroups with the products of v0 each, register budgets moved by setmaxnreg (one or two
    CTAs per SM), no spills."""
    from foscar.cute.config import WS_REGISTERS
    cfg = config_for(foscar.KVFormat(bits=bits, head_dim=head_dim, group_size=head_dim), 4, 64)
    ptx = compile_stage1(cfg, keep_ptx=True, warp_specialized=True, ctas_per_sm=ctas).__ptx__
    producer, consumer = WS_REGISTERS[ctas]
    assert re.search(rf"\.minnctapersm {ctas}\b", ptx)
    assert len(re.findall(r"cp\.async\.bulk\.tensor\.\dd\.shared::cta\.global", ptx)) == 4
    mmas = WGMMA_RS.findall(ptx)
    per_consumer = head_dim // 16 + (head_dim // 64) * 4
    paths = consumer_code_paths(cfg, ctas)  # 8 columns: one copy of the consumers' code
    assert len(mmas) == paths * per_consumer and len(re.findall(r"wgmma\.mma_async", ptx)) == len(mmas)
    assert re.search(rf"setmaxnreg\.dec\.sync\.aligned\.u32\s+{producer}\b", ptx)
    assert len(re.findall(rf"setmaxnreg\.inc\.sync\.aligned\.u32\s+{consumer}\b", ptx)) == paths
    assert "mbarrier.try_wait" in ptx or "mbarrier.wait" in ptx
    assert not re.search(r"\b(ld|st)\.local", ptx), "local memory (spills) in the kernel"


def test_kept_ptx_leaves_no_files():
    """compile_stage1(keep_ptx=True) dumps the PTX into a temporary folder of its own: nothing appears in
    the current directory, nor in CuTe DSL's default dump folder (the current directory when cutlass was
    imported, unless CUTE_DSL_DUMP_DIR said otherwise), and the PTX is the compiled function's."""
    from cutlass.cutlass_dsl import CuTeDSL
    dump_dir = CuTeDSL._get_dsl().envar.dump_dir
    folders = {os.getcwd(), os.path.abspath(dump_dir)}
    before = {f: set(os.listdir(f)) for f in folders}
    cfg = config_for(foscar.KVFormat(bits=2, head_dim=64, group_size=64, k_axis="channel"), 1, 64)
    for ws in (False, True):
        ptx = compile_stage1(cfg, keep_ptx=True, warp_specialized=ws).__ptx__
        assert ptx.startswith("//") and ".visible .entry" in ptx
    artifacts = (".ptx", ".cubin", ".sass", ".mlir")
    for f in folders:
        assert not [n for n in set(os.listdir(f)) - before[f] if n.endswith(artifacts)], f


@pytest.mark.parametrize("kw,what", [({"group_size": 32}, "multiple of 64"),
                                     ({"group_size": 32, "k_axis": "channel", "v_axis": "channel"}, "multiple of 64")])
def test_unsupported_configurations_say_why(kw, what):
    args = {"bits": 4, "head_dim": 128, "group_size": 128, **kw}
    with pytest.raises(UnsupportedError, match=what):
        config_for(foscar.KVFormat(**args), 4, 64)
    with pytest.raises(UnsupportedError, match="gqa \\* q_len <= 32"):
        config_for(foscar.KVFormat(bits=4, head_dim=128, group_size=128), 64, 64)
    with pytest.raises(UnsupportedError, match="gqa \\* q_len <= 32"):
        config_for(foscar.KVFormat(bits=4, head_dim=128, group_size=128), 8, 64, step=5)
    windowed = config_for(foscar.KVFormat(bits=4, head_dim=128, group_size=128, recent=16), 4, 64, step=2)
    assert windowed.windows and windowed.causal  # a step over windows: tests/test_steps_windows.py
    with pytest.raises(UnsupportedError, match="pages of 64k"):
        config_for(foscar.KVFormat(bits=4, head_dim=128, group_size=128), 4, 48)


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU (H100/H200)")
@pytest.mark.parametrize("ws", (False, 1, 2), ids=("v0", "v1", "v1x2"))
@pytest.mark.parametrize("bits", (2, 4))
@pytest.mark.parametrize("lens,G,num_splits,windows", [
    ([8192, 4001, 129, 1], 4, None, {}), ([777, 64], 1, 2, {}), ([300], 8, 1, {}),
    ([3000, 5], 4, 3, {"sink": 4, "recent": 100}),
    ([5000, 700, 130], 4, None, {"k_axis": "channel"}), ([2000, 3], 8, 3, {"k_axis": "channel", "sink": 2, "recent": 7}),
    ([4100, 260], 4, None, {"v_axis": "channel"}), ([3000, 900], 1, 2, {"k_axis": "channel", "v_axis": "channel"}),
    ([2500, 64], 4, None, {"k_axis": "channel", "v_axis": "channel", "group_size": 64}),
    ([6000, 333, 1], 4, None, {"group_size": 64}), ([1500, 90], 8, 2, {"group_size": 64, "k_axis": "channel"})])
def test_against_the_oracle_gpu(bits, lens, G, num_splits, windows, ws):
    fmt = foscar.KVFormat(bits=bits, head_dim=128, **{"group_size": 128, **windows})
    cute_against_the_oracle(fmt, lens, G, "error", num_splits=num_splits, warp_specialized=bool(ws),
                               ctas_per_sm=ws or None)


@pytest.mark.parametrize("G,step,cols", [(1, 1, 8), (8, 1, 8), (9, 1, 16), (16, 1, 16), (17, 1, 32), (32, 1, 32),
                                         (4, 2, 8), (4, 4, 16), (4, 8, 32), (3, 3, 16)])
def test_query_rows_take_8_16_or_32_columns(G, step, cols):
    cfg = config_for(foscar.KVFormat(bits=2, head_dim=128, group_size=128), G, 64, step=step)
    assert (cfg.rows, cfg.cols, cfg.nb, cfg.acc_elems) == (G * step, cols, cols // 8, 128 * cols // 128)


@pytest.mark.parametrize("bits,cols,gqa", [  # two of them in CI, one a width (FOSCAR_SLOW=1: all; half a minute each)
    pytest.param(b, c, g, marks=[pytest.mark.slow] if (b, c, g) not in {(2, 16, 16), (4, 16, 4)} else [])
    for b in (2, 4) for c, g in ((16, 16), (32, 32), (16, 4))])
def test_sixteen_and_thirtytwo_columns_compile_for_sm90a(bits, cols, gqa):
    """v1 with N 16 and 32: every axis combination, one and two CTAs per SM (the tuner decides); a step of
    tokens beside the heads (``gqa`` 4: 4 tokens)."""
    fmts = [dict(), dict(k_axis="channel"), dict(v_axis="channel"), dict(group_size=64, head_dim=64)]
    for kw in fmts:
        fmt = foscar.KVFormat(bits=bits, **{"head_dim": 128, "group_size": 128, **kw})
        cfg = config_for(fmt, gqa, 64, step=cols // gqa if gqa == 4 and kw == {} else 1)
        for ctas in (1, 2):
            assert compile_stage1(cfg, warp_specialized=True, ctas_per_sm=ctas) is not None


def test_v0_takes_eight_columns_and_one_token():
    from foscar.cute.config import V0_LIMITS
    assert "one query token" in V0_LIMITS and "8 query heads" in V0_LIMITS


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU (H100/H200)")
@pytest.mark.parametrize("ctas", (1, 2))
@pytest.mark.parametrize("bits", (2, 4))
@pytest.mark.parametrize("lens,G,num_splits,windows", [
    ([5000, 129, 1], 16, None, {}), ([3000, 64], 32, 3, {}), ([2000, 700], 16, 2, {"k_axis": "channel"}),
    ([4100, 260], 32, None, {"v_axis": "channel"}), ([1500, 90], 16, None, {"group_size": 64}),
    ([3000, 5], 16, 3, {"sink": 4, "recent": 100}), ([700, 9], 12, None, {}),
    ([2500, 64], 32, None, {"k_axis": "channel", "v_axis": "channel", "group_size": 64})])
def test_sixteen_and_thirtytwo_heads_against_the_oracle_gpu(bits, lens, G, num_splits, windows, ctas):
    fmt = foscar.KVFormat(bits=bits, head_dim=128, **{"group_size": 128, **windows})
    cute_against_the_oracle(fmt, lens, G, f"GQA {G} error", num_splits=num_splits, warp_specialized=True,
                               ctas_per_sm=ctas)


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU (H100/H200)")
@pytest.mark.parametrize("G,ctas", [(32, 1), (16, 2)])
@pytest.mark.parametrize("where", ("k", "v"))
def test_sixteen_and_thirtytwo_heads_keep_a_nan_where_it_was_planted_gpu(G, ctas, where):
    """A NaN planted in one token's K or V scale (sequence 0, KV head 1, past the first tile, so that the lazy
    rescale's vote has thresholds by then): that KV head's rows of sequence 0 are NaN, every other row as without it,
    bit for bit. A NaN score passes no threshold and makes no rescale; its ``P`` and ``P'`` carry it to the output."""
    from _cases import make

    from foscar.cute.launch import decode
    fmt = foscar.KVFormat(bits=2, head_dim=128, group_size=128)
    q, cache = make(fmt, [3000, 900], Hkv=2, G=G, page=64, seed=7)
    launch = {"num_splits": 4, "warp_specialized": True, "ctas_per_sm": ctas, "k_operand": "e4m3"}
    clean = decode(q, cache, **launch)
    page = int(cache.page_table.block_table[0, 20])
    (cache.k_params if where == "k" else cache.v_params)[page, 1, 5, :, 0] = float("nan")  # token 20 * 64 + 5
    got = decode(q, cache, **launch)
    assert torch.isnan(got[0, G:]).all()
    assert torch.equal(got[0, :G], clean[0, :G]) and torch.equal(got[1], clean[1])


@pytest.fixture
def wide(monkeypatch):
    """The three-consumer variant (``foscar.cute.config.WIDE_CONSUMERS``) switched on, ``config_for``'s cache
    cleared around the test."""
    from _helpers import cute_switches
    with cute_switches(monkeypatch, WIDE_CONSUMERS=True):
        yield


def test_three_consumers_compile_for_sm90a(wide):
    """16 and 32 columns at one CTA an SM with the three-consumer switch: three consumer loops (one vote each; one
    copy of their code at 16 columns), the partials one a split and consumer; two CTAs an SM keep two consumers,
    and 8 columns never take three."""
    from foscar.cute.launch import num_parts, split_partials
    fmt = foscar.KVFormat(bits=2, head_dim=128, group_size=128)
    cfg = config_for(fmt, 32, 64, "e4m3")
    assert cfg.wide and consumers_for(cfg, 1) == 3 and consumers_for(cfg, 2) == 2
    cfg16 = config_for(fmt, 16, 64, "e4m3")
    assert cfg16.wide and consumers_for(cfg16, 1) == 3 and consumers_for(cfg16, 2) == 2
    assert not config_for(fmt, 8, 64, "e4m3").wide and not config_for(fmt, 4, 64, "e4m3", 2).wide
    ptx = compile_stage1(cfg, keep_ptx=True, warp_specialized=True, ctas_per_sm=1).__ptx__
    assert len(re.findall(r"bar\.red\.or\.pred", ptx)) == consumer_code_paths(cfg, 1) == 3
    ptx16 = compile_stage1(cfg16, keep_ptx=True, warp_specialized=True, ctas_per_sm=1).__ptx__
    assert len(re.findall(r"bar\.red\.or\.pred", ptx16)) == consumer_code_paths(cfg16, 1) == 1
    launch = {"warp_specialized": True, "ctas_per_sm": 1, "k_operand": "e4m3", "tiles_per_pass": 1}
    assert split_partials(fmt, 32, 64, 1, launch) == 3 and split_partials(fmt, 4, 64, 8, launch) == 3
    assert split_partials(fmt, 32, 64, 1, {**launch, "ctas_per_sm": 2}) == 2
    assert num_parts(fmt, 5, True, 3) == 15 and num_parts(fmt, 5, False, 3) == 5


@pytest.mark.parametrize("k_operand", ("bf16", "e4m3"))
def test_steps_of_32_columns_take_three_consumers_as_shipped(k_operand):
    """As shipped, a step (``q_len > 1``) of 32 columns runs three consumer warpgroups at one CTA an SM
    (``foscar.cute.config.WIDE_STEP_COLUMNS``), INT2 on a copy of their code each, INT4 on one
    (``ONE_COPY_BITS``); one token at 32 columns and a step of 16 columns keep two, and so does two CTAs an SM."""
    from foscar.cute import config
    assert config.WIDE_STEP_COLUMNS == (32,) and not config.WIDE_CONSUMERS
    assert config.ONE_COPY_BITS == (4,) and config.ONE_COPY_CONSUMERS == (3,)
    for bits, copies in ((2, 3), (4, 1)):
        fmt = foscar.KVFormat(bits=bits, head_dim=128, group_size=128)
        for gqa, step in ((4, 8), (16, 2), (8, 4)):
            cfg = config_for(fmt, gqa, 64, k_operand, 1, step)
            assert cfg.cols == 32 and cfg.wide and consumers_for(cfg, 1) == 3 and consumers_for(cfg, 2) == 2
            assert consumer_code_paths(cfg, 1) == copies and consumer_code_paths(cfg, 2) == 2
    assert not config_for(fmt, 32, 64, k_operand).wide and not config_for(fmt, 4, 64, k_operand, 1, 4).wide
    channel = foscar.KVFormat(bits=2, head_dim=128, group_size=64, k_axis="channel", v_axis="channel")
    assert config_for(channel, 4, 64, "bf16", 1, 8).wide  # a token group within a tile: one pass a group


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU (H100/H200)")
@pytest.mark.parametrize("bits", (2, 4))
@pytest.mark.parametrize("lens,G,num_splits,fmt_kw,k_operand", [
    ([3000, 64], 32, 3, {}, "e4m3"), ([4100, 260, 1], 32, None, {}, "bf16"),
    ([2500, 64], 32, None, {"v_axis": "channel"}, "bf16"), ([1500, 90], 32, 2, {"group_size": 64}, "bf16"),
    ([3000, 5], 24, 3, {"sink": 4, "recent": 100}, "e4m3"), ([3000, 64], 16, 3, {}, "e4m3"),
    ([4100, 77], 12, None, {"v_axis": "channel"}, "e4m3")])
def test_three_consumers_against_the_oracle_gpu(wide, bits, lens, G, num_splits, fmt_kw, k_operand):
    fmt = foscar.KVFormat(bits=bits, head_dim=128, **{"group_size": 128, **fmt_kw})
    cute_against_the_oracle(fmt, lens, G, f"GQA {G}, three consumers, error", num_splits=num_splits,
                               warp_specialized=True, ctas_per_sm=1, k_operand=k_operand)


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU (H100/H200)")
@pytest.mark.parametrize("bits", (2, 4))
@pytest.mark.parametrize("G,T,lens,num_splits,k_operand", [
    (32, 1, [3000, 64], 3, "e4m3"), (32, 1, [4100, 77, 1], None, "bf16"), (16, 2, None, 2, None)])
def test_consumers_on_one_copy_of_their_code_against_the_oracle_gpu(monkeypatch, bits, G, T, lens, num_splits,
                                                                    k_operand):
    """32 columns at one CTA an SM with the consumers on one copy of their code (``ONE_COPY_BITS``): two
    consumers (one token at GQA 32, ``lens`` at ``k_operand``) and three (a step of 2 at GQA 16, as ``auto``
    launches it; a step of 8 at GQA 4: ``test_cute_wgmma.py``)."""
    from _cases import cute_step_against_the_oracle
    fmt = foscar.KVFormat(bits=bits, head_dim=128, group_size=128)
    with cute_switches(monkeypatch, ONE_COPY_BITS=(2, 4), ONE_COPY_CONSUMERS=(2, 3)):
        assert consumer_code_paths(config_for(fmt, G, 64, k_operand or "e4m3", 1, T), 1) == 1
        if T == 1:
            cute_against_the_oracle(fmt, lens, G, f"GQA {G}, one copy, error", num_splits=num_splits,
                                    warp_specialized=True, ctas_per_sm=1, k_operand=k_operand)
        else:
            cute_step_against_the_oracle(bits, G, T, num_splits, {})


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU (H100/H200)")
@pytest.mark.parametrize("ws", (False, True), ids=("v0", "v1"))
def test_cuda_graph_replay_gpu(ws):
    """The kernel launches on torch's current stream, so a CUDA graph captures it: a replay over new
    query values gives the eager result bit for bit."""
    from _cases import make

    from foscar.cute.launch import decode
    fmt = foscar.KVFormat(bits=4, head_dim=128, group_size=128)
    q, cache = make(fmt, [5000, 700], Hkv=2, G=4, page=64, seed=3)
    out = torch.full(q.shape, float("nan"), dtype=torch.bfloat16, device=q.device)
    decode(q, cache, out=out, num_splits=4, warp_specialized=ws)  # compile and warm up
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        decode(q, cache, out=out, num_splits=4, warp_specialized=ws)
    q.copy_(torch.randn_like(q))
    out.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, decode(q, cache, num_splits=4, warp_specialized=ws))


@pytest.mark.parametrize("B,L,want", [(8, 8192, 8), (64, 8192, 1), (1, 8192, 64), (8, 131072, 8), (64, 131072, 4),
                                      (64, 65536, 2), (8, 524288, 16), (1, 131072, 64), (1, 64, 1)])
def test_default_split_count_fills_one_wave(monkeypatch, B, L, want):
    """The split rule on an H200 (132 SMs; v0: four resident CTAs each): one wave while its splits hold at most
    512 tiles, else splits of about 512 tiles, up to four waves."""
    from foscar import splitkv
    from foscar.cute import launch
    monkeypatch.setattr(splitkv, "sm_count", lambda device: 132)
    assert launch.default_num_splits(B, 8, L // 64, torch.device("cuda")) == want
    # v1 at two CTAs per SM (half v0's resident CTAs): the counts the tuner chose on the H200 (tune-cute.log)
    v1 = {(8, 8192): 4, (8, 131072): 4, (1, 131072): 33, (64, 65536): 2, (8, 524288): 16, (64, 8192): 1}
    if (B, L) in v1:
        assert launch.default_num_splits(B, 8, L // 64, torch.device("cuda"), resident=2) == v1[(B, L)]
    windowed = foscar.KVFormat(bits=4, head_dim=128, group_size=128, sink=4, recent=8)
    assert launch.num_parts(windowed, want) == want  # the combine attends the windows (COMBINE_WINDOWS)
    monkeypatch.setattr("foscar.cute.config.COMBINE_WINDOWS", False)
    assert launch.num_parts(windowed, want) == want + 2  # else their partials follow the splits'
    assert launch.num_parts(foscar.KVFormat(bits=4, head_dim=128, group_size=128), want, True) == 2 * want


@pytest.mark.parametrize("cluster", (0, 16))
def test_stage1_tensors_are_checked_by_name(cluster):
    """The compiled kernels take unit-stride tensors on 16-byte aligned bases (TVM-FFI placeholders): a
    tensor that is not is refused by its name before the call (the partials', or the output's and the LSE's where
    the splits merge in a cluster)."""
    import dataclasses

    from foscar.cute.config import ALIGN
    from foscar.cute.launch import _check_stage1_tensors, stage1_tensors
    cfg = dataclasses.replace(config_for(foscar.KVFormat(bits=2, head_dim=128, group_size=128), 4, 64), cluster=cluster)
    specs = stage1_tensors(cfg)
    good = [torch.zeros((4,) * rank, dtype=torch.float32) for _, _, rank in specs]
    _check_stage1_tensors(good, cfg)
    for i, (name, _, rank) in enumerate(specs):
        bad = list(good)
        bad[i] = torch.zeros((4,) * (rank - 1) + (8,))[..., ::2]  # stride 2 in the last dim
        with pytest.raises(UnsupportedError, match=rf"^{name}: .*unit stride"):
            _check_stage1_tensors(bad, cfg)
        bad[i] = torch.zeros(4 ** rank + 1)[1:].view((4,) * rank)  # 4 bytes past an aligned base
        assert bad[i].data_ptr() % ALIGN
        with pytest.raises(UnsupportedError, match=rf"^{name}: .*{ALIGN}-byte aligned"):
            _check_stage1_tensors(bad, cfg)


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU (H100/H200)")
@pytest.mark.parametrize("ws", (False, True), ids=("v0", "v1"))
def test_auto_plans_the_cute_kernel_and_a_graph_replays_it_gpu(monkeypatch, ws):
    """On Hopper with cutlass-dsl, backend='auto' runs the CuTe kernel (either variant as the default); a
    plan holds its workspace, so a CUDA graph of plan.run allocates nothing and replays the eager result bit
    for bit, whatever the lengths."""
    from _cases import make

    from foscar import autotune
    from foscar.cute import launch
    monkeypatch.setattr(launch, "DEFAULT_WARP_SPECIALIZED", ws)
    monkeypatch.setattr(autotune, "tuned_config", lambda *a: {})  # the variant from the default, not the H200 file
    fmt = foscar.KVFormat(bits=2, head_dim=128, group_size=128, sink=4, recent=64)
    q, cache = make(fmt, [3000, 64, 1], Hkv=2, G=4, page=64, seed=5)
    p = foscar.plan(q, cache)
    assert p.backend == "cute" and p.workspace is not None and p.options["warp_specialized"] is ws
    assert p.workspace[0].shape[2] == (2 if ws else 1) * p.num_splits  # the combine attends the windows
    out = torch.full(q.shape, float("nan"), dtype=torch.bfloat16, device=q.device)
    lse = torch.full(q.shape[:2], float("nan"), dtype=torch.float32, device=q.device)
    p.run(q, cache, out, lse)  # compile and warm up
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        p.run(q, cache, out, lse)
    q.copy_(torch.randn_like(q))
    out.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    eager, eager_lse = foscar.decode(q, cache, return_lse=True, backend="cute", num_splits=p.num_splits)
    assert torch.equal(out, eager) and torch.equal(lse, eager_lse)
    exact = foscar.decode_exact(q, cache)
    assert float((out.double() - exact).norm() / exact.norm()) < 2e-2


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU (H100/H200)")
@pytest.mark.parametrize("ws", (False, True), ids=("v0", "v1"))
@pytest.mark.parametrize("windows", ({}, {"k_axis": "channel", "sink": 4, "recent": 16}, {"v_axis": "channel"}))
def test_contiguous_caches_gpu(ws, windows):
    """A contiguous cache (one page per sequence, its capacity whole 64-token tiles) through both variants:
    against the oracle, as the paged ones."""
    from _helpers import bf16_attention, kernel_error_bound, rel
    from _cases import make

    from foscar.cute.launch import decode
    fmt = foscar.KVFormat(bits=4, head_dim=128, **{"group_size": 128, **windows})
    q, cache = make(fmt, [2500, 700, 5], Hkv=2, G=4, seed=7)
    assert cache.contiguous and cache.page_size % 64 == 0
    out = torch.full(q.shape, float("nan"), dtype=torch.bfloat16, device=q.device)
    decode(q, cache, out=out, warp_specialized=ws)
    exact = foscar.decode_exact(q, cache)
    assert rel(out, exact) <= kernel_error_bound(cache.fmt, rel(bf16_attention(q, cache, sdpa=True), exact))


def test_contiguous_caches_are_whole_tiles():
    """Every contiguous cache foscar makes has a capacity of whole 64-token tiles, so the CuTe kernels take it."""
    for bits, kw in ((4, {}), (2, {}), (4, {"k_axis": "channel", "group_size": 128})):
        fmt = foscar.KVFormat(bits=bits, head_dim=128, **{"group_size": 128, **kw})
        cache = foscar.quantize_kv(torch.randn(2, 1, 70, 128), torch.randn(2, 1, 70, 128), fmt)
        assert cache.contiguous and cache.page_size % 64 == 0
        config_for(fmt, 4, cache.page_size)  # supported
        assert foscar.QuantKVCache.empty(fmt, 2, 1, max_len=100, page_size=None).page_size % 64 == 0


def test_the_power_of_two_reciprocal_is_exact_for_every_sigma():
    """``folds.power_of_two_reciprocal`` (``0x7F000000`` minus the bits) is ``1 / sigma`` exactly for every
    power of two the P' units can take (``2^-126`` to ``2^126``), and ``y * (1 / sigma)`` rounds as
    ``y / sigma`` does, subnormal results included (float32, every exponent, random ``y``)."""
    e = torch.arange(-126, 127)
    sigma = torch.pow(torch.tensor(2.0, dtype=torch.float64), e.double()).float()
    recip = (torch.tensor(0x7F000000, dtype=torch.int32) - sigma.view(torch.int32)).view(torch.float32)
    assert torch.equal(recip.double(), 1.0 / sigma.double())
    y = torch.randn(4096, generator=torch.Generator().manual_seed(7)) * torch.logspace(-30, 30, 4096)
    for i in range(0, e.numel(), 9):
        assert torch.equal(y * recip[i], y / sigma[i])


def test_the_p_units_are_the_least_power_of_two_above_every_v_scale():
    """``folds.grow_sigma``'s bits (the exponent field, one up unless a power of two, capped at ``2^126``)
    give the least power of two >= ``bound`` for every normal and subnormal float32, 0 for 0, and the
    cap for ``inf``: ``P' = P s'_V / sigma`` stays within FP16 whatever the scales' magnitude."""
    from foscar.cute.folds import SIGMA_CAP_BITS
    x = torch.cat([torch.logspace(-45, 38.5, 20000, dtype=torch.float64).float(), torch.tensor([0.0, float("inf")]),
                   torch.pow(2.0, torch.arange(-149, 128).double()).float()])
    bits = x.view(torch.int32)
    up = (bits & 0x7F800000) + ((bits & 0x7FFFFF) != 0).to(torch.int32) * 0x00800000
    got = torch.minimum(up, torch.tensor(SIGMA_CAP_BITS, dtype=torch.int32)).view(torch.float32).double()
    xd = x.double()
    want = torch.where(xd > 0, torch.pow(2.0, torch.ceil(torch.log2(xd.clamp_min(1e-300)))), 0.0)
    want = torch.where(want < 2.0 ** -126, torch.where(xd > 0, 2.0 ** -126, 0.0), want).clamp_max(2.0 ** 126)
    assert torch.equal(got, want)


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU (H100/H200)")
@pytest.mark.parametrize("ws", (False, True), ids=("v0", "v1"))
@pytest.mark.parametrize("v_axis", ("token", "channel"))
@pytest.mark.parametrize("magnitude", V_MAGNITUDES)
def test_values_of_any_magnitude_gpu(magnitude, v_axis, ws):
    """V of any FP32 magnitude the library takes (its scales far from 1 either way), and constant V groups
    with an offset before tiny ones: every element within the kernels' bound of the float64 oracle,
    never flushed to the offset correction alone, never overflowing."""
    from _helpers import bf16_attention, kernel_error_bound, magnitude_cache, rel

    from foscar.cute.launch import decode
    fmt = foscar.KVFormat(bits=2, head_dim=64, group_size=64, v_axis=v_axis)
    q, cache = magnitude_cache(fmt, magnitude, "cuda")
    out = torch.full(q.shape, float("nan"), dtype=torch.float32, device=q.device)
    decode(q, cache, out=out, warp_specialized=ws)
    exact = foscar.decode_exact(q, cache)
    assert torch.isfinite(out).all()
    assert rel(out, exact) <= kernel_error_bound(fmt, rel(bf16_attention(q, cache, sdpa=True), exact))
