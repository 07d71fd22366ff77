"""Query-weighted rounding of the keys' codes (foscar.key_weights, foscar.quantize.weighted_codes): on the
quantizer's grid, round to nearest under identity weights, a smaller weighted error under a query
distribution's weights, the same cache through every write path, decodes that read it as any cache, and bad
weights refused by name."""
import pytest
import torch

import foscar
from foscar.errors import InvalidArgumentError, UnsupportedError
from foscar.key_weights import query_moments, stored_weights
from foscar.quantize import quantize_for, weighted_codes


def _fresh(seed=None):
    return torch.Generator().manual_seed(int(torch.randint(0, 2**31, ()).item()) if seed is None else seed)


def _low_rank_queries(B, H, n, D, rank, gen):
    basis = torch.randn(B, H, rank, D, generator=gen, dtype=torch.float64)
    return torch.randn(B, H, n, rank, generator=gen, dtype=torch.float64) @ basis \
        + 0.05 * torch.randn(B, H, n, D, generator=gen, dtype=torch.float64)


def _grid(fmt, x, quantizer="oscar"):
    codes, sp, zp = quantize_for(fmt, x, "k", quantizer)
    s, z = fmt.op.unfold(sp, zp)
    g = fmt.group_size
    if fmt.k_axis == "token":
        return codes, s.repeat_interleave(g, -1), z.repeat_interleave(g, -1)
    return codes, s.repeat_interleave(g, -2), z.repeat_interleave(g, -2)


@pytest.mark.parametrize("bits,g,axis", [(2, 64, "token"), (4, 32, "token"), (2, 64, "channel")])
def test_identity_weights_round_to_nearest(bits, g, axis):
    fmt = foscar.KVFormat(bits=bits, head_dim=64, group_size=g, k_axis=axis)
    x = torch.randn(2, 3, 128, 64, generator=_fresh(), dtype=torch.float64) * 3
    codes, s, z = _grid(fmt, x)
    eye = torch.eye(64, dtype=torch.float64).expand(2, 3, 64, 64)
    assert torch.equal(weighted_codes(x, s, z, eye, bits), codes)
    assert torch.equal(weighted_codes(x, s, z, torch.zeros(2, 3, 64, 64), bits), codes), "no weight: nearest"


@pytest.mark.parametrize("bits,g,axis", [(2, 64, "token"), (4, 64, "token"), (2, 32, "token"), (2, 64, "channel")])
def test_the_weighted_error_is_smaller_on_the_same_grid(bits, g, axis):
    """Under the second moments of low-rank queries the rows' weighted error ``e W e^T`` drops well below round
    to nearest's (each KV head's total), with every code on the quantizer's grid; a constant group keeps code 0."""
    gen = _fresh()
    fmt = foscar.KVFormat(bits=bits, head_dim=64, group_size=g, k_axis=axis)
    x = torch.randn(2, 3, 256, 64, generator=gen, dtype=torch.float64)
    x[0, 0, :64, :] = 0.5  # constant groups (token-wise: whole rows; channel-wise: a group of tokens)
    q = _low_rank_queries(2, 3, 400, 64, 6, gen)
    W = q.transpose(-1, -2) @ q
    nearest, s, z = _grid(fmt, x)
    got = weighted_codes(x, s, z, W, bits)
    assert got.dtype == torch.uint8 and int(got.max()) <= 2 ** bits - 1
    assert bool((got[0, 0, :64] == 0).all()) and bool((nearest[0, 0, :64] == 0).all())

    def err(c):
        e = x - (s * c.double() + z)
        return torch.einsum("bhtd,bhde,bhte->bh", e, W, e)
    assert bool((err(got) <= 0.8 * err(nearest)).all()), (err(got) / err(nearest))


