"""Decode steps of several tokens per sequence (``q [B, q_len, Hq, D]``, :mod:`foscar.multitoken`): the
oracle attends token ``j`` of a step to the first ``L - q_len + 1 + j`` tokens (checked here against
single-token decodes of caches cut there); ``foscar.decode`` and a plan give the oracle's output and LSE
within the kernels' arithmetic, on every backend here (the reference; Triton under the interpreter on a
CPU machine); the step's outputs are the single-token decodes of its rows; bad steps are refused by name."""
import pytest
import torch
from _cases import DEV, GPU, cut_to, cute_step_against_the_oracle, make_step
from _helpers import rel

import foscar
from foscar.errors import InvalidArgumentError

def test_the_oracle_is_causal_among_the_steps_tokens():
    fmt = foscar.KVFormat(bits=4, head_dim=64, group_size=64)
    q, cache = make_step(fmt, [70, 5, 130], 3)
    out, lse = foscar.decode_exact(q, cache, return_lse=True)
    assert out.shape == (3, 3, 8, 64) and lse.shape == (3, 3, 8)
    for j in range(3):
        cut = cut_to(cache, [L - 2 + j for L in (70, 5, 130)])
        o, s = foscar.decode_exact(q[:, j], cut, return_lse=True)
        assert torch.equal(o, out[:, j]) and torch.equal(s, lse[:, j])


@pytest.mark.parametrize("T", (1, 2, 4))
@pytest.mark.parametrize("backend", ("auto", "reference", "triton", "cute"))
def test_decode_and_plans_give_the_oracles_step(T, backend):
    fmt = foscar.KVFormat(bits=2, head_dim=64, group_size=64 if backend == "cute" else 32, rotation="hadamard",
                          rotation_seed=1)
    status = {s.name: s for s in foscar.backend_status(DEV, fmt, 4)}
    if backend in status and not status[backend].usable:
        pytest.skip(status[backend].why)
    q, cache = make_step(fmt, [T, 77, 161], T, seed=T)
    exact, lse_exact = foscar.decode_exact(q, cache, return_lse=True)
    out = torch.full(q.shape, float("nan"), dtype=torch.float32, device=q.device)
    lse = torch.full(q.shape[:3], float("nan"), device=q.device)
    got, got_lse = foscar.decode(q, cache, out=out, lse=lse, backend=backend)
    assert got.data_ptr() == out.data_ptr() and got.shape == q.shape and got_lse.shape == q.shape[:3]
    assert bool(torch.isfinite(out).all()) and rel(out, exact) < 1e-2
    assert float((lse.double() - lse_exact).abs().max()) < 1e-2
    # the step's rows are single-token decodes of the cache cut at each token
    for j in range(T):
        cut = cut_to(cache, [int(L) - T + 1 + j for L in cache.seq_lens.cpu()])
        one = foscar.decode(q[:, j], cut, backend=backend, out=torch.empty_like(out[:, j]))
        assert torch.allclose(out[:, j], one, atol=1e-6, rtol=0)
    plan = foscar.plan(q, cache, backend=backend)
    assert plan.q_len == T and plan.shape == (3 * T, 8, 64)
    again = torch.full_like(out, float("nan"))
    plan.run(q, cache, out=again)
    assert torch.equal(again, out)
    assert foscar.decode(q, cache, backend=backend).shape == q.shape  # allocated out
    if GPU and backend != "reference":  # a CUDA graph captures a planned step (the view's lengths and table made
        # on the device); the reference reads the lengths back to the host, which no graph captures
        from foscar.bench import as_graph
        replay = as_graph(lambda: plan.run(q, cache, out=again))
        again.fill_(float("nan"))
        replay()
        torch.cuda.synchronize()
        assert torch.equal(again, out)


def test_bad_steps_are_refused_by_name():
    fmt = foscar.KVFormat(bits=4, head_dim=64, group_size=64)
    q, cache = make_step(fmt, [3, 40], 4)
    if not GPU:  # the lengths are read on the host only there
        with pytest.raises(InvalidArgumentError, match=r"^cache.seq_lens: expected lengths >= q_len=4"):
            foscar.decode(q, cache)
    with pytest.raises(InvalidArgumentError, match=r"^q: expected shape \(2, q_len >= 1"):
        foscar.decode(q[:1], cache)
    with pytest.raises(InvalidArgumentError, match=r"^out: expected"):
        foscar.decode(q[:, :1], cache, out=torch.empty(2, 2, 8, 64, device=q.device))
    plan_q = torch.zeros(2, 2, 8, 64, dtype=torch.bfloat16, device=q.device)
    q, cache = make_step(fmt, [30, 40], 2)
    plan = foscar.plan(plan_q, cache)
    with pytest.raises(InvalidArgumentError, match="^q: expected the planned step of 2 tokens"):
        plan.run(torch.zeros(2, 3, 8, 64, dtype=torch.bfloat16, device=q.device), cache)


def test_the_triton_kernel_decodes_a_steps_rows():
    """The rows of a step (``flatten_step``: the cache's pages once per token, the lengths cut) through the
    Triton kernel (the interpreter on a CPU machine): the oracle's step, fused merge and its own kernel."""
    import foscar.triton as ft
    from foscar.multitoken import flatten_step, unflatten
    fmt = foscar.KVFormat(bits=4, head_dim=64, group_size=32)
    q, cache = make_step(fmt, [4, 90, 161], 4, seed=9)
    exact = foscar.decode_exact(q, cache)
    for fused in (True, False):
        out = torch.full(q.shape, float("nan"), dtype=torch.float32, device=q.device)
        q_rows, view, out_rows, _ = flatten_step(q, cache, out, None)
        ft.decode(q_rows, view, out=out_rows, num_splits=2, fused_combine=fused)
        assert unflatten(out_rows, 3, 4).data_ptr() == out.data_ptr()
        assert rel(out, exact) < (1e-2 if GPU else 1e-5)


