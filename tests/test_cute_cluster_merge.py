"""The split merge inside stage 1 (``foscar.cute.config.CLUSTER_MERGE``, ``Sm90Config.cluster``,
``foscar.cute.cluster``): a (sequence, KV head)'s splits one thread-block cluster, each CTA merging its slice of the
head dim from every CTA's partials through distributed shared memory, no combine launch. CPU: which launches take it
(one token or a step; the combine otherwise), what stage 1 then takes, its shared memory, the PTX's two cluster barriers
and remote loads, ptxas's report. GPU (sm_90): against the float64 oracle (NaN-poisoned outputs, the LSE too), at
1-16 splits, one and two CTAs an SM, three consumers, GQA 1-8, head dim 64, BF16/FP32 outputs; a NaN in one V scale
makes its rows NaN; a CUDA-graph replay equals the eager call."""
import dataclasses
import os
import re

import pytest
import torch

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")  # compile for Hopper without a GPU
pytest.importorskip("cutlass", reason="needs nvidia-cutlass-dsl (pip install -e '.[test]')")

import foscar  # noqa: E402
from _cases import HOPPER  # noqa: E402
from _helpers import assert_pipelined_without_spills, cute_switches  # noqa: E402
from foscar.cute.compile import compile_stage1  # noqa: E402
from foscar.cute.config import STAGE1_TENSORS, config_for, consumer_code_paths, consumers_for  # noqa: E402
from foscar.cute.launch import cluster_for, stage1_tensors  # noqa: E402

FMT = foscar.KVFormat(bits=2, head_dim=128, group_size=128)


def _out(dtype=torch.bfloat16, offset=0, step=1):
    buf = torch.empty(2 * 8 * 256 + 8, dtype=dtype)
    return buf[offset:offset + 2 * 8 * 256].view(2, 8, 256)[:, :, ::step][:, :, :128]


@pytest.mark.parametrize("fmt_kw,gqa,step,ws,splits,out,taken", [
    ({}, 4, 1, True, 16, {}, True), ({}, 4, 1, True, 2, {"dtype": torch.float32}, True),
    ({}, 4, 1, True, 5, {}, False), ({}, 4, 1, True, 32, {}, False), ({}, 4, 1, True, 1, {}, True),
    ({}, 4, 1, False, 16, {}, False), ({}, 4, 2, True, 16, {}, True), ({"recent": 16}, 4, 1, True, 16, {}, False),
    ({"rotation": "hadamard"}, 4, 1, True, 16, {}, False), ({}, 4, 1, True, 16, {"dtype": torch.float64}, False),
    ({}, 4, 1, True, 16, {"step": 2}, False), ({}, 4, 1, True, 16, {"offset": 1}, False),
    ({"head_dim": 64, "group_size": 64}, 8, 1, True, 16, {}, True), ({"scheme": "nvfp4"}, 4, 1, True, 16, {}, False),
    ({}, 4, 8, True, 4, {}, False)])
def test_a_launch_merges_in_a_cluster_where_it_can(monkeypatch, fmt_kw, gqa, step, ws, splits, out, taken):
    """No windows, no rotation, 1-16 splits (a power of two: one, the consumers' partials alone), an output stage 1
    can write, one code path for every consumer (not 32 columns: a copy a consumer); anything else runs the combine,
    as without the switch."""
    if "scheme" in fmt_kw:
        fmt = foscar.KVFormat.fp4(fmt_kw["scheme"], 128)
    else:
        fmt = foscar.KVFormat(**{"bits": 2, "head_dim": 128, "group_size": 128, **fmt_kw})
    cfg = config_for(fmt, gqa, 64, "e4m3" if gqa * step > 4 else "bf16", 1, step)
    o = _out(**out)[..., :fmt.head_dim]
    lse = torch.empty(2, 8)
    assert cluster_for(cfg, ws, 2, splits, o, lse) == 0  # off by default
    with cute_switches(monkeypatch, CLUSTER_MERGE=True):
        assert cluster_for(cfg, ws, 2, splits, o, lse) == (splits if taken else 0)
        assert cluster_for(cfg, ws, 2, splits, o, None) == 0  # nowhere to write the LSE: the combine
        assert cluster_for(cfg, ws, 2, splits, o, torch.empty(2, 16)[:, ::2]) == 0


