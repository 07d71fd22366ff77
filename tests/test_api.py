"""``foscar.decode``: backend selection, explicit choices that cannot run, the custom op under
``torch.compile`` (CPU, reference backend), and on the GPU CUDA-graph capture and replay."""
import subprocess
import sys

import pytest
import torch
from _helpers import rel

import foscar
from foscar import backends
from foscar.bench import as_graph
from foscar.errors import InvalidArgumentError, UnsupportedError

from _cases import GPU


def make(lens=(300, 129), Hkv=2, G=4, D=64, device="cpu", **fmt_kw):
    gen = torch.Generator().manual_seed(sum(lens))
    B, L = len(lens), max(lens)
    k = torch.randn(B, Hkv, L, D, generator=gen)
    v = torch.randn(B, Hkv, L, D, generator=gen)
    q = torch.randn(B, Hkv * G, D, generator=gen).bfloat16()
    fmt = foscar.KVFormat(**{"bits": 4, "head_dim": D, "group_size": D, **fmt_kw})
    cache = foscar.quantize_kv(k, v, fmt, seq_lens=torch.tensor(lens), page_size=64)
    return q, cache


def test_auto_on_the_cpu_is_the_reference():
    q, cache = make()
    assert foscar.select_backend(q, cache) == "reference"
    out = torch.full(q.shape, float("nan"), dtype=torch.float32)
    lse = torch.full(q.shape[:2], float("nan"))
    o, l_ = foscar.decode(q, cache, out=out, lse=lse)
    assert o is out and l_ is lse
    spec, spec_lse = foscar.decode_folded(q, cache, operand_dtype=torch.bfloat16, pv_operand_dtype=torch.float16,
                                          dtype=torch.float32, return_lse=True)
    assert torch.equal(out, spec) and torch.equal(lse, spec_lse)
    exact, lse_exact = foscar.decode_exact(q, cache, return_lse=True)
    assert rel(out, exact) < 5e-3 and float((lse.double() - lse_exact).abs().max()) < 1e-3
    plain = foscar.decode(q, cache)
    assert plain.dtype == torch.bfloat16 and plain.shape == q.shape


@pytest.mark.parametrize("name", ("triton", "cute"))
def test_an_explicit_backend_that_cannot_run_says_why(name, monkeypatch):
    q, cache = make()
    with pytest.raises(UnsupportedError, match=rf"^backend={name!r}: .*needs an? (sm_90|CUDA) GPU"):
        foscar.decode(q, cache, backend=name)
    monkeypatch.setenv("FOSCAR_BACKEND", name)
    with pytest.raises(UnsupportedError, match=rf"^FOSCAR_BACKEND={name!r}: "):
        foscar.decode(q, cache)
    assert foscar.decode(q, cache, backend="reference").shape == q.shape  # an explicit argument wins


def test_bad_choices_name_the_argument(monkeypatch):
    q, cache = make()
    with pytest.raises(InvalidArgumentError, match="^backend: expected 'auto' or one of"):
        foscar.decode(q, cache, backend="fast")
    monkeypatch.setenv("FOSCAR_BACKEND", "fast")
    with pytest.raises(InvalidArgumentError, match="^FOSCAR_BACKEND: expected"):
        foscar.decode(q, cache)
    monkeypatch.delenv("FOSCAR_BACKEND")
    with pytest.raises(InvalidArgumentError, match="^num_splits: expected"):
        foscar.decode(q, cache, num_splits=0)
    with pytest.raises(InvalidArgumentError, match="^out: expected"):
        foscar.decode(q, cache, out=torch.empty(1, 2, 3))
    with pytest.raises(InvalidArgumentError, match="^lse: expected"):
        foscar.decode(q, cache, lse=torch.empty(2, 8, dtype=torch.float64))


def test_backend_status_lists_every_backend_with_a_reason():
    status = {s.name: s for s in foscar.backend_status("cpu")}
    assert set(status) == {"cute", "triton", "reference"}
    assert status["reference"].usable and not status["triton"].usable and not status["cute"].usable
    assert all(s.why for s in status.values())


def test_torch_compile_traces_a_decode_step_without_graph_breaks():
    q, cache = make(lens=(200,), Hkv=1, G=2)
    eager = foscar.decode(q, cache)
    step = torch.compile(lambda x: foscar.decode(x, cache) * 2, fullgraph=True)
    assert torch.equal(step(q), eager * 2)