@pytest.mark.parametrize("kw,T", [
    pytest.param(kw, T, marks=[pytest.mark.slow] if (T == 8 and kw) or T == 2 else [])  # CI: 3 rows, and 8 plain
    for T in (2, 3, 8) for kw in ({}, {"rotation": "hadamard", "rotation_seed": 2}, {"group_size": 64})])
def test_the_triton_kernel_takes_a_step_as_it_is(kw, T):
    """``foscar.triton.decode(q [B, q_len, Hq, D])``: each program takes all the step's tokens of its KV head
    as rows (causal among them; a row may see no token of a split), the merge in the epilogue and as a
    kernel of its own; the oracle's step to float32 (the interpreter) and NaN-poisoned outputs written."""
    import foscar.triton as ft
    fmt = foscar.KVFormat(bits=4, head_dim=64, **({"group_size": 32} | kw))
    q, cache = make_step(fmt, [T, 90, 161], T, seed=T)
    exact, lse_exact = foscar.decode_exact(q, cache, return_lse=True)
    for fused in (True, False):
        out = torch.full(q.shape, float("nan"), dtype=torch.float32, device=q.device)
        lse = torch.full(q.shape[:3], float("nan"), device=q.device)
        got, _ = ft.decode(q, cache, out=out, lse=lse, num_splits=5, fused_combine=fused)
        assert got.data_ptr() == out.data_ptr() and bool(torch.isfinite(out).all())
        assert rel(out, exact) < (1e-2 if GPU else 1e-5)
        assert float((lse.double() - lse_exact).abs().max()) < (1e-2 if GPU else 1e-4)


def test_torch_compile_traces_a_step_without_graph_breaks():
    fmt = foscar.KVFormat(bits=4, head_dim=64, group_size=64)
    q, cache = make_step(fmt, [10, 40], 3)
    step = torch.compile(lambda x: foscar.decode(x, cache), fullgraph=True)
    out = step(q)
    assert out.shape == q.shape and rel(out, foscar.decode_exact(q, cache)) < 1e-2


@pytest.mark.parametrize("backend", ("reference", "triton"))
def test_the_custom_op_takes_a_step(backend):
    """The custom op a compiled graph calls takes a step's rows with ``q_len`` (the reference through the
    causal view it makes itself; Triton as it is): opcheck, and the output of ``foscar.decode``."""
    from foscar.api import op_args
    fmt = foscar.KVFormat(bits=4, head_dim=64, group_size=64)
    status = {s.name: s for s in foscar.backend_status(DEV, fmt, 2)}
    if not status[backend].usable:
        pytest.skip(status[backend].why)
    q, cache = make_step(fmt, [10, 40], 2, Hkv=1, G=2)
    rows = q.reshape(-1, *q.shape[2:])
    out = torch.full(rows.shape, float("nan"), device=q.device)
    lse = torch.full(rows.shape[:2], float("nan"), device=q.device)
    args = op_args(rows, cache, out, lse, 0.125, backend, None, 2)
    if backend == "reference":
        torch.library.opcheck(torch.ops.foscar.decode.default, args)
    torch.ops.foscar.decode(*args)
    want = foscar.decode(q, cache, sm_scale=0.125, backend=backend, out=torch.empty(q.shape, device=q.device))
    assert torch.allclose(out.view(q.shape), want, atol=1e-6, rtol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU (none on this machine)")
@pytest.mark.parametrize("bits", (2, 4))
@pytest.mark.parametrize("G,T,num_splits,fmt_kw", [
    (4, 2, None, {}), (4, 4, None, {}), (4, 8, None, {}), (1, 8, 3, {}), (2, 3, 64, {}), (8, 2, None, {}),
    (16, 2, None, {}), (8, 8, None, {}), (4, 4, 5, {"rotation": "hadamard"}), (4, 3, None, {"group_size": 64}),
    (4, 2, None, {"head_dim": 256}), (4, 4, None, {"head_dim": 256}), (4, 8, 3, {"v_axis": "channel", "rollback": 8}),
    (4, 8, None, {"k_axis": "channel", "v_axis": "channel", "group_size": 64, "rollback": 8})])
def test_the_cute_kernel_takes_a_step_as_its_columns_gpu(bits, G, T, num_splits, fmt_kw):
    """A step's tokens as N columns of the CuTe kernel (:func:`_cases.cute_step_against_the_oracle`)."""
    cute_step_against_the_oracle(bits, G, T, num_splits, fmt_kw)


def test_a_planned_triton_step_splits_as_a_direct_call(monkeypatch):
    """A plan of a step takes the split count (and workspace) a direct call takes: one program per sequence,
    whatever the step's length (the heuristic counts sequences, not rows)."""
    from foscar import autotune
    from foscar.backends import get
    from foscar.multitoken import step_problem
    from foscar.triton.launch import launch_config
    if not GPU:  # no device to name for the autotune cache: the heuristic
        monkeypatch.setattr(autotune, "tuned_config", lambda *a: {})
    fmt = foscar.KVFormat(bits=4, head_dim=64, group_size=64)
    for T in (1, 4, 8):
        q, cache = make_step(fmt, [4096, 4000], T, Hkv=1, G=4)
        problem = step_problem(q, cache)
        planned = get("triton").launch_config(problem)["num_splits"]
        assert planned == launch_config(q[:, 0], cache, 4)[1]
