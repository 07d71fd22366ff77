"""Taking tokens back (``QuantKVCache.rewind``: speculative decoding's rejected drafts). A cache with a BF16 recent
ring (a window, or a channel-wise axis's incomplete group) keeps ``KVFormat.rollback`` more slots, and every write
path writes the new tokens from ``KVFormat.ring_keep_from`` into them, so that a rewind finds the tokens it takes
back into the window still in BF16. Property: after any run of appends and rewinds, every rewind the cache accepts
leaves it equal (its dequantized values, its lengths) to a cache that was given the surviving tokens alone; a
rewind of at most ``rollback`` tokens, after appends of as many, is always accepted; a refused one changes
nothing."""
import pytest
import torch
from _cases import DEV, GPU
from _helpers import rel
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import foscar
from foscar.errors import InvalidArgumentError


@st.composite
def rewind_case(draw):
    bits = draw(st.sampled_from((2, 4)))
    k_axis, v_axis = draw(st.sampled_from((("token", "token"), ("channel", "token"), ("channel", "channel"),
                                           ("token", "channel"))))
    g = draw(st.sampled_from((32, 64)))
    windows = dict(sink=draw(st.sampled_from((0, 0, 3))), recent=draw(st.sampled_from((0, 5, 16))),
                   rollback=draw(st.sampled_from((0, 4, 8))))
    if draw(st.integers(0, 4)) == 0:  # an FP4 block format (token-wise blocks: a ring only with a window)
        fmt = foscar.KVFormat.fp4(draw(st.sampled_from(("nvfp4", "mxfp4"))), 64, **windows)
    else:
        fmt = foscar.KVFormat(bits=bits, head_dim=64, group_size=g, k_axis=k_axis, v_axis=v_axis, **windows)
    ops = draw(st.lists(st.tuples(st.integers(1, 12), st.integers(0, 12)), min_size=1, max_size=6))
    return dict(fmt=fmt, ops=ops, seed=draw(st.integers(0, 2 ** 16)))


def _run(case, append):
    """The case's appends and rewinds on a cache (``append(cache, k, v)``), beside the surviving tokens: the
    cache, those tokens and how many rewinds were refused, each checked to change nothing."""
    fmt, gen = case["fmt"], torch.Generator().manual_seed(case["seed"])
    B, H, D = 2, 2, fmt.head_dim
    cache = foscar.QuantKVCache.empty(fmt, B, H, max_len=256, page_size=64, device=DEV)
    k_kept, v_kept = torch.zeros(B, H, 0, D), torch.zeros(B, H, 0, D)
    since, refused = 0, 0
    for T, r in [(20, 0)] + case["ops"]:
        # values a BF16 ring holds exactly (the interpreter's float32 -> bfloat16 casts truncate)
        k, v = torch.randn(2, B, H, T, D, generator=gen).bfloat16().float().unbind(0)
        append(cache, k.to(DEV), v.to(DEV))
        k_kept, v_kept = torch.cat([k_kept, k], 2), torch.cat([v_kept, v], 2)
        since += T
        before = {n: getattr(cache, n).clone() for n in ("seq_lens", "ring_from", "k_recent", "v_recent")}
        try:
            cache.rewind(r)
        except InvalidArgumentError as e:
            if r > k_kept.shape[2]:
                assert str(e).startswith("tokens: expected a count in")
            else:  # a ring, and more than the appends since the last rewind or more than rollback
                assert str(e).startswith("tokens: expected at most") and fmt.recent_capacity
                assert r > min(fmt.rollback, since)
            assert all(torch.equal(getattr(cache, n), t) for n, t in before.items())
            refused += 1
            continue
        if r:
            k_kept, v_kept, since = k_kept[:, :, :k_kept.shape[2] - r], v_kept[:, :, :v_kept.shape[2] - r], 0
    return cache, k_kept, v_kept, refused


def _fresh(fmt, k, v):
    fresh = foscar.QuantKVCache.empty(fmt, k.shape[0], k.shape[1], max_len=256, page_size=64, device=DEV)
    fresh.append(k.to(DEV), v.to(DEV))
    return fresh


def _same(cache, fresh):
    assert torch.equal(cache.seq_lens, fresh.seq_lens)
    for a, b in zip(cache.dequantize(), fresh.dequantize()):
        assert torch.equal(a, b)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rewind_case())
@example(dict(fmt=foscar.KVFormat(bits=2, head_dim=64, group_size=32, k_axis="channel", rollback=8),
              ops=[(8, 7), (8, 8), (3, 3), (8, 2)], seed=1))
@example(dict(fmt=foscar.KVFormat(bits=4, head_dim=64, group_size=64, recent=5, sink=3, rollback=4),
              ops=[(12, 4), (2, 2), (1, 3)], seed=2))
def test_an_accepted_rewind_is_the_cache_of_the_surviving_tokens(case):
    """The PyTorch write path: after every accepted rewind the cache is that of the surviving tokens."""
    cache, k, v, _ = _run(case, lambda c, k, v: c.append(k, v))
    _same(cache, _fresh(case["fmt"], k, v))


@pytest.mark.parametrize("fmt", [
    foscar.KVFormat(bits=2, head_dim=64, group_size=32, k_axis="channel", rollback=8),
    foscar.KVFormat(bits=4, head_dim=64, group_size=32, sink=3, recent=5, rollback=4),
    foscar.KVFormat(bits=4, head_dim=64, group_size=32, k_axis="channel", v_axis="channel", recent=3, rollback=8),
    foscar.KVFormat.fp4("nvfp4", 64, recent=6, rollback=8)])
