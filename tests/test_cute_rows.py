"""The rows kernel (:mod:`foscar.cute.kernel_rows`: the query rows as the M of ``S = Q K^T`` and ``O = P' V``).
CPU: it compiles for sm_90a with the products it names and no local memory; the fragment positions it relies on
(the accumulator of ``S`` is the A fragment of ``P'``, a thread's rows) are CuTe's; the shapes it does not take are
refused by name. GPU (sm_90): against the float64 oracle, no worse than BF16 attention, outputs NaN-poisoned."""
import os
import re

import pytest
import torch

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
pytest.importorskip("cutlass", reason="needs nvidia-cutlass-dsl (pip install -e '.[test]')")

import foscar  # noqa: E402
from foscar.cute.compile import compile_stage1  # noqa: E402
from foscar.cute.config_rows import default_rows_m, rows_config, takes_rows  # noqa: E402
from foscar.errors import InvalidArgumentError, UnsupportedError  # noqa: E402

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
WGMMA = re.compile(r"wgmma\.mma_async\.sync\.aligned\.m64n(\d+)k16\.f32\.(bf16|f16)\.\2\s+\{[^}]*\},\s*\{([^}]*)\}")


@pytest.mark.parametrize("bits,head_dim,gqa,step", [(2, 128, 32, 1), (4, 128, 16, 1), (2, 64, 4, 8),
                                                    pytest.param(4, 128, 4, 4, marks=pytest.mark.slow)])
def test_rows_kernel_compiles_for_sm90a(bits, head_dim, gqa, step):
    """Per consumer: ``S = Q K^T`` as ``D / 16`` wgmma ``m64n64k16`` BF16 and ``O = P' V`` as 4 ``m64n{D}k16`` FP16,
    A (Q, P') from registers; no local memory; the built operands fenced for the wgmma's proxy."""
    cfg = rows_config(foscar.KVFormat(bits=bits, head_dim=head_dim, group_size=head_dim), gqa, 64, step)
    ptx = compile_stage1(cfg, keep_ptx=True, warp_specialized=True).__ptx__
    mmas = WGMMA.findall(ptx)
    assert sorted(set((n, t) for n, t, _ in mmas)) == sorted({("64", "bf16"), (str(head_dim), "f16")})
    assert sum(t == "bf16" for _, t, _ in mmas) == 2 * head_dim // 16
    assert sum(t == "f16" for _, t, _ in mmas) == 2 * 4
    assert all(len(a.split(",")) == 4 for _, _, a in mmas), "A from registers: four 32-bit registers"
    assert len(re.findall(r"wgmma\.mma_async", ptx)) == len(mmas)
    assert not re.search(r"\b(ld|st)\.local", ptx), "local memory (spills) in the kernel"
    assert "fence.proxy.async" in ptx