def test_the_selection_is_marked_constant_as_torch_compiler_marks_it():
    """``api._select`` carries the mark ``torch.compiler.assume_constant_result`` gives (set without
    importing Dynamo), and nothing else."""
    from foscar.api import _constant_for_compile, _select

    def plain():
        return 1

    def marked():
        return 1
    torch.compiler.assume_constant_result(marked)
    mine = _constant_for_compile(lambda: 1)
    assert vars(mine) == vars(marked) != vars(plain)
    assert {k: v for k, v in vars(_select).items() if not k.startswith("__")} == vars(marked)


def test_importing_foscar_does_not_import_dynamo():
    """``import foscar`` leaves ``torch._dynamo`` unimported (seconds of a serving process's start)."""
    code = "import sys, foscar; print('torch._dynamo' in sys.modules)"
    got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert got == "False"


def test_auto_prefers_cute_then_triton(monkeypatch):
    """backend='auto' on a CUDA device: the CuTe kernel where it can run (Hopper, cutlass-dsl, a supported
    format) and was measured faster (all but INT2 channel-wise K and V with token groups of 64), else Triton; the
    reference only on the CPU."""
    import foscar.api as api
    from foscar.api import BackendStatus, _select, _fmt_values
    fmt = foscar.KVFormat(bits=4, head_dim=128, group_size=128)
    triton_ok = lambda key: BackendStatus("triton", True, "Fake GPU")  # noqa: E731
    monkeypatch.setattr(backends.get("triton"), "status", triton_ok)
    for cute_ok, want in ((True, "cute"), (False, "triton")):
        monkeypatch.setattr(backends.get("cute"), "status", lambda key, ok=cute_ok: BackendStatus("cute", ok, "x"))
        api.clear_selection_cache()  # the choices are cached per process
        assert _select("cuda:0", _fmt_values(fmt), 4, 64, "auto", "auto") == want
        k_chan = foscar.KVFormat(bits=4, head_dim=128, group_size=128, k_axis="channel")
        assert _select("cuda:0", _fmt_values(k_chan), 4, 64, "auto", "auto") == want
        chan = foscar.KVFormat(bits=2, head_dim=128, group_size=64, k_axis="channel", v_axis="channel")
        assert _select("cuda:0", _fmt_values(chan), 4, 64, "auto", "auto") == "triton"  # measured faster there
        chan128 = foscar.KVFormat(bits=2, head_dim=128, group_size=128, k_axis="channel", v_axis="channel")
        assert _select("cuda:0", _fmt_values(chan128), 4, 64, "auto", "auto") == want
        chan4 = foscar.KVFormat(bits=4, head_dim=128, group_size=128, k_axis="channel", v_axis="channel")
        assert _select("cuda:0", _fmt_values(chan4), 4, 64, "auto", "auto") == want
        v_chan = foscar.KVFormat(bits=4, head_dim=128, group_size=128, v_axis="channel")
        assert _select("cuda:0", _fmt_values(v_chan), 4, 64, "auto", "auto") == want
        if cute_ok:  # an explicit choice still runs it
            assert _select("cuda:0", _fmt_values(chan), 4, 64, "cute", "auto") == "cute"


def test_the_backend_choice_is_made_once_per_call_signature(monkeypatch):
    """The status checks (imports looked up, the device queried) run once per call signature, not per
    decode (host time of eager calls); an error is not cached; clear_selection_cache forgets."""
    import foscar.api as api
    from foscar.api import BackendStatus, _fmt_values, _select
    calls = []

    def triton_status(key):
        calls.append(key.device)
        return BackendStatus("triton", ok, "Fake GPU" if ok else "no GPU")
    monkeypatch.setattr(backends.get("triton"), "status", triton_status)
    monkeypatch.setattr(backends.get("cute"), "status", lambda key: BackendStatus("cute", False, "x"))
    fmt = _fmt_values(foscar.KVFormat(bits=4, head_dim=128, group_size=128))
    ok = False
    for _ in range(2):
        with pytest.raises(UnsupportedError, match="triton: no GPU"):
            _select("cuda:0", fmt, 4, 64, "auto", "auto")
    assert len(calls) == 2  # errors are checked again
    ok = True
    for _ in range(3):
        assert _select("cuda:0", fmt, 4, 64, "auto", "auto") == "triton"
    assert len(calls) == 3
    ok = False
    assert _select("cuda:0", fmt, 4, 64, "auto", "auto") == "triton"  # cached
    api.clear_selection_cache()
    with pytest.raises(UnsupportedError):
        _select("cuda:0", fmt, 4, 64, "auto", "auto")


def test_cute_status_names_a_missing_tvm_ffi(monkeypatch):
    """The CuTe kernels are called through TVM-FFI: without apache-tvm-ffi the backend says so."""
    import importlib.util

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tvm_ffi" else real(name, *a))
    status = backends.get("cute").status(backends.ProblemKey(torch.device("cuda", 0)))
    if importlib.util.find_spec("cutlass") is None:
        assert "nvidia-cutlass-dsl is not installed" in status.why
    else:
        assert not status.usable and "apache-tvm-ffi is not installed" in status.why