@pytest.mark.parametrize("rotation", (None, "hadamard"))
def test_a_cache_with_key_weights_is_the_same_through_every_write(rotation):
    """quantize_kv and appends of a few tokens at a time store the same codes (a row's codes depend on the row
    and the weights only), on the grid of the unweighted cache (same s', z'), with the weights rotated into the
    stored space; the decode reads it as any cache (the reference against the float64 oracle)."""
    gen = _fresh()
    fmt = foscar.KVFormat(bits=2, head_dim=64, group_size=64, rotation=rotation, sink=2, recent=8)
    B, H, L, D = 2, 2, 90, 64
    k, v = (torch.randn(B, H, L, D, generator=gen) for _ in range(2))
    q = _low_rank_queries(B, H, 50, D, 4, gen)
    W = (q.transpose(-1, -2) @ q).float()
    lens = torch.tensor([L, 61], dtype=torch.int32)
    whole = foscar.quantize_kv(k, v, fmt, seq_lens=lens, key_weights=W, page_size=32)
    plain = foscar.quantize_kv(k, v, fmt, seq_lens=lens, page_size=32)
    assert torch.allclose(whole.k_weights.double(), stored_weights(fmt, W).double())
    if rotation:
        r = foscar.rotation.rotation_matrix(fmt, torch.float64)
        assert torch.allclose(whole.k_weights.double(), r.T @ W.double() @ r, rtol=1e-5, atol=1e-3)
    assert torch.equal(whole.k_params, plain.k_params) and torch.equal(whole.v_codes, plain.v_codes)
    assert not torch.equal(whole.k_codes, plain.k_codes)
    grown = foscar.QuantKVCache.empty(fmt, B, H, max_len=L, page_size=32, key_weights=W)
    for t0 in range(0, L, 7):
        t1 = min(L, t0 + 7)
        grown.append(k[:, :, t0:t1], v[:, :, t0:t1])
    exp = foscar.quantize_kv(k, v, fmt, key_weights=W, page_size=32)
    for name in ("k_codes", "k_params", "v_codes", "k_recent", "k_sink"):
        assert torch.equal(getattr(grown, name), getattr(exp, name)), name
    query = torch.randn(B, 4 * H, D, generator=gen).to(torch.bfloat16)
    out = torch.full(query.shape, float("nan"), dtype=torch.bfloat16)
    foscar.decode(query, whole, backend="reference", out=out)
    exact = foscar.decode_exact(query, whole)
    assert torch.isfinite(out).all()
    assert float((out.double() - exact).norm() / exact.norm()) < 2e-2


def test_query_moments_take_a_kv_heads_query_heads():
    gen = _fresh()
    q = torch.randn(2, 6, 5, 8, generator=gen)
    W = query_moments(q, 3)
    assert W.shape == (2, 3, 8, 8)
    want = sum(q[1, h].double().T @ q[1, h].double() for h in (2, 3))
    assert torch.allclose(W[1, 1], want)
    with pytest.raises(InvalidArgumentError, match="num_kv_heads"):
        query_moments(q, 4)
    bad = q.clone()
    bad[0, 0, 0, 0] = float("nan")
    with pytest.raises(InvalidArgumentError, match="q"):
        query_moments(bad, 3)


def test_bad_key_weights_are_refused_and_leave_the_cache_alone():
    fmt = foscar.KVFormat(bits=2, head_dim=64, group_size=64)
    cache = foscar.QuantKVCache.empty(fmt, 1, 2, max_len=64)
    good = torch.eye(64).expand(1, 2, 64, 64).clone()
    cache.set_key_weights(good)
    kept = cache.k_weights.clone()
    nan = good.clone()
    nan[0, 1, 3, 3] = float("nan")
    asym = good.clone()
    asym[0, 0, 0, 1] = 5.0
    neg = good.clone()
    neg[0, 0, 2, 2] = -1.0
    huge = good.double() * 1e39  # finite in float64, past float32's range
    for bad in (torch.eye(64)[None], nan, asym, neg, good.to(torch.int32), huge):
        with pytest.raises(InvalidArgumentError, match="key_weights"):
            cache.set_key_weights(bad)
        assert torch.equal(cache.k_weights, kept)
    with pytest.raises(UnsupportedError, match="key_weights"):
        foscar.QuantKVCache.empty(foscar.KVFormat(bits=4, head_dim=64, group_size=16, scheme="nvfp4"), 1, 2,
                                  max_len=64, key_weights=good)
    cache.set_key_weights(None)
    assert cache.k_weights is None


def test_the_triton_write_path_refuses_key_weights():
    fmt = foscar.KVFormat(bits=2, head_dim=64, group_size=64)
    cache = foscar.QuantKVCache.empty(fmt, 1, 2, max_len=64, key_weights=torch.eye(64).expand(1, 2, 64, 64))
    with pytest.raises(UnsupportedError, match="backend='triton'"):
        foscar.append(cache, torch.randn(1, 2, 3, 64), torch.randn(1, 2, 3, 64), backend="triton")
    assert int(cache.seq_lens[0]) == 0
    foscar.append(cache, torch.randn(1, 2, 3, 64), torch.randn(1, 2, 3, 64))  # auto: the PyTorch path
    assert int(cache.seq_lens[0]) == 3