def test_the_accumulator_of_s_is_the_a_fragment_of_p():
    """A thread's element ``e`` of the 64 x 64 ``S`` accumulator is element ``e`` of the 64 x 64 A fragment of
    ``O = P' V`` (the same row and token), and its rows are ``16 warp + lane // 4`` and that plus 8: what the
    kernel writes ``P'`` and reads a row by."""
    from foscar.cute.fragment import rs_accumulator_ownership, trace_a_ownership
    from foscar.cute.kernel_rows import rows_mmas
    cfg = rows_config(foscar.KVFormat(bits=2, head_dim=128, group_size=128), 32, 64)
    acc = rs_accumulator_ownership(64, 64, lambda: rows_mmas(cfg)[0])  # [128, 32, (row, col)]
    a = trace_a_ownership(lambda: rows_mmas(cfg)[1], 64, 64, 2)  # [128, 16 registers, 2 halves, (row, k)]
    assert torch.equal(a.reshape(128, 32, 2), acc)
    t = torch.arange(128)
    for e in range(32):
        assert torch.equal(acc[:, e, 0], 16 * (t // 32) + (t % 32) // 4 + 8 * ((e // 2) % 2))
        assert torch.equal(acc[:, e, 1], 8 * (e // 4) + 2 * (t % 4) + e % 2)


@pytest.mark.parametrize("kw,gqa,step", [({"k_axis": "channel"}, 32, 1), ({"v_axis": "channel"}, 32, 1),
                                         ({"group_size": 64}, 32, 1), ({"head_dim": 256}, 8, 1),
                                         ({"rotation": "hadamard"}, 32, 1), ({}, 64, 1), ({}, 8, 5)])
def test_rows_kernel_says_what_it_takes(kw, gqa, step):
    fmt = foscar.KVFormat(**{"bits": 2, "head_dim": 128, "group_size": kw.get("head_dim", 128), **kw})
    with pytest.raises(UnsupportedError):
        rows_config(fmt, gqa, 64, step)
    assert not takes_rows(fmt, gqa, 64, step) and not default_rows_m(fmt, gqa, 64, step)


def test_rows_kernel_is_the_default_from_17_rows():
    fmt = foscar.KVFormat(bits=2, head_dim=128, group_size=128)
    assert [default_rows_m(fmt, g, 64) for g in (4, 8, 16, 17, 24, 32)] == [False] * 3 + [True] * 3
    assert default_rows_m(fmt, 4, 64, step=8) and not default_rows_m(fmt, 4, 64, step=4)


def test_rows_m_refuses_other_variants_by_name():
    from test_triton import make

    from foscar.cute.launch import launch_config
    fmt = foscar.KVFormat(bits=2, head_dim=128, group_size=128)
    q, cache = make(fmt, [300], Hkv=1, G=32, page=64, device="cpu")
    kw = {"use_tuned": False, "num_splits": 4}
    with pytest.raises(InvalidArgumentError, match="^rows_m"):
        launch_config(q, cache, 32, rows_m=True, ctas_per_sm=2, **kw)
    with pytest.raises(InvalidArgumentError, match="^rows_m"):
        launch_config(q, cache, 32, rows_m="yes", **kw)
    assert launch_config(q, cache, 32, **kw).rows_m
    assert not launch_config(q, cache, 32, ctas_per_sm=2, **kw).rows_m


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU (H100/H200)")
@pytest.mark.parametrize("bits", (2, 4))
@pytest.mark.parametrize("lens,G,T,num_splits,fmt_kw", [
    ([8192, 4001, 129, 1], 32, 1, None, {}), ([3000, 64], 16, 1, 3, {}), ([700, 9], 24, 1, None, {}),
    ([5000, 130], 32, 1, 64, {}), ([3000, 5], 32, 1, 3, {"sink": 4, "recent": 100}),
    ([2000, 77], 17, 1, None, {"head_dim": 64, "group_size": 64}),
    ([8, 64 * 7 + 7, 4099], 4, 8, None, {}), ([4, 64 * 7 + 3, 4099], 4, 4, 5, {}),
    ([3, 64 * 7 + 2, 1000], 8, 3, 64, {}), ([2, 130, 2000], 16, 2, None, {})])
def test_rows_kernel_against_the_oracle_gpu(bits, lens, G, T, num_splits, fmt_kw):
    """One token and steps of several (the causal limit per row; splits some rows see none of), GQA 16-32,
    windows, head dim 64: NaN-poisoned outputs, every element finite and within the kernels' bound of the
    float64 oracle (BF16 attention's error on the same dequantized cache), the LSE within 1e-2."""
    from _helpers import bf16_attention, kernel_error_bound, rel
    from test_multitoken import _cut, _step

    from foscar.cute.launch import run
    from foscar.multitoken import step_problem
    from foscar.problem import DecodeProblem
    fmt = foscar.KVFormat(bits=bits, **{"head_dim": 128, "group_size": 128, **fmt_kw})
    q, cache = _step(fmt, lens, T, Hkv=2, G=G, seed=bits + T + G)
    q = q if T > 1 else q[:, 0]
    out = torch.full(q.shape, float("nan"), dtype=torch.bfloat16, device=q.device)
    lse = torch.full(q.shape[:-1], float("nan"), device=q.device)
    build = step_problem if T > 1 else DecodeProblem.build
    run(build(q, cache, out=out, lse=lse, num_splits=num_splits), rows_m=True)
    assert bool(torch.isfinite(out).all()) and bool(torch.isfinite(lse).all())
    exact, lse_exact = foscar.decode_exact(q, cache, return_lse=True)
    if T > 1:
        base = torch.stack([bf16_attention(q[:, j], _cut(cache, [L - T + 1 + j for L in lens]), sdpa=True)
                            for j in range(T)], 1)
    else:
        base = bf16_attention(q, cache, sdpa=True)
    err, ref_err = rel(out, exact), rel(base, exact)
    print(f"\nrows kernel G {G} q_len {T}: error {err:.3e}  BF16 attention {ref_err:.3e}")
    assert err <= kernel_error_bound(fmt, ref_err)
    assert float((lse.double() - lse_exact).abs().max()) <= 1e-2


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU (H100/H200)")
@pytest.mark.parametrize("magnitude", (1e-30, 1e-12, 1e12, 1e24, "constant-then-tiny"))
def test_rows_kernel_values_of_any_magnitude_gpu(magnitude):
    from _helpers import bf16_attention, kernel_error_bound, magnitude_cache, rel

    from foscar.cute.launch import decode
    fmt = foscar.KVFormat(bits=2, head_dim=64, group_size=64)
    q, cache = magnitude_cache(fmt, magnitude, "cuda")
    q = q.repeat_interleave(8, dim=1)  # GQA 32
    out = torch.full(q.shape, float("nan"), dtype=torch.float32, device=q.device)
    decode(q, cache, out=out, rows_m=True)
    exact = foscar.decode_exact(q, cache)
    assert torch.isfinite(out).all()
    assert rel(out, exact) <= kernel_error_bound(fmt, rel(bf16_attention(q, cache, sdpa=True), exact))
