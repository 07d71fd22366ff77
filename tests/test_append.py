"""The write path (QuantKVCache.empty + append): appending in any chunking gives the cache quantize_kv
builds from the same tokens, every decode reads it after every append, and a bad append changes
nothing."""
import pytest
import torch
from _cases import DEV, same_state, snapshot
from _helpers import rel
from hypothesis import given, settings
from hypothesis import strategies as st

import foscar
from foscar.errors import InvalidArgumentError

FORMATS = [
    dict(bits=4, head_dim=64, group_size=32),
    dict(bits=2, head_dim=64, group_size=64, k_axis="channel", v_axis="token", sink=3, recent=5),
    dict(bits=4, head_dim=64, group_size=32, k_axis="token", v_axis="channel", recent=2),
    dict(bits=2, head_dim=64, group_size=32, k_axis="channel", v_axis="channel", sink=1),
]


def bf16_exact(*shape, seed):
    """Random values that BF16 holds exactly: the ring round trip is then lossless, so appending and
    quantizing all at once must agree bit for bit."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).bfloat16().float()


@settings(max_examples=12, deadline=None)
@given(fmt_i=st.integers(0, len(FORMATS) - 1), page=st.sampled_from([64, 128, None]),
       chunks=st.lists(st.integers(1, 70), min_size=1, max_size=8), seed=st.integers(0, 2 ** 16))
def test_appending_equals_quantizing_at_once(fmt_i, page, chunks, seed):
    fmt = foscar.KVFormat(**FORMATS[fmt_i])
    B, H, D = 2, 2, fmt.head_dim
    L = sum(chunks)
    k, v = bf16_exact(B, H, L, D, seed=seed), bf16_exact(B, H, L, D, seed=seed + 1)
    cache = foscar.QuantKVCache.empty(fmt, B, H, max_len=max(L, 1), page_size=page)
    t = 0
    for c in chunks:
        cache.append(k[:, :, t: t + c], v[:, :, t: t + c])
        t += c
    whole = foscar.quantize_kv(k, v, fmt, page_size=page)
    assert cache.seq_lens.tolist() == [L] * B
    for a, b in zip(cache.dequantize(), whole.dequantize()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("fmt_kw", FORMATS)
def test_every_decode_reads_the_cache_after_every_append(fmt_kw):
    fmt = foscar.KVFormat(**fmt_kw)
    B, H, G, D = 2, 2, 2, fmt.head_dim
    k, v = bf16_exact(B, H, 300, D, seed=1).to(DEV), bf16_exact(B, H, 300, D, seed=2).to(DEV)
    q = torch.randn(B, H * G, D, generator=torch.Generator().manual_seed(3)).to(DEV)
    cache = foscar.QuantKVCache.empty(fmt, B, H, max_len=300, page_size=64, device=DEV)
    t = 0
    for c in (1, 1, 62, 1, 64, 33, 1):  # across group, pack block and page boundaries
        cache.append(k[:, :, t: t + c], v[:, :, t: t + c])
        t += c
        exact = foscar.decode_exact(q, cache)
        assert rel(foscar.decode_folded(q, cache), exact) < 1e-10
        assert rel(foscar.decode(q, cache), exact) < 5e-3  # the default backend here (the reference on a CPU)
    import foscar.triton as ft  # the Triton kernel (interpreter on a CPU: float32 operands), float32 out
    out = torch.full(q.shape, float("nan"), device=DEV)
    ft.decode(q.bfloat16(), cache, out=out, num_splits=2)
    assert rel(out, foscar.decode_exact(q.bfloat16(), cache)) < (5e-3 if DEV == "cuda" else 1e-5)


def test_a_bad_append_changes_nothing():
    fmt = foscar.KVFormat(bits=4, head_dim=64, group_size=64, recent=4)
    cache = foscar.QuantKVCache.empty(fmt, 2, 2, max_len=128, page_size=64)
    cache.append(bf16_exact(2, 2, 100, 64, seed=0), bf16_exact(2, 2, 100, 64, seed=1))
    before = snapshot(cache)
    x = bf16_exact(2, 2, 40, 64, seed=2)
    cases = [
        ((x, x), InvalidArgumentError, "^k_new: expected tokens that fit the pages of sequence 0"),  # 140 > 128 + ring
        ((x[:, :1, :3], x[:, :1, :3]), InvalidArgumentError, r"^k_new: expected shape \(2, 2, T, 64\)"),
        ((x[:, :, :3], x[:, :, :2]), InvalidArgumentError, "^v_new: expected"),
        ((x[:, :, :3], x[:, :, :3].double()), InvalidArgumentError, "^v_new: expected"),
        ((x[:, :, :3].int(), x[:, :, :3].int()), InvalidArgumentError, "^k_new: expected"),
    ]
    nan = x[:, :, :3].clone()
    nan[1, 0, 2, 5] = float("nan")
    cases.append(((x[:, :, :3], nan), InvalidArgumentError, "^v_new: expected finite values"))
    inf = x[:, :, :3].clone()
    inf[0, 1, 0, 0] = float("inf")
    cases.append(((inf, x[:, :, :3]), InvalidArgumentError, "^k_new: expected finite values"))
    for (kn, vn), err, match in cases:
        with pytest.raises(err, match=match):
            cache.append(kn, vn)
        after = snapshot(cache)
        assert same_state(before, after), match
    with pytest.raises(InvalidArgumentError, match="^quantizer: expected"):
        cache.append(x[:, :, :1], x[:, :, :1], quantizer="best")


def test_empty_caches_need_a_capacity():
    fmt = foscar.KVFormat(bits=4, head_dim=64, group_size=64)
    with pytest.raises(InvalidArgumentError, match="^max_len: expected"):
        foscar.QuantKVCache.empty(fmt, 2, 2)
    with pytest.raises(InvalidArgumentError, match="^window_dtype: expected"):
        foscar.QuantKVCache.empty(fmt, 2, 2, max_len=64, window_dtype=torch.float32)
    c = foscar.QuantKVCache.empty(fmt, 3, 1, max_len=100, page_size=None)
    assert c.contiguous and c.page_size == 128 and c.seq_lens.tolist() == [0, 0, 0]  # whole 64-token tiles
    table = foscar.PageTable.from_block_table(torch.tensor([[4, 1], [0, 2]], dtype=torch.int32))
    c = foscar.QuantKVCache.empty(fmt, 2, 1, page_table=table, num_pages=5)
    c.append(bf16_exact(2, 1, 128, 64, seed=0), bf16_exact(2, 1, 128, 64, seed=1))
    assert int(c.page_table.num_pages[0]) == 2 and c.quantized_pages(0).tolist() == [4, 1]


APPEND_FORMATS = [
    (dict(bits=4, head_dim=64, group_size=32), 64),
    (dict(bits=2, head_dim=64, group_size=64, sink=3, recent=5), 64),
    (dict(bits=4, head_dim=128, group_size=128, recent=1), 32),
    (dict(bits=2, head_dim=64, group_size=32, sink=2), None),
    (dict(bits=4, head_dim=64, group_size=32, k_axis="channel", v_axis="token", sink=1, recent=3), 64),
    (dict(bits=2, head_dim=64, group_size=64, k_axis="token", v_axis="channel"), 32),
    (dict(bits=4, head_dim=128, group_size=32, k_axis="channel", v_axis="channel", recent=2), 64),
]


# OSCAR's clip over the token-wise formats (the slowest under the interpreter) with FOSCAR_SLOW=1 only
@pytest.mark.parametrize("fmt_kw,page,quantizer", [
    pytest.param(f, p, q, marks=[pytest.mark.slow] if q == "oscar" and i < 4 else [])
    for i, (f, p) in enumerate(APPEND_FORMATS) for q in ("minmax", "oscar")])
def test_the_triton_append_matches_the_reference_bit_for_bit(fmt_kw, page, quantizer):
    """The graph-safe kernel (under the interpreter on a CPU) writes what QuantKVCache.append writes, min-max
    and with OSCAR's clip ratios."""
    _steps_match(fmt_kw, page, quantizer)


