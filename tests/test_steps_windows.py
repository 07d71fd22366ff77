"""Decode steps of several tokens (``q [B, q_len, Hq, D]``) over caches with BF16 windows: a sink, a recent ring,
or the ring of a channel-wise axis's incomplete group. The step's tokens are appended first; token ``j`` reads the
first ``L - q_len + 1 + j`` of the ``L`` tokens as a one-token decode at that length would (the windows of that
length, which a ring with ``KVFormat.rollback >= q_len - 1`` still holds), what ``decode_exact`` computes: a step is
the one-token decodes of its tokens. The folded spec (hypothesis, float64), the reference backend, the Triton
kernels (the interpreter on a CPU machine) and the CuTe kernels (sm_90a compiles here, the oracle on a GPU) are held
to it; a step of more rows than a CuTe kernel's columns runs in parts of its tokens."""
import dataclasses
import os

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")  # compile for Hopper without a GPU

import pytest  # noqa: E402
import torch  # noqa: E402
from _cases import DEV, GPU, HOPPER, check_windowed_step, make_step, step_format  # noqa: E402
from _helpers import rel  # noqa: E402
from hypothesis import HealthCheck, example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from _strategies import PAPER, build, decode_case  # noqa: E402

import foscar  # noqa: E402
from foscar.errors import InvalidArgumentError, UnsupportedError  # noqa: E402


@st.composite
def step_case(draw, fp4: bool = False):
    """A case of ``tests/test_fold.py`` (every format, windows included) with a step of ``T`` tokens, every
    length at least ``T``."""
    case = draw(decode_case(fp4))
    T = draw(st.integers(1, 8))
    fmt = case["fmt"]
    if fmt.recent_capacity:  # a ring keeps the step's windows
        fmt = dataclasses.replace(fmt, rollback=draw(st.sampled_from((T - 1, 8))))
    return {**case, "fmt": fmt, "T": T, "lens": [max(n, T) for n in case["lens"]]}


def step_query(case, cache) -> torch.Tensor:
    """A step's query ``[B, T, Hq, D]`` (logits O(1), as ``build``'s)."""
    gen = torch.Generator().manual_seed(case["seed"] + 1)
    B, D = cache.batch_size, cache.head_dim
    q = torch.randn(B, case["T"], cache.num_kv_heads * case["G"], D, generator=gen, dtype=torch.float64)
    return (q / case["k_mag"]).float()


WINDOWED = {**PAPER, "fmt": foscar.KVFormat(bits=2, head_dim=64, group_size=32, k_axis="channel", sink=3, recent=5,
                                             rollback=3), "lens": [4, 33, 300], "T": 4, "page": 32, "splits": 3}


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(step_case())
@example(WINDOWED)
@example({**WINDOWED, "lens": [8, 9], "T": 8, "fmt": foscar.KVFormat(bits=4, head_dim=64, group_size=64, sink=6)})
@example({**WINDOWED, "fmt": foscar.KVFormat(bits=4, head_dim=64, group_size=64, v_axis="channel", recent=2,
                                             rollback=8)})
def test_the_folded_step_is_the_oracles(case):
    """``decode_folded(q [B, T, Hq, D])`` (each KV head's rows its heads times the step's tokens, each row's
    quantized tokens up to its length's quantized count, each token over its length's windows) is the oracle's
    step within 1e-10 in float64, and the one-token decodes of the causal view's rows (the cache cut at each
    token, on the same ring) as the folded spec runs them; the step's last token is a one-token decode of the cache
    (within 1e-13)."""
    from foscar.multitoken import causal_view
    _, cache = build(case)
    q = step_query(case, cache)
    exact, lse_e = foscar.decode_exact(q, cache, return_lse=True)
    folded, lse_f = foscar.decode_folded(q, cache, tile_tokens=case["tile"], num_splits=case["splits"],
                                         return_lse=True)
    assert folded.shape == q.shape and lse_f.shape == q.shape[:3]
    assert bool(torch.isfinite(folded).all()) and rel(folded, exact) <= 1e-10
    assert float((lse_f - lse_e).abs().max()) <= 1e-10 * max(1.0, float(lse_e.abs().max()))
    rows = foscar.decode_folded(q.reshape(-1, *q.shape[2:]), causal_view(cache, case["T"]), tile_tokens=case["tile"])
    assert rel(rows.view(q.shape), exact) <= 1e-10
    last = foscar.decode_exact(q[:, -1], cache)  # a rotated cache's inverse rotation (BLAS) over another batch
    # shape (the causal view's rows) sums in another order: equal to about 1e-15, not bit for bit
    assert rel(exact[:, -1], last) <= 1e-13, rel(exact[:, -1], last)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(step_case(fp4=True))
