"""The decode cases the kernel tests share: where they run (``GPU``, ``DEV``, ``HOPPER``), a quantized cache of given
lengths on a shuffled page pool (:func:`make`), a decode step's query and cache (:func:`make_step`, :func:`cut_to`),
and the checks of a kernel's output against the float64 oracle, NaN-poisoned and every element held to the bound:
the Triton kernel's (:func:`run_and_check`) and the CuTe kernel's (:func:`cute_against_the_oracle`,
:func:`cute_magnitude_case`, :func:`cute_step_against_the_oracle`) and a windowed step's through any backend
(:func:`check_windowed_step`, against :func:`bf16_step_attention`); a cache broken after the checks
(:func:`broken_cache`); what a write may change in a cache
(:func:`snapshot`, :func:`same_state`); the register-A wgmma of the CuTe kernels' PTX (:data:`WGMMA_RS`)."""
import copy
import re

import pytest
import torch
from _helpers import bf16_attention, kernel_error_bound, magnitude_cache, rel

import foscar
from foscar.bench import as_graph, cache_to

GPU = torch.cuda.is_available()
DEV = "cuda" if GPU else "cpu"
HOPPER = GPU and torch.cuda.get_device_capability() == (9, 0)  #: an sm_90 GPU (H100/H200): the CuTe kernels run
#: a register-A wgmma of BF16 or FP16 operands in PTX: ``(operand type, the B descriptor's operands)``
WGMMA_RS = re.compile(r"wgmma\.mma_async\.sync\.aligned\.m64n8k16\.f32\.(bf16|f16)\.\1\s+\{[^}]*\},\s*\{([^}]*)\}")