def _steps_match(fmt_kw, page, quantizer):
    """A prompt, then 42 decode steps through the single-token kernel (across a page of 64 and token groups of
    up to 32): the reference's cache, bit for bit."""
    import foscar.triton as ft
    fmt = foscar.KVFormat(**fmt_kw)
    B, H, D = 2, 2, fmt.head_dim
    # BF16-exact values: the interpreter truncates casts
    k, v = (bf16_exact(B, H, 90, D, seed=4) * 4).to(DEV), bf16_exact(B, H, 90, D, seed=5).to(DEV)
    ref = foscar.QuantKVCache.empty(fmt, B, H, max_len=96, page_size=page, device=DEV)
    ref.append(k[:, :, :48], v[:, :, :48], quantizer=quantizer)  # a prompt, then decode steps
    ker = foscar.QuantKVCache.empty(fmt, B, H, max_len=96, page_size=page, device=DEV)
    ker.append(k[:, :, :48], v[:, :, :48], quantizer=quantizer)
    for t in range(48, 90):
        ref.append(k[:, :, t: t + 1], v[:, :, t: t + 1], quantizer=quantizer)
        ft.append_step(ker, k[:, :, t].contiguous(), v[:, :, t].contiguous(), check=t % 7 == 0, quantizer=quantizer)
    assert same_state(snapshot(ref), snapshot(ker))