@example({**WINDOWED, "fmt": foscar.KVFormat.fp4("nvfp4", 64, sink=2, recent=16, rollback=7)})
def test_the_fp4_folded_step_is_the_oracles(case):
    _, cache = build(case)
    q = step_query(case, cache)
    exact = foscar.decode_exact(q, cache)
    folded = foscar.decode_folded(q, cache, tile_tokens=case["tile"], num_splits=case["splits"])
    assert bool(torch.isfinite(folded).all()) and rel(folded, exact) <= 1e-10


#: windowed formats: a sink; a recent window; channel-wise K (its group's ring); channel-wise K and V with a sink
#: and a window; FP4 blocks with a window
FORMATS = [dict(bits=4, group_size=64, sink=4), dict(bits=2, group_size=64, recent=16, rollback=2),
           dict(bits=2, group_size=64, k_axis="channel", rollback=8),
           dict(bits=4, group_size=64, k_axis="channel", v_axis="channel", sink=3, recent=5, rollback=4),
           dict(scheme="nvfp4", recent=8, rollback=8)]


@pytest.mark.parametrize("kw", FORMATS)
@pytest.mark.parametrize("backend", ("reference", "triton"))
def test_a_step_over_windows_is_the_oracles(kw, backend):
    """``foscar.decode`` of a step over a windowed cache, the reference and the Triton kernels (stage 1's causal
    limit on the quantized tokens' positions, the windows' kernel with the step's rows), the merge in stage 1's
    epilogue and as a kernel of its own: NaN-poisoned outputs written, the oracle's output and LSE (the
    interpreter's arithmetic: 1e-5; the GPU's, 1e-2). Lengths: the step alone (its first token sees part of the
    sink), a step within the ring, one across a flush, long."""
    import foscar.triton as ft
    fmt = step_format(kw)
    status = {s.name: s for s in foscar.backend_status(DEV, fmt, 4)}
    if not status[backend].usable and (GPU or backend != "triton"):  # a CPU machine: the interpreter
        pytest.skip(status[backend].why)
    T = 3
    q, cache = make_step(fmt, [T, 9, 70, 161], T, seed=T)
    exact, lse_exact = foscar.decode_exact(q, cache, return_lse=True)
    runs = ((True, False) if backend == "triton" else (None,))
    for fused in runs:
        out = torch.full(q.shape, float("nan"), dtype=torch.float32, device=q.device)
        lse = torch.full(q.shape[:3], float("nan"), device=q.device)
        if fused is None:
            foscar.decode(q, cache, out=out, lse=lse, backend=backend)
        else:
            ft.decode(q, cache, out=out, lse=lse, num_splits=3, fused_combine=fused)
        assert bool(torch.isfinite(out).all()) and bool(torch.isfinite(lse).all())
        bound = 1e-2 if GPU or backend == "reference" else 1e-5
        assert rel(out, exact) < bound
        assert float((lse.double() - lse_exact).abs().max()) < bound * 10


def test_a_one_token_query_with_a_step_axis_keeps_it():
    """``q [B, 1, Hq, D]`` is a step of one token: ``out [B, 1, Hq, D]``, from every entry point."""
    import foscar.triton as ft
    fmt = foscar.KVFormat(bits=4, head_dim=64, group_size=64, recent=8)
    q, cache = make_step(fmt, [5, 70], 1)
    assert ft.decode(q, cache).shape == q.shape
    assert foscar.decode(q, cache).shape == q.shape
    assert foscar.decode_folded(q, cache).shape == q.shape