def make(fmt, lens, Hkv, G, *, page=None, seed=0, device=DEV, shuffle=True):
    """``(q [B, Hkv G, D] BF16, cache)``: random K, V quantized in ``fmt`` for sequences of ``lens`` tokens; with
    ``page``, paged on a pool two pages larger than needed, its pages shuffled unless ``shuffle`` is off."""
    gen = torch.Generator().manual_seed(seed)
    B, L, D = len(lens), max(lens), fmt.head_dim
    k = torch.randn(B, Hkv, L, D, generator=gen)
    v = torch.randn(B, Hkv, L, D, generator=gen)
    q = torch.randn(B, Hkv * G, D, generator=gen).bfloat16()
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    kw = {}
    if page is not None:
        n_quant = fmt.split_length(seq_lens.long())[1]
        need = [-(-int(n) // page) for n in n_quant]
        pool = sum(need) + 2
        perm = torch.randperm(pool, generator=gen) if shuffle else torch.arange(pool)
        indptr = torch.tensor([0] + need).cumsum(0).to(torch.int32)
        kw = dict(page_size=page, page_table=foscar.PageTable.from_csr(indptr, perm[: sum(need)].to(torch.int32)),
                  num_pages=pool)
    cache = foscar.quantize_kv(k, v, fmt, seq_lens=seq_lens, **kw)
    if device != "cpu":
        cache = cache_to(cache, device)
    return q.to(device), cache


def run_and_check(q, cache, *, kernel="folded", num_splits=None, sdpa=False, tol=1e-5, **launch):
    """The Triton kernel's decode of ``q`` over ``cache`` into NaN-poisoned outputs, held to the float64 oracle: on a
    GPU within the kernels' bound of BF16 attention's error, under the interpreter (float32 operands and output)
    within ``tol``; the LSE too. Returns the relative error."""
    import foscar.triton as ft
    B, Hq, D = q.shape
    out_dtype = torch.bfloat16 if GPU else torch.float32  # the interpreter's float32 kernel is held to 1e-5
    out = torch.full((B, Hq, D), float("nan"), dtype=out_dtype, device=q.device)  # poisoned
    lse = torch.full((B, Hq), float("nan"), dtype=torch.float32, device=q.device)
    ft.decode(q, cache, out=out, lse=lse, kernel=kernel, num_splits=num_splits, **launch)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all(), "unwritten or NaN output"
    exact, lse_exact = foscar.decode_exact(q, cache, return_lse=True)
    err = rel(out, exact)
    if GPU:  # BF16 operands: no worse than BF16 attention on the same dequantized cache
        base = rel(bf16_attention(q, cache, sdpa=sdpa), exact)
        print(f"\nerror {err:.3e}  BF16 attention {base:.3e}  ratio {err / base:.3f}")
        assert err <= kernel_error_bound(cache.fmt, base), (err, base)
        assert float((lse.double() - lse_exact).abs().max()) <= 1e-2
    else:  # interpreter: float32 operands and output, the float32 bound of the fold
        assert err <= tol, err
        assert float((lse.double() - lse_exact).abs().max()) <= 1e-4
    return err


def cute_against_the_oracle(fmt, lens, G: int, label: str, **launch) -> None:
    """A paged cache of ``lens`` (2 KV heads, GQA ``G``) decoded by the CuTe kernel with ``launch`` into
    NaN-poisoned outputs: every element finite, within the kernels' bound of the float64 oracle (BF16
    attention's error on the same dequantized cache), the LSE within 1e-2."""
    from foscar.cute.launch import decode
    q, cache = make(fmt, lens, Hkv=2, G=G, page=64, seed=fmt.bits)
    out = torch.full(q.shape, float("nan"), dtype=torch.bfloat16, device=q.device)
    lse = torch.full(q.shape[:2], float("nan"), dtype=torch.float32, device=q.device)
    decode(q, cache, out=out, lse=lse, **launch)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    exact, lse_exact = foscar.decode_exact(q, cache, return_lse=True)
    err, base = rel(out, exact), rel(bf16_attention(q, cache, sdpa=True), exact)
    print(f"\n{label} {err:.3e}  BF16 attention {base:.3e}")
    assert err <= kernel_error_bound(fmt, base)
    assert float((lse.double() - lse_exact).abs().max()) <= 1e-2


def cute_magnitude_case(magnitude, v_axis: str = "token", **launch) -> None:
    """A magnitude case (:func:`_helpers.magnitude_cache`, INT2, D 64, V's groups along ``v_axis``) decoded by the
    CuTe kernel with ``launch`` into a NaN-poisoned output: finite, within the kernels' bound of the float64 oracle."""
    from foscar.cute.launch import decode
    fmt = foscar.KVFormat(bits=2, head_dim=64, group_size=64, v_axis=v_axis)
    q, cache = magnitude_cache(fmt, magnitude, "cuda")
    out = torch.full(q.shape, float("nan"), dtype=torch.float32, device=q.device)
    decode(q, cache, out=out, **launch)
    exact = foscar.decode_exact(q, cache)
    assert torch.isfinite(out).all()
    assert rel(out, exact) <= kernel_error_bound(fmt, rel(bf16_attention(q, cache, sdpa=True), exact))


def sum_block_mmas(cfg) -> int:
    """The wgmma a pass of V^T's extra m64 block adds (channel-wise V's column sums, ``Sm90Config.column_sum_mma``;
    token-wise V's pivot sums, ``pivot_mma``): one per k16 step of each of the pass's tiles."""
    return 4 * cfg.p_tiles if cfg.column_sum_mma or cfg.pivot_mma else 0


#: Channel-wise V's oracle cases for a switch of its kernels: (format keywords over D 128, g 128; GQA; lengths; launch)
CHANNEL_V_GPU_CASES = [
    ({}, 4, [8192, 700, 1], {"warp_specialized": True, "k_operand": "e4m3", "tiles_per_pass": 2, "num_splits": 16}),
    ({"k_axis": "channel"}, 4, [4100, 260], {"warp_specialized": True, "k_operand": "e4m3", "tiles_per_pass": 2}),
    ({"k_axis": "channel"}, 4, [3000, 77], {"warp_specialized": True, "tiles_per_pass": 1}),
    ({"group_size": 64}, 4, [3000, 5], {"warp_specialized": True, "tiles_per_pass": 1, "num_splits": 3}),
    ({"sink": 4, "recent": 100}, 4, [3000, 5], {"warp_specialized": True, "num_splits": 3}),
    ({}, 8, [2000, 33], {"warp_specialized": True}),
    ({}, 16, [2000, 33], {"warp_specialized": True, "k_operand": "e4m3"}),
    ({}, 32, [4100, 77], {"warp_specialized": True, "k_operand": "e4m3", "ctas_per_sm": 1}),
    ({"head_dim": 64, "group_size": 64}, 2, [1000, 64], {"warp_specialized": True}),
    ({"head_dim": 256}, 2, [3000, 9], {"warp_specialized": True, "ctas_per_sm": 1}),
    ({}, 8, [2000, 33], {"warp_specialized": False})]


def make_step(fmt, lens, T, Hkv=2, G=4, seed=0):
    """A step's query ``[B, T, Hkv G, D]`` and a cache of ``lens`` quantized where the tests run (its ring as the
    write paths leave it: a step over windows reads it)."""
    gen = torch.Generator().manual_seed(seed)
    B, L, D = len(lens), max(lens), fmt.head_dim
    k, v = torch.randn(2, B, Hkv, L, D, generator=gen).unbind(0)
    cache = foscar.quantize_kv(k.to(DEV), v.to(DEV), fmt, page_size=64,
                               seq_lens=torch.tensor(lens, dtype=torch.int32, device=DEV))
    return torch.randn(B, T, Hkv * G, D, generator=gen).to(torch.bfloat16).to(DEV), cache


def cut_to(cache, lens):
    """The same cache with other lengths (token-wise, no windows: the codes of the first tokens are theirs)."""
    c = copy.copy(cache)
    c.seq_lens = torch.tensor(lens, dtype=torch.int32, device=cache.seq_lens.device)
    return c


def cute_step_against_the_oracle(bits, G, T, num_splits, fmt_kw) -> None:
    """A step's tokens as N columns of the CuTe kernel beside the heads (``G T`` rows; beyond
    :func:`foscar.cute.config.max_rows`, 32 or 8 at head dim 256, in parts of its tokens), the causal limit
    per column, splits whose last tile some columns do not see (64 splits
    over a few tiles): NaN-poisoned outputs, every element within the kernels' bound of the float64 oracle
    (BF16 attention's error on the same dequantized cache, token by token), the LSE within 1e-2. Skipped where the
    CuTe backend cannot run here."""
    fmt = foscar.KVFormat(bits=bits, **{"head_dim": 128, "group_size": 128, **fmt_kw})
    status = {s.name: s for s in foscar.backend_status(DEV, fmt, G)}
    if not status["cute"].usable:
        pytest.skip(status["cute"].why)
    lens = [T, 64 * 7 + T - 1, 4099, 64 * 5 + 1]  # a step alone; one past a tile by T - 1; long; a tile ending
    # inside the step's tokens (its earlier rows' limits before the tile's end)
    q, cache = make_step(fmt, lens, T, Hkv=2, G=G, seed=bits + T)
    rows = q.reshape(-1, *q.shape[2:])
    out = torch.full(rows.shape, float("nan"), dtype=torch.bfloat16, device=q.device)
    lse = torch.full(rows.shape[:2], float("nan"), device=q.device)
    foscar.decode(q, cache, out=out.view(q.shape), lse=lse.view(q.shape[:3]), backend="cute", num_splits=num_splits)
    exact, lse_exact = foscar.decode_exact(q, cache, return_lse=True)
    got = out.view(q.shape)
    assert bool(torch.isfinite(got).all()) and bool(torch.isfinite(lse).all())
    base = torch.stack([bf16_attention(q[:, j], cut_to(cache, [L - T + 1 + j for L in lens]), sdpa=True)
                        for j in range(T)], 1)
    err, ref_err = rel(got, exact), rel(base, exact)
    print(f"\nG {G} q_len {T}: error {err:.3e}  BF16 attention {ref_err:.3e}")
    assert err <= kernel_error_bound(fmt, ref_err)
    assert float((lse.view(q.shape[:3]).double() - lse_exact).abs().max()) <= 1e-2


def step_format(kw, head_dim=64):
    """The format of ``kw`` (an affine format's arguments, or ``scheme`` and an FP4 format's) at ``head_dim``."""
    kw = dict(kw)
    if "scheme" in kw:
        return foscar.KVFormat.fp4(kw.pop("scheme"), head_dim, **kw)
    return foscar.KVFormat(head_dim=head_dim, **kw)


def bf16_step_attention(q, cache):
    """BF16 attention of a step over the dequantized cache, token ``j`` over the cache at its length (the causal
    view's row; ``foscar.reference.attend`` with BF16 operands and P, FP32 math, a BF16 output)."""
    import math

    from foscar.multitoken import causal_view
    B, T, Hq, D = q.shape
    Hkv = cache.num_kv_heads
    view = causal_view(cache, T)
    kd, vd = view.dequantize(torch.float32)
    out = torch.empty(B, T, Hq, D, dtype=torch.float32, device=q.device)
    for b in range(B):
        for j in range(T):
            r = b * T + j
            n = int(view.seq_lens[r])
            o, _ = foscar.reference.attend(q[b, j].float().reshape(Hkv, Hq // Hkv, D), kd[r, :, :n], vd[r, :, :n],
                                           1 / math.sqrt(D), operand_dtype=torch.bfloat16)
            out[b, j] = o.reshape(Hq, D).bfloat16().float()
    return out


def check_windowed_step(kw, head_dim, G, T, backend):
    """A step of ``T`` tokens over a cache of the windowed format ``kw`` through ``backend`` (skipped where it cannot
    run here): NaN-poisoned outputs, every element within the kernels' bound of the float64 oracle (BF16 attention's
    error, token by token), the LSE within 1e-2; a CUDA-graph replay of its plan equal to the eager call."""
    fmt = step_format(kw, head_dim)
    status = {s.name: s for s in foscar.backend_status(DEV, fmt, G)}
    if not status[backend].usable:
        pytest.skip(status[backend].why)
    lens = [T, 64 * 7 + T - 1, 4099]
    q, cache = make_step(fmt, lens, T, Hkv=2, G=G, seed=T)
    out = torch.full(q.shape, float("nan"), dtype=torch.bfloat16, device=q.device)
    lse = torch.full(q.shape[:3], float("nan"), device=q.device)
    foscar.decode(q, cache, out=out, lse=lse, backend=backend)
    exact, lse_exact = foscar.decode_exact(q, cache, return_lse=True)
    assert bool(torch.isfinite(out).all()) and bool(torch.isfinite(lse).all())
    err, ref_err = rel(out, exact), rel(bf16_step_attention(q, cache), exact)
    print(f"\n{fmt} G {G} q_len {T}: error {err:.3e}  BF16 attention {ref_err:.3e}")
    assert err <= kernel_error_bound(fmt, ref_err)
    assert float((lse.double() - lse_exact).abs().max()) <= 1e-2
    plan = foscar.plan(q, cache, backend=backend)
    again = torch.full_like(out, float("nan"))
    replay = as_graph(lambda: plan.run(q, cache, out=again))
    replay()
    torch.cuda.synchronize()
    assert torch.equal(again, out)


def broken_cache(where: str, device: str):
    """A cache whose stored values were broken after the checks (a caller writing its tensors): one NaN in
    KV head 1 of sequence 0 (the oracle's output is NaN there). Every other head must decode as the
    oracle does."""
    fmt = foscar.KVFormat(bits=4, head_dim=64, group_size=64, sink=4, recent=16)
    k, v = torch.randn(2, 2, 2, 150, 64, generator=torch.Generator().manual_seed(0)).unbind(0)
    cache = foscar.quantize_kv(k, v, fmt, page_size=64)
    if device != "cpu":
        cache = cache_to(cache, device)
    if where == "sink":
        cache.k_sink[0, 1, 1, 3] = float("nan")
    elif where == "recent":
        cache.v_recent[0, 1, 2, 3] = float("nan")
    else:  # a quantized scale
        page = int(cache.page_table.block_table[0, 0])
        cache.k_params[page, 1, 5, 0, 0] = float("nan")
    return cache


#: what a write to a cache may change: its codes, ``(s', z')``, windows, lengths and the ring's oldest position
CACHE_STATE = ("k_codes", "v_codes", "k_params", "v_params", "k_sink", "v_sink", "k_recent", "v_recent", "seq_lens",
               "ring_from")


def snapshot(cache) -> dict:
    """Copies of :data:`CACHE_STATE` of ``cache``, by name."""
    return {n: getattr(cache, n).clone() for n in CACHE_STATE}


def same_state(a: dict, b: dict) -> bool:
    """Whether two :func:`snapshot` s hold the same values, bit for bit."""
    return a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