def test_stage1_takes_the_output_and_its_lse_in_place_of_the_partials():
    cfg = config_for(FMT, 4, 64, "e4m3", 2)
    assert stage1_tensors(cfg) == STAGE1_TENSORS
    merged = dict((n, (t, r)) for n, t, r in stage1_tensors(dataclasses.replace(cfg, cluster=16, cluster_out="f32")))
    assert merged["out"] == ("f32", 3) and merged["lse"] == ("f32", 2)
    assert "partial_out" not in merged and "partial_lse" not in merged


def test_the_partials_shared_memory_is_budgeted():
    from foscar.cute.budget import shared_bytes
    cfg = config_for(FMT, 4, 64, "e4m3", 2)
    grown = shared_bytes(dataclasses.replace(cfg, cluster=16), 3) - shared_bytes(cfg, 3)
    assert grown == 3 * cfg.cols * (cfg.head_dim + 1) * 4 + 16  # and the merge's two mbarriers


def test_a_cluster_merge_at_two_ctas_runs_without_qk_zeroing():
    """``as_run``: the merge's registers and the zeroing atom's spill together at two CTAs an SM; at one CTA, and
    without a cluster, the kernel keeps the zeroing."""
    from foscar.cute.config import as_run
    cfg = config_for(FMT, 4, 64, "e4m3", 2)
    clustered = dataclasses.replace(cfg, cluster=16)
    assert cfg.qk_zeroing and as_run(cfg, 2) is cfg and as_run(clustered, 1) is clustered
    assert not as_run(clustered, 2).qk_zeroing and as_run(clustered, 2).cluster == 16


@pytest.mark.parametrize("bits,gqa,tiles,ctas,size,out,wide", [
    (2, 4, 2, 2, 16, "bf16", False), (4, 4, 2, 1, 16, "f32", False), (2, 1, 2, 2, 4, "bf16", False),
    (2, 4, 2, 1, 8, "bf16", True), (4, 4, 2, 2, 1, "bf16", False)])