def test_a_ring_that_cannot_hold_the_steps_windows_is_refused():
    """A step over a ring reads each token's window, which a ring without ``rollback >= q_len - 1`` lost: refused by
    name, by the backends and the oracle alike; a ring that keeps them but was built without the step's tokens
    (``from_quantized`` holds the window alone) is refused where the lengths are read."""
    from foscar.multitoken import causal_view
    fmt = foscar.KVFormat(bits=4, head_dim=64, group_size=64, k_axis="channel")
    q, cache = make_step(fmt, [30, 40], 2)
    for call in (lambda: causal_view(cache, 2), lambda: foscar.decode(q, cache), lambda: foscar.decode_exact(q, cache)):
        with pytest.raises(UnsupportedError, match=r"rollback >= 1\)"):
            call()
    kept = foscar.KVFormat(bits=4, head_dim=64, group_size=64, k_axis="channel", rollback=1)
    q, cache = make_step(kept, [64, 70], 2)  # the first token's window: the group that the second one completed
    foscar.decode_exact(q, cache)  # quantize_kv fills the ring as appends do
    cache.ring_from.copy_(kept.split_length(cache.seq_lens)[1])  # a ring that holds its window alone
    if not GPU:
        with pytest.raises(InvalidArgumentError, match="^cache: expected a ring that holds the windows"):
            foscar.decode(q, cache)


def test_auto_gives_a_ring_step_to_a_backend_that_takes_it(monkeypatch):
    """On a CUDA device ``auto`` takes the CuTe kernel for a step over a ring where it takes such steps as its
    columns (:data:`foscar.cute.config.WINDOWED_STEPS`), else the Triton kernel (the causal view's rows would copy
    the ring once per token); a step over a sink alone, and one token, stay with the CuTe kernel."""
    from _helpers import cute_switches

    import foscar.api as api
    from foscar import backends
    from foscar.api import BackendStatus, _fmt_values, _select
    for name in ("triton", "cute"):
        monkeypatch.setattr(backends.get(name), "status", lambda key, n=name: BackendStatus(n, True, "Fake GPU"))
    ring, sink = (foscar.KVFormat(bits=4, head_dim=128, group_size=128, k_axis="channel", rollback=8),
                  foscar.KVFormat(bits=4, head_dim=128, group_size=128, sink=4))
    for on, want in ((False, "triton"), (True, "cute")):
        with cute_switches(monkeypatch, WINDOWED_STEPS=on):
            api.clear_selection_cache()
            assert _select("cuda:0", _fmt_values(ring), 4, 64, "auto", "auto", True) == want
            assert _select("cuda:0", _fmt_values(ring), 4, 64, "auto", "auto", False) == "cute"
            assert _select("cuda:0", _fmt_values(sink), 4, 64, "auto", "auto", False) == "cute"
    api.clear_selection_cache()


def test_a_step_of_more_rows_than_the_columns_runs_in_parts():
    from foscar.cute.launch import step_parts
    assert step_parts(4, 8, 32) == [(0, 8)]
    assert step_parts(8, 8, 32) == [(0, 4), (4, 4)]
    assert step_parts(2, 8, 8) == [(0, 4), (4, 4)]
    assert step_parts(8, 3, 8) == [(0, 1), (1, 1), (2, 1)]
    assert step_parts(16, 5, 32) == [(0, 2), (2, 2), (4, 1)]


CUTE = [  # (format, gqa, step, tail)
    (dict(bits=2, group_size=128, sink=4, recent=16, rollback=8), 4, 4, 0),
    (dict(bits=4, group_size=128, k_axis="channel", rollback=8), 4, 2, 0),
    (dict(bits=2, group_size=128, k_axis="channel", v_axis="channel", recent=8, rollback=8), 8, 4, 4),
    (dict(bits=4, group_size=128, sink=4), 8, 1, 3),  # a part of one token of a longer step
    (dict(scheme="nvfp4", recent=8, rollback=8), 2, 4, 0)]