PREFILL_FORMATS = [
    (dict(bits=4, head_dim=64, group_size=32), 64),
    (dict(bits=2, head_dim=64, group_size=64, sink=3, recent=5), 64),
    (dict(bits=4, head_dim=64, group_size=32, k_axis="channel", v_axis="token", sink=1, recent=3), 32),
    (dict(bits=2, head_dim=64, group_size=64, k_axis="token", v_axis="channel", recent=70), 64),
    (dict(bits=4, head_dim=128, group_size=32, k_axis="channel", v_axis="channel", sink=4), None),
]


# the token-wise formats take a minute each under the interpreter: one of them in CI (FOSCAR_SLOW=1: all)
@pytest.mark.parametrize("fmt_kw,page,quantizer", [
    pytest.param(f, p, q, marks=[pytest.mark.slow] if (i, q) in {(0, "minmax"), (1, "oscar"), (1, "minmax")} else [])
    for i, (f, p) in enumerate(PREFILL_FORMATS) for q in ("minmax", "oscar")])
def test_the_triton_prefill_append_matches_the_reference_bit_for_bit(fmt_kw, page, quantizer):
    """Several tokens per call (a prompt, then chunks that cross groups, pages and the window, and single
    steps in between) through the parallel kernels: the cache QuantKVCache.append writes, bit for bit, min-max
    and with OSCAR's clip ratios."""
    _prefill_matches(fmt_kw, page, quantizer)


@pytest.mark.parametrize("fmt_kw,page,steps", [
    pytest.param(dict(bits=2, head_dim=64, group_size=64, sink=3, recent=5), 64, True, marks=pytest.mark.slow),
    (dict(bits=2, head_dim=64, group_size=64, k_axis="token", v_axis="channel"), 32, True),
    (dict(bits=4, head_dim=64, group_size=32, k_axis="channel", v_axis="token", sink=1, recent=3), 32, False),
])
def test_the_triton_append_with_the_mse_search_matches_the_reference_bit_for_bit(fmt_kw, page, steps):
    """The ``"mse"`` quantizer in the write kernels (each group's clip ratio of the least squared error, token-
    and channel-wise groups): the reference's cache, bit for bit, through decode steps or chunks."""
    (_steps_match if steps else _prefill_matches)(fmt_kw, page, "mse")