def test_the_triton_appends_rewind_alike(fmt):
    """The Triton appends (one token, several: the interpreter on a CPU machine) write the ring as the PyTorch
    path does: the same cache after the same appends and rewinds, bit for bit, and that of the surviving tokens."""
    import foscar.triton as ft

    def triton_append(cache, k, v):
        if k.shape[2] == 1:
            ft.append_step(cache, k[:, :, 0], v[:, :, 0])
        else:
            ft.append(cache, k, v)

    case = dict(fmt=fmt, ops=[(8, 7), (1, 0), (1, 1), (8, 8), (3, 3), (9, 2)], seed=5)
    ours, k, v, refused = _run(case, triton_append)
    ref, _, _, refused_ref = _run(case, lambda c, k, v: c.append(k, v))
    assert refused == refused_ref
    for name in ("seq_lens", "ring_from", "k_codes", "v_codes", "k_params", "v_params", "k_sink", "v_sink",
                 "k_recent", "v_recent"):
        assert torch.equal(getattr(ours, name), getattr(ref, name)), name
    fresh = _fresh(fmt, k, v)
    _same(ours, fresh)
    # the decode kernels read the larger ring where the write paths put the window: a one-token decode and a step
    q = torch.randn(2, 3, 8, 64, generator=torch.Generator().manual_seed(1)).bfloat16().to(DEV)
    for query in (q[:, 0], q):
        out = torch.full(query.shape, float("nan"), device=DEV)
        ft.decode(query, ours, out=out, num_splits=2)
        assert rel(out, foscar.decode_exact(query, fresh)) < (1e-2 if GPU else 1e-5)


def test_rewinds_are_checked():
    """Counts per sequence, negative or past the length refused by name; without ``rollback`` a ring takes back
    none of the tokens it moved on; without a ring any count up to the length."""
    fmt = foscar.KVFormat(bits=4, head_dim=64, group_size=32, k_axis="channel")
    cache = foscar.QuantKVCache.empty(fmt, 2, 1, max_len=128, page_size=64, device=DEV)
    cache.append(*torch.randn(2, 2, 1, 40, 64).to(DEV).unbind(0))
    with pytest.raises(InvalidArgumentError, match=r"^tokens: expected a count in \[0, 40\] for sequence 0"):
        cache.rewind(-1)
    with pytest.raises(InvalidArgumentError, match="^tokens: expected a count in"):
        cache.rewind(torch.tensor([0, 41]))
    with pytest.raises(InvalidArgumentError, match="^tokens: expected an int or an int tensor"):
        cache.rewind(1.0)
    with pytest.raises(InvalidArgumentError, match=r"^tokens: expected at most 8 for sequence 0"):  # 32 quantized
        cache.rewind(9)
    cache.rewind(torch.tensor([8, 3]))
    assert cache.seq_lens.tolist() == [32, 37]
    plain = foscar.KVFormat(bits=4, head_dim=64, group_size=32, sink=4)
    cache = foscar.QuantKVCache.empty(plain, 1, 1, max_len=128, page_size=64, device=DEV)
    cache.append(*torch.randn(2, 1, 1, 40, 64).to(DEV).unbind(0))
    cache.rewind(39)
    assert cache.seq_lens.tolist() == [1]


def test_an_unchecked_rewind_is_the_checked_one():
    """``rewind(tokens, check=False)`` (a CUDA graph's): the lengths go back on the device, as the checked call's."""
    fmt = foscar.KVFormat(bits=4, head_dim=64, group_size=32, k_axis="channel", rollback=8)
    caches = [foscar.QuantKVCache.empty(fmt, 2, 1, max_len=128, page_size=64, device=DEV) for _ in range(2)]
    x = torch.randn(2, 2, 1, 40, 64).bfloat16().float().to(DEV)
    for c in caches:
        c.append(*x.unbind(0))
    counts = torch.tensor([5, 2], dtype=torch.int32, device=DEV)
    caches[0].rewind(counts)
    caches[1].rewind(counts, check=False)
    assert torch.equal(caches[0].seq_lens, caches[1].seq_lens) and caches[1].seq_lens.tolist() == [35, 38]
    caches[1].rewind(1, check=False)
    assert caches[1].seq_lens.tolist() == [34, 37]
    with pytest.raises(InvalidArgumentError, match="^tokens: expected"):  # a host int is checked all the same
        caches[1].rewind(-1, check=False)
    assert caches[1].seq_lens.tolist() == [34, 37]
    with pytest.raises(InvalidArgumentError, match="^tokens: expected"):
        caches[1].rewind(counts.cpu() if GPU else counts.float(), check=False)


def test_rollback_is_ring_slots():
    fmt = foscar.KVFormat(bits=4, head_dim=64, group_size=32, recent=16, rollback=8)
    assert fmt.recent_capacity == 24 and fmt.ring_keep_from(100) == 100 - 24
    assert foscar.KVFormat(bits=4, head_dim=64, group_size=32, rollback=8).recent_capacity == 0  # no ring
    assert foscar.KVFormat(bits=4, head_dim=64, group_size=32, k_axis="channel", rollback=8).recent_capacity == 39
    with pytest.raises(InvalidArgumentError, match="^rollback: expected"):
        foscar.KVFormat(bits=4, head_dim=64, group_size=32, rollback=-1)