@pytest.mark.parametrize("kw,gqa,step,tail", CUTE)
def test_the_cute_kernels_of_a_windowed_step_compile(kw, gqa, step, tail):
    """v1 with a step's columns over a windowed format (the causal limit from the sequence's end, less ``tail``
    for a part of a longer step) and the combine that attends the windows with the step's rows compile for
    sm_90a; a part takes one tile a pass."""
    pytest.importorskip("cutlass", reason="needs nvidia-cutlass-dsl (pip install -e '.[test]')")
    from foscar.cute.combine_config import CombineConfig
    from foscar.cute.compile import compile_combine, compile_stage1
    from foscar.cute.config import config_for
    from foscar.errors import UnsupportedError as Refused
    fmt = step_format(kw, 128)
    k_operand = "e4m3" if gqa * step > 4 and not fmt.is_fp4 and fmt.k_axis == "token" else "bf16"
    cfg = config_for(fmt, gqa, 64, k_operand, 1, step, tail=tail)
    assert cfg.causal and cfg.windows and cfg.tail == tail
    compile_stage1(cfg, warp_specialized=True, ctas_per_sm=1 if gqa * step > 16 else 2)
    if tail:
        with pytest.raises(Refused, match="two tiles per softmax pass"):
            config_for(fmt, gqa, 64, k_operand, 2, step, tail=tail)
    win = CombineConfig(128, "bf16", True, 16, False, sink=fmt.sink, recent=fmt.recent, flush=fmt.flush,
                        ring=fmt.recent_capacity, gqa=gqa, step=step, tail=tail)
    compile_combine(win)


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU (H100/H200)")
@pytest.mark.parametrize("kw,head_dim,G,T", [
    (dict(bits=2, group_size=128, sink=4, recent=16, rollback=8), 128, 4, 4),
    (dict(bits=4, group_size=128, k_axis="channel", rollback=8), 128, 4, 2),
    # 64 rows: 2 parts
    (dict(bits=2, group_size=128, k_axis="channel", v_axis="channel", recent=8, rollback=8), 128, 8, 8),
    (dict(bits=4, group_size=128), 128, 8, 8),  # no windows, in parts
    (dict(bits=4, group_size=128, sink=4, recent=32, rollback=8), 256, 2, 8),  # head dim 256: parts of 4 tokens
    (dict(bits=4, group_size=128, sink=4), 256, 8, 3),  # parts of one token
    (dict(scheme="nvfp4", recent=8, rollback=8), 128, 4, 4)])
@pytest.mark.parametrize("columns", (True, False))
def test_the_cute_kernel_takes_a_windowed_step_gpu(monkeypatch, kw, head_dim, G, T, columns):
    """The CuTe kernels over a windowed cache, as columns (:data:`WINDOWED_STEPS` on: stage 1's columns with each
    token's quantized count, the combine's window rows of each token's length, and steps of more rows than the
    columns in parts) or as the causal view's rows (off): NaN-poisoned outputs, every element within the kernels'
    bound of the float64 oracle (BF16 attention's error on the same cache), the LSE within 1e-2; a CUDA graph
    replays it."""
    from _helpers import cute_switches
    with cute_switches(monkeypatch, WINDOWED_STEPS=columns):
        check_windowed_step(kw, head_dim, G, T, "cute")


@pytest.mark.gpu
@pytest.mark.parametrize("kw,head_dim,G,T", [
    (dict(bits=2, group_size=64, sink=4, recent=16, rollback=8), 128, 4, 4),
    (dict(bits=4, group_size=64, k_axis="channel", v_axis="channel", recent=8, rollback=8), 128, 8, 8),
    (dict(bits=4, group_size=128, sink=4, recent=32, rollback=8), 256, 2, 8),
    (dict(scheme="nvfp4", recent=8, rollback=8), 128, 4, 4)])
def test_the_triton_kernel_takes_a_windowed_step_gpu(kw, head_dim, G, T):
    """The Triton kernels' steps over windows on the GPU (the interpreter's cases above, compiled): the same
    checks as the CuTe kernels'."""
    check_windowed_step(kw, head_dim, G, T, "triton")