def _prefill_matches(fmt_kw, page, quantizer):
    """A prompt, chunks and single steps through the parallel and single-token kernels: the reference's cache,
    bit for bit, after every call."""
    import foscar.triton as ft
    fmt = foscar.KVFormat(**fmt_kw)
    B, H, D, n = 2, 2, fmt.head_dim, 155
    k, v = (bf16_exact(B, H, n, D, seed=6) * 4).to(DEV), bf16_exact(B, H, n, D, seed=7).to(DEV)  # BF16-exact
    ref = foscar.QuantKVCache.empty(fmt, B, H, max_len=n, page_size=page, device=DEV)
    ker = foscar.QuantKVCache.empty(fmt, B, H, max_len=n, page_size=page, device=DEV)
    t = 0
    for c in (24, 1, 7, 1, 41, 3, 1, 70, 0, 7):  # the prompt first; 0: a no-op; the 41 and 70 cross pages of 64
        ref.append(k[:, :, t: t + c], v[:, :, t: t + c], quantizer=quantizer)
        if c == 1 and t % 2:
            ft.append_step(ker, k[:, :, t].contiguous(), v[:, :, t].contiguous(), quantizer=quantizer)
        else:
            ft.append(ker, k[:, :, t: t + c], v[:, :, t: t + c], check=c != 41, quantizer=quantizer)
        t += c
        assert same_state(snapshot(ref), snapshot(ker)), t
    assert t == n


@settings(max_examples=6, deadline=None)
@given(fmt_i=st.integers(0, len(FORMATS) - 1), chunks=st.lists(st.integers(1, 70), min_size=1, max_size=5),
       seed=st.integers(0, 2 ** 16))
def test_the_triton_append_in_any_chunking_matches_the_reference(fmt_i, chunks, seed):
    """Property: whatever the chunking (one-token steps through the single-token kernel, several tokens
    through the parallel ones), the Triton write path writes the reference's cache bit for bit."""
    import foscar.triton as ft
    fmt = foscar.KVFormat(**FORMATS[fmt_i])
    B, H, D, n = 2, 2, fmt.head_dim, sum(chunks)
    k, v = (bf16_exact(B, H, n, D, seed=seed) * 2).to(DEV), bf16_exact(B, H, n, D, seed=seed + 1).to(DEV)
    ref = foscar.QuantKVCache.empty(fmt, B, H, max_len=n, page_size=64, device=DEV)
    ker = foscar.QuantKVCache.empty(fmt, B, H, max_len=n, page_size=64, device=DEV)
    t = 0
    for c in chunks:
        ref.append(k[:, :, t: t + c], v[:, :, t: t + c])
        if c == 1:
            ft.append_step(ker, k[:, :, t].contiguous(), v[:, :, t].contiguous(), check=False)
        else:
            ft.append(ker, k[:, :, t: t + c], v[:, :, t: t + c], check=False)
        t += c
    assert same_state(snapshot(ref), snapshot(ker))


def test_the_triton_append_refuses_what_it_does_not_cover():
    import foscar.triton as ft
    from foscar.errors import UnsupportedError
    fmt = foscar.KVFormat(bits=4, head_dim=64, group_size=64, mapping="f16")
    cache = foscar.QuantKVCache.empty(fmt, 1, 1, max_len=64, device=DEV)
    with pytest.raises(UnsupportedError, match="mapping='f16'"):
        ft.append_step(cache, torch.ones(1, 1, 64, device=DEV), torch.ones(1, 1, 64, device=DEV))
    cache = foscar.QuantKVCache.empty(foscar.KVFormat(bits=4, head_dim=64, group_size=64), 1, 1, max_len=64,
                                      device=DEV)
    with pytest.raises(InvalidArgumentError, match="^k_new: expected a 3-D tensor"):
        ft.append_step(cache, torch.ones(1, 64, device=DEV), torch.ones(1, 1, 64, device=DEV))
    with pytest.raises(InvalidArgumentError, match="^v_new: expected shape"):
        ft.append(cache, torch.ones(1, 1, 5, 64, device=DEV), torch.ones(1, 1, 4, 64, device=DEV))
    with pytest.raises(InvalidArgumentError, match="^quantizer: expected one of \\('minmax', 'oscar', 'mse'\\)"):
        ft.append(cache, torch.ones(1, 1, 5, 64, device=DEV), torch.ones(1, 1, 5, 64, device=DEV),
                  quantizer="quantile")
    before = snapshot(cache)
    with pytest.raises(InvalidArgumentError, match="capacity|room|pages"):
        ft.append(cache, torch.ones(1, 1, 65, 64, device=DEV), torch.ones(1, 1, 65, 64, device=DEV))
    assert same_state(before, snapshot(cache))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none on this machine)")