def test_the_cluster_kernel_compiles_pipelined_without_spills(monkeypatch, bits, gqa, tiles, ctas, size, out, wide):
    """One cluster barrier (every thread arrives, relaxed, past the merge's mbarriers' initialisation; the
    consumers wait on it once), each CTA's arrival on every CTA's two mbarriers (the partials written, then read),
    one remote load per partial's LSE and output element a thread merges; ptxas keeps the wgmma pipelined and spills
    nothing."""
    fmt = foscar.KVFormat(bits=bits, head_dim=128, group_size=128)
    with cute_switches(monkeypatch, WIDE_EIGHT_COLUMNS=wide):
        cfg = dataclasses.replace(config_for(fmt, gqa, 64, "e4m3", tiles), cluster=size, cluster_out=out)
        ptx = compile_stage1(cfg, keep_ptx=True, warp_specialized=True, ctas_per_sm=ctas).__ptx__
        assert_pipelined_without_spills(cfg, ctas)
    paths = consumer_code_paths(cfg, ctas)  # a merge in each consumer code path
    assert len(re.findall(r"barrier\.cluster\.arrive\.relaxed", ptx)) == len(re.findall(r"barrier\.cluster\.arrive", ptx)) == 1
    assert len(re.findall(r"barrier\.cluster\.wait", ptx)) == paths
    assert len(re.findall(r"mbarrier\.arrive\.release\.cluster\.shared::cluster", ptx)) == 2 * size * paths
    consumers = consumers_for(cfg, ctas)
    per_thread = -(-gqa * cfg.head_dim // size // (consumers * 128))
    assert len(re.findall(r"ld\.shared::cluster", ptx)) == 2 * size * consumers * per_thread


def _merged_against_the_oracle(fmt, lens, G, *, out_dtype=torch.bfloat16, want_lse=True, **launch):
    from _helpers import bf16_attention, kernel_error_bound, rel
    from _cases import make

    from foscar.cute.launch import decode
    q, cache = make(fmt, lens, Hkv=2, G=G, page=64, seed=fmt.bits + G)
    out = torch.full(q.shape, float("nan"), dtype=out_dtype, device=q.device)
    lse = torch.full(q.shape[:2], float("nan"), dtype=torch.float32, device=q.device) if want_lse else None
    decode(q, cache, out=out, lse=lse, warp_specialized=True, **launch)
    exact, lse_exact = foscar.decode_exact(q, cache, return_lse=True)
    assert torch.isfinite(out).all()
    err, base = rel(out, exact), rel(bf16_attention(q, cache, sdpa=True), exact)
    print(f"\nGQA {G}, {launch}: error {err:.3e}  BF16 attention {base:.3e}")
    assert err <= kernel_error_bound(fmt, base)
    if want_lse:
        assert torch.isfinite(lse).all() and float((lse.double() - lse_exact).abs().max()) <= 1e-2
    return q, cache, out


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU (H100/H200)")
@pytest.mark.parametrize("bits", (2, 4))
@pytest.mark.parametrize("G,lens,splits,ctas,k_operand,tiles,fmt_kw,out_dtype,want_lse", [
    (4, [8192, 700, 1], 16, 2, "e4m3", 2, {}, torch.bfloat16, True),  # splits without a tile, one of one token
    (4, [8192, 700, 1], 16, 1, "e4m3", 2, {}, torch.float32, False),
    (8, [3000, 64], 8, 2, "e4m3", 1, {}, torch.bfloat16, True),
    (1, [5000, 333], 4, 2, "e4m3", 2, {}, torch.bfloat16, True),
    (4, [2000, 77], 2, 2, "bf16", 1, {"group_size": 64}, torch.bfloat16, True),
    (4, [3000, 640], 1, 2, "e4m3", 2, {}, torch.bfloat16, True),  # one split: the consumers' partials alone
    (4, [1000, 64], 16, 1, "e4m3", 2, {"head_dim": 64, "group_size": 64}, torch.bfloat16, True),
    (4, [6000, 129], 8, 2, "e4m3", 1, {"v_axis": "channel"}, torch.float16, True)])
def test_the_cluster_merge_against_the_oracle_gpu(monkeypatch, bits, G, lens, splits, ctas, k_operand, tiles, fmt_kw,
                                                  out_dtype, want_lse):
    fmt = foscar.KVFormat(bits=bits, **{"head_dim": 128, "group_size": 128, **fmt_kw})
    with cute_switches(monkeypatch, CLUSTER_MERGE=True):
        _merged_against_the_oracle(fmt, lens, G, out_dtype=out_dtype, want_lse=want_lse, num_splits=splits,
                                   ctas_per_sm=ctas, k_operand=k_operand, tiles_per_pass=tiles)


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU (H100/H200)")
@pytest.mark.parametrize("bits", (2, 4))
@pytest.mark.parametrize("G,T,num_splits", [(4, 2, 16), (4, 4, 8), (4, 8, 4), (2, 3, 1)])
def test_steps_merged_in_a_cluster_against_the_oracle_gpu(monkeypatch, bits, G, T, num_splits):
    """A step's columns (8 and 16: one consumer code path) merged in the cluster into the step's rows, the causal
    limits per column; at 32 (a code path a consumer) the launch leaves the merge to the combine."""
    from _cases import cute_step_against_the_oracle
    with cute_switches(monkeypatch, CLUSTER_MERGE=True):
        cute_step_against_the_oracle(bits, G, T, num_splits, {})


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU (H100/H200)")
@pytest.mark.parametrize("bits", (2, 4))
def test_the_cluster_merge_of_three_consumers_against_the_oracle_gpu(monkeypatch, bits):
    fmt = foscar.KVFormat(bits=bits, head_dim=128, group_size=128)
    with cute_switches(monkeypatch, CLUSTER_MERGE=True, WIDE_EIGHT_COLUMNS=True):
        _merged_against_the_oracle(fmt, [8192, 700, 1], 4, num_splits=16, ctas_per_sm=1, k_operand="e4m3",
                                   tiles_per_pass=2)


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU (H100/H200)")
def test_a_nan_v_scale_makes_its_rows_nan_not_a_plausible_number_gpu(monkeypatch):
    """A NaN planted in one token's V scale (sequence 0, KV head 1): that KV head's rows of sequence 0 are NaN,
    every other row finite and as without it."""
    from _cases import make

    from foscar.cute.launch import decode
    fmt = foscar.KVFormat(bits=4, head_dim=128, group_size=128)
    q, cache = make(fmt, [3000, 900], Hkv=2, G=4, page=64, seed=5)
    launch = {"num_splits": 8, "warp_specialized": True, "ctas_per_sm": 2, "k_operand": "e4m3", "tiles_per_pass": 2}
    with cute_switches(monkeypatch, CLUSTER_MERGE=True):
        clean = decode(q, cache, **launch)
        page = int(cache.page_table.block_table[0, 20])
        cache.v_params[page, 1, 5, :, 0] = float("nan")  # token 20 * 64 + 5 of sequence 0, KV head 1
        got = decode(q, cache, **launch)
    assert torch.isnan(got[0, 4:8]).all()
    assert torch.isfinite(got[0, :4]).all() and torch.isfinite(got[1]).all()
    assert torch.equal(got[0, :4], clean[0, :4]) and torch.equal(got[1], clean[1])


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU (H100/H200)")
def test_the_cluster_merge_replays_in_a_graph_gpu(monkeypatch):
    """A CUDA-graph replay of ``foscar.decode`` through a plan (the switch on) equals its eager call bit for bit."""
    from _cases import make

    from foscar.bench import as_graph
    fmt = foscar.KVFormat(bits=2, head_dim=128, group_size=128)
    q, cache = make(fmt, [4000, 900, 17], Hkv=2, G=4, page=64, seed=3)
    with cute_switches(monkeypatch, CLUSTER_MERGE=True):
        plan = foscar.plan(q, cache, backend="cute", num_splits=8)
        out = plan.run(q, cache)
        again = torch.full_like(out, float("nan"))
        replay = as_graph(lambda: plan.run(q, cache, out=again))
        replay()
        torch.cuda.synchronize()
    assert torch.isfinite(out).all() and torch.equal(again, out)


@pytest.mark.parametrize("bits", (2, 4))
def test_a_steps_cluster_kernel_compiles_pipelined_without_spills(bits):
    """A step of 8 tokens at GQA 4 (32 columns: three consumers, INT2 on a copy of their code each and of the merge,
    INT4 on one, ``ONE_COPY_BITS``): one cluster barrier's arrival in the prologue, its wait and the remote
    arrivals in each copy of the consumers' code. (A launch merges in a cluster only where the consumers run one
    code path: ``foscar.cute.launch.merges_in_one_code_path``.) P' scaled per element, without the FP16 pairs and
    their vote: with them, INT4's cluster kernel (the merge is off) spills 4 bytes."""
    fmt = foscar.KVFormat(bits=bits, head_dim=128, group_size=128)
    cfg = dataclasses.replace(config_for(fmt, 4, 64, "e4m3", 1, 8), cluster=4, pair_p_scale=False, pair_vote=False)
    ptx = compile_stage1(cfg, keep_ptx=True, warp_specialized=True, ctas_per_sm=1).__ptx__
    assert_pipelined_without_spills(cfg, 1)
    paths = consumer_code_paths(cfg, 1)
    assert consumers_for(cfg, 1) == 3 and paths == (3 if bits == 2 else 1)
    assert len(re.findall(r"barrier\.cluster\.arrive", ptx)) == 1
    assert len(re.findall(r"barrier\.cluster\.wait", ptx)) == paths
    assert len(re.findall(r"mbarrier\.arrive\.release\.cluster\.shared::cluster", ptx)) == 2 * 4 * paths