COMPILE_WINDOWED = """
import sys
sys.path.insert(0, "benchmarks")
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from sass_stats import compile_stage1, resources
from foscar.format import KVFormat
from foscar.triton.bf16 import bf16_decode_stage1
for kw in (dict(sink=4, recent=16, rollback=8), dict(k_axis="channel", rollback=8)):
    print(resources(compile_stage1(KVFormat(bits=4, head_dim=128, group_size=128, **kw), q_len=3, G=4)))
ptr = dict(Q="*bf16", KB="*bf16", VB="*bf16", BT="*i32", START="*i32", LEN="*i32", OP="*fp32", LP="*fp32")
ints = ("stride_qb stride_qh stride_kp stride_kh stride_kt stride_vp stride_vh stride_vt stride_btb stride_opb "
        "stride_oph stride_ops stride_lpb stride_lph PART0").split()
for window, tail in ((1, 0), (2, 0), (2, 2)):
    cx = dict(D=128, G=4, BLOCK_H=16, BLOCK_N=16, PAGE=33, IDENTITY_PAGES=True, WRAP=window == 2, INTERPRET=False,
              WINDOW=window, SINK=4, RECENT=16, FLUSH=1, STEP=3, TAIL=tail)
    sig = dict(ptr, qk_scale="fp32", **{s: "i32" for s in ints}, **{k: "constexpr" for k in cx})
    src = ASTSource(fn=bf16_decode_stage1, signature=sig, constexprs=cx)
    print(resources(triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": 2})))
"""


def test_the_triton_kernels_of_a_windowed_step_compile_for_sm90():
    """Stage 1 with a step's per-row limits over windowed formats, and the windows' kernel with a step's rows (the
    sink, the ring, a part of a longer step), compile for sm_90 with Triton's bundled ptxas (no GPU; out of the
    interpreter the CPU tests run the kernels in), without spilling."""
    import re
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=str(root))
    out = subprocess.run([sys.executable, "-c", COMPILE_WINDOWED], env=env, cwd=root, capture_output=True, text=True,
                         timeout=600, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    stacks = re.findall(r"'stack': (\d+)", out.stdout)
    assert len(stacks) == 5 and set(stacks) == {"0"}, out.stdout


@pytest.mark.parametrize("kw,G,T,rows", [(dict(bits=4, group_size=64, k_axis="channel", rollback=8), 8, 8, 32),
                                         (dict(bits=2, group_size=64, sink=3, recent=5, rollback=8), 2, 7, 8),
                                         (dict(bits=4, group_size=64), 8, 3, 8)])
def test_a_step_in_parts_is_the_step(monkeypatch, kw, G, T, rows):
    """The CuTe launcher's parts of a step (:func:`foscar.cute.launch._run_parts`) on the CPU, each part's launch
    replaced by the oracle of a step ending ``tail`` tokens early: the parts' rows copied in and their outputs and
    LSEs copied out make the whole step's."""
    import copy

    import foscar.cute.launch as launch
    from foscar.multitoken import step_problem

    def oracle_part(part, *, tail=0, **_):
        B, n = part.cache.batch_size, part.q_len
        cut = copy.copy(part.cache)
        cut.seq_lens = part.cache.seq_lens - tail
        o, s = foscar.decode_exact(part.q.view(B, n, *part.q.shape[1:]), cut, return_lse=True)
        part.out.copy_(o.reshape(part.out.shape))
        part.lse.copy_(s.reshape(part.lse.shape))

    fmt = step_format(kw)
    q, cache = make_step(fmt, [T, 70, 161], T, Hkv=1, G=G, seed=T)
    problem = step_problem(q, cache, out=torch.full(q.shape, float("nan")), lse=torch.full(q.shape[:3], float("nan")))
    parts = launch.step_parts(G, T, rows)
    assert len(parts) > 1
    monkeypatch.setattr(launch, "run", oracle_part)
    launch._run_parts(problem, parts, 0)
    exact, lse = foscar.decode_exact(q, cache, return_lse=True)
    assert rel(problem.out.view(q.shape), exact) < 1e-6
    assert float((problem.lse.view(q.shape[:3]).double() - lse).abs().max()) < 1e-5