def test_decode_steps_as_one_cuda_graph():
    """Append (Triton, check=False) and decode (a plan) captured once, replayed step after step: the
    same cache and outputs as eager steps through the reference append."""
    import foscar.triton as ft
    fmt = foscar.KVFormat(bits=4, head_dim=128, group_size=128, sink=4, recent=16)
    B, H, G, D, steps = 2, 2, 4, 128, 40
    k, v = (torch.randn(B, H, 100 + steps, D, device="cuda") for _ in range(2))
    q = torch.randn(B, H * G, D, device="cuda", dtype=torch.bfloat16)
    ref = foscar.QuantKVCache.empty(fmt, B, H, max_len=256, page_size=64, device="cuda")
    ker = foscar.QuantKVCache.empty(fmt, B, H, max_len=256, page_size=64, device="cuda")
    for c in (ref, ker):
        c.append(k[:, :, :100], v[:, :, :100])
    p = foscar.plan(q, ker)
    out = torch.empty(q.shape, dtype=torch.bfloat16, device="cuda")
    kt, vt = (torch.empty(B, H, D, device="cuda") for _ in range(2))
    kt.copy_(k[:, :, 100])
    vt.copy_(v[:, :, 100])
    ft.append_step(ker, kt, vt)  # warm-up step (compiles), eager
    p.run(q, ker, out)
    ref.append(k[:, :, 100:101], v[:, :, 100:101])
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        ft.append_step(ker, kt, vt, check=False)
        p.run(q, ker, out)
    for t in range(101, 100 + steps):
        kt.copy_(k[:, :, t])
        vt.copy_(v[:, :, t])
        g.replay()
        ref.append(k[:, :, t: t + 1], v[:, :, t: t + 1])
        want = foscar.decode(q, ref)
        torch.cuda.synchronize()
        assert torch.equal(out, want), t
    assert same_state(snapshot(ref), snapshot(ker))


def test_foscar_append_picks_a_writer_and_says_why_not():
    """``foscar.append``: the Triton kernels where they can write the cache (a CUDA device, min-max), else
    the PyTorch reference; the same cache either way. An explicit choice that cannot run says why."""
    fmt = foscar.KVFormat(bits=4, head_dim=64, group_size=32, recent=4)
    k, v = (bf16_exact(1, 2, 40, 64, seed=s).to(DEV) for s in (8, 9))
    a = foscar.QuantKVCache.empty(fmt, 1, 2, max_len=64, device=DEV)
    b = foscar.QuantKVCache.empty(fmt, 1, 2, max_len=64, device=DEV)
    foscar.append(a, k[:, :, :39], v[:, :, :39])
    foscar.append(a, k[:, :, 39:], v[:, :, 39:])
    foscar.append(b, k, v, backend="reference")
    assert same_state(snapshot(a), snapshot(b))
    with pytest.raises(InvalidArgumentError, match="^backend: expected"):
        foscar.append(a, k[:, :, :1], v[:, :, :1], backend="cute")
    with pytest.raises(InvalidArgumentError, match="^cache: expected a foscar.QuantKVCache"):
        foscar.append(object(), k[:, :, :1], v[:, :, :1])
    with pytest.raises(InvalidArgumentError, match="^k_new: expected a torch.Tensor"):
        foscar.append(a, [1.0], v[:, :, :1])
    if DEV == "cpu":
        with pytest.raises(foscar.UnsupportedError, match="needs a CUDA GPU"):
            foscar.append(a, k[:, :, :1], v[:, :, :1], backend="triton")
    else:
        with pytest.raises(foscar.UnsupportedError, match="only \\(quantizer='quantile'\\)"):
            foscar.append(a, k[:, :, :1], v[:, :, :1], backend="triton", quantizer="quantile")