def test_the_custom_op_passes_opcheck():
    """Schema, fake implementation and in-place mutation of ``out``/``lse`` (torch.library.opcheck)."""
    from foscar.api import op_args
    q, cache = make(lens=(70,), Hkv=1, G=1)
    out = torch.empty(q.shape, dtype=torch.float32)
    lse = torch.empty(q.shape[:2])
    torch.library.opcheck(torch.ops.foscar.decode.default, op_args(q, cache, out, lse, 0.125, "reference", None))


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU (none on this machine)")
def test_auto_on_a_gpu_and_cuda_graph_replay():
    q, cache = make(lens=(3000, 17), D=128)
    from foscar.bench import cache_to
    q, cache = q.cuda(), cache_to(cache, "cuda")
    status = {s.name: s for s in foscar.backend_status(q.device, cache.fmt, 4, cache.page_size)}
    assert foscar.select_backend(q, cache) == ("cute" if status["cute"].usable else "triton")  # Hopper: CuTe
    out = torch.empty(q.shape, dtype=torch.bfloat16, device="cuda")
    eager = foscar.decode(q, cache).clone()
    replay = as_graph(lambda: foscar.decode(q, cache, out=out))  # warmed on a side stream, then captured
    out.fill_(float("nan"))
    replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU (none on this machine)")
def test_a_graph_replay_holds_the_inputs_it_reads():
    """as_graph's replay keeps what the captured call holds alive: a benchmark that rebinds its inputs in a loop and
    replays later (bench_steps.py) read freed memory, and stopped on an illegal address once the allocator had given
    that memory back to the driver."""
    import gc
    import weakref
    q, cache = make(lens=(3000, 17), D=128)
    from foscar.bench import cache_to
    q, cache = q.cuda(), cache_to(cache, "cuda")
    eager = foscar.decode(q, cache).clone()
    out = torch.empty(q.shape, dtype=torch.bfloat16, device="cuda")
    replay = as_graph(lambda q=q.clone(), o=out: foscar.decode(q, cache, out=o))
    held = weakref.ref(replay.__defaults__[0].__defaults__[0])  # the captured query, held only by the replay
    del q
    gc.collect()
    torch.cuda.empty_cache()
    assert held() is not None
    out.fill_(float("nan"))
    replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
    del replay
    gc.collect()
    assert held() is None


def test_plan_then_run():
    q, cache = make(lens=(300, 111), sink=2, recent=5)
    p = foscar.plan(q, cache)
    assert p.backend == "reference" and p.workspace is None
    out = torch.full(q.shape, float("nan"), dtype=torch.bfloat16)
    assert p.run(q, cache, out) is out and torch.equal(out, foscar.decode(q, cache))
    lse = torch.empty(q.shape[:2])
    o, l_ = p.run(q, cache, out, lse)
    assert l_ is lse and torch.isfinite(lse).all()
    with pytest.raises(InvalidArgumentError, match="^q/cache: expected the planned shape"):
        p.run(q[:1], cache, out[:1])
    with pytest.raises(InvalidArgumentError, match="^out: expected"):
        p.run(q, cache, out[:, :2])
    with pytest.raises(InvalidArgumentError, match="^num_splits: expected"):
        foscar.plan(q, cache, num_splits=0)


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU (none on this machine)")
@pytest.mark.parametrize("backend", ("triton", "cute"))
def test_planned_runs_allocate_nothing_and_replay_in_a_graph(backend):
    from foscar.bench import cache_to
    q, cache = make(lens=(3000, 17), D=128, sink=4, recent=16)
    q, cache = q.cuda(), cache_to(cache, "cuda")
    status = {s.name: s for s in foscar.backend_status(q.device, cache.fmt, 4, cache.page_size)}
    if not status[backend].usable:
        pytest.skip(f"{backend}: {status[backend].why}")
    p = foscar.plan(q, cache, backend=backend)
    per_split = 2 if p.options.get("warp_specialized") else 1  # CuTe v1: one partial per consumer warpgroup
    windows = 0 if backend == "cute" else 2  # Triton: + sink, recent; the CuTe combine attends them itself
    assert p.backend == backend and p.workspace[0].shape[2] == per_split * p.num_splits + windows
    out = torch.empty(q.shape, dtype=torch.bfloat16, device="cuda")
    p.run(q, cache, out)  # compile
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    p.run(q, cache, out)
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == before
    eager = out.clone()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        p.run(q, cache, out)
    out.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
