"""Key centring (:mod:`foscar.centring`): the mean is each sequence's (``"prefill"``) or the caller's; the
cache gives its keys back with the mean; the oracle, the folded spec and ``foscar.decode`` (and plans)
agree, the LSE is the uncentred keys' (it merges with other partials); appending to an empty cache whose
mean comes from the first append writes what ``quantize_kv`` with that mean does, bit for bit; centring
lowers the error of keys with a large common offset; bad means are refused by name and a refused append
leaves the mean pending."""
import math

import pytest
import torch
from _helpers import rel

import foscar
from foscar.centring import sequence_means
from foscar.errors import InvalidArgumentError


def _inputs(B=2, H=2, L=500, D=128, G=4, offset=6.0, seed=0):
    gen = torch.Generator().manual_seed(seed)
    k, v = torch.randn(2, B, H, L, D, generator=gen).unbind(0)
    k = k + offset * torch.randn(B, H, 1, D, generator=gen)  # a large per-channel offset common to the tokens
    q = torch.randn(B, H * G, D, generator=gen) / 4
    return q, k, v


def test_the_prefill_mean_is_each_sequences_own():
    _, k, _ = _inputs()
    lens = torch.tensor([500, 37])
    mu = sequence_means(k, lens)
    assert torch.allclose(mu[0].double(), k[0].double().mean(1), atol=1e-6, rtol=0)
    assert torch.allclose(mu[1].double(), k[1, :, :37].double().mean(1), atol=1e-6, rtol=0)
    assert torch.equal(sequence_means(k, torch.tensor([0, 0])), torch.zeros(2, 2, 128))


@pytest.mark.parametrize("fmt_kw", ({}, {"rotation": "hadamard", "sink": 4, "recent": 16},
                                    {"bits": 2, "k_axis": "channel", "group_size": 64}))
@pytest.mark.parametrize("given", (False, True))
def test_a_centred_cache_gives_the_results_of_its_keys(fmt_kw, given):
    q, k, v = _inputs()
    fmt = foscar.KVFormat(**{"bits": 4, "head_dim": 128, "group_size": 128, **fmt_kw})
    mean = torch.randn(2, 2, 128) if given else "prefill"
    lens = torch.tensor([500, 301], dtype=torch.int32)
    cache = foscar.quantize_kv(k, v, fmt, seq_lens=lens, page_size=64, key_mean=mean)
    assert cache.k_mean.shape == (2, 2, 128) and cache.k_mean.dtype == torch.float32
    kd, _ = cache.dequantize()
    assert float((kd[1, :, 301:]).abs().max()) == 0.0, "zeros past each length"
    exact, lse_exact = foscar.decode_exact(q, cache, return_lse=True)
    folded, lse_folded = foscar.decode_folded(q, cache, return_lse=True)
    assert rel(folded, exact) < 1e-12 and float((lse_folded - lse_exact).abs().max()) < 1e-9
    out, lse = foscar.decode(q, cache, return_lse=True)
    assert rel(out, exact) < 5e-3
    assert bool(((lse.double() - lse_exact).abs() <= 2e-3 * (lse_exact.abs() + 1)).all())
    planned, planned_lse = foscar.plan(q, cache).run(q, cache, lse=torch.empty(2, 8))
    assert torch.equal(planned, out) and torch.equal(planned_lse, lse)


def test_centring_lowers_the_error_of_offset_keys():
    q, k, v = _inputs(offset=20.0)
    errs = {}
    for mean in (None, "prefill"):
        fmt = foscar.KVFormat(bits=2, head_dim=128, group_size=128)
        cache = foscar.quantize_kv(k, v, fmt, key_mean=mean)
        s = torch.einsum("bhgd,bhld->bhgl", q.double().view(2, 2, 4, 128), k.double()) / math.sqrt(128)
        ref = torch.einsum("bhgl,bhld->bhgd", s.softmax(-1), v.double()).reshape(2, 8, 128)
        errs[mean] = rel(foscar.decode_exact(q, cache), ref)
    assert errs["prefill"] < 0.5 * errs[None]


@pytest.mark.parametrize("fmt_kw", ({"sink": 4, "recent": 16}, {"k_axis": "channel", "group_size": 64},
                                    {"rotation": "hadamard", "rotation_seed": 1}))
def test_an_empty_cache_takes_its_mean_from_the_first_append(fmt_kw):
    _, k, v = _inputs(L=300)
    fmt = foscar.KVFormat(**{"bits": 4, "head_dim": 128, "group_size": 128, **fmt_kw})
    cache = foscar.QuantKVCache.empty(fmt, 2, 2, max_len=300, page_size=64, key_mean="prefill")
    assert cache.k_mean is None and cache.k_mean_pending
    foscar.append(cache, k[:, :, :0], v[:, :, :0], backend="reference")  # nothing appended: still pending
    assert cache.k_mean_pending
    with pytest.raises(InvalidArgumentError, match="^k_new: expected"):
        foscar.append(cache, k[:, :, :100, :64], v[:, :, :100, :64], backend="reference")
    assert cache.k_mean_pending and cache.k_mean is None, "a refused append leaves the mean pending"
    for t0, t1 in ((0, 120), (120, 121), (121, 300)):
        foscar.append(cache, k[:, :, t0:t1], v[:, :, t0:t1], backend="reference")
    assert not cache.k_mean_pending
    assert torch.equal(cache.k_mean, sequence_means(k[:, :, :120], torch.tensor([120, 120])))
    whole = foscar.quantize_kv(k, v, fmt, page_size=64, key_mean=cache.k_mean)
    for a, b in zip(cache.dequantize(), whole.dequantize()):
        assert torch.equal(a, b)


def test_the_mean_travels_with_export_and_from_quantized():
    q, k, v = _inputs(L=200)
    fmt = foscar.KVFormat(bits=2, head_dim=128, group_size=128, sink=2, recent=8)
    cache = foscar.quantize_kv(k, v, fmt, key_mean="prefill")
    e = cache.export()
    names = ("k_codes", "k_scale", "k_offset", "v_codes", "v_scale", "v_offset", "seq_lens", "k_sink", "v_sink",
             "k_recent", "v_recent", "k_mean")
    again = foscar.QuantKVCache.from_quantized(fmt, **{n: e[n] for n in names})
    a, la = foscar.decode_exact(q, again, return_lse=True)
    b, lb = foscar.decode_exact(q, cache, return_lse=True)
    assert rel(a, b) < 1e-12 and float((la - lb).abs().max()) < 1e-9


@pytest.mark.parametrize("mean,what", [("mean", "None, 'prefill' or"), (torch.zeros(2, 2, 64), "shape"),
                                       (torch.full((2, 2, 128), float("nan")), "finite")])
def test_bad_means_are_refused_by_name(mean, what):
    _, k, v = _inputs(L=64)
    fmt = foscar.KVFormat(bits=4, head_dim=128, group_size=128)
    with pytest.raises(InvalidArgumentError, match=rf"^key_mean: .*{what}"):
        foscar.quantize_kv(k, v, fmt, key_mean=mean)
    with pytest.raises(InvalidArgumentError, match="^key_mean: expected"):
        foscar.QuantKVCache.empty(fmt, 2, 2, max_len=64, key_mean=mean)


def test_the_transformers_cache_takes_a_prefill_mean():
    pytest.importorskip("transformers")
    from foscar.integrations.transformers import FoscarCache
    assert FoscarCache(bits=2, key_mean="prefill").key_mean == "prefill"
    with pytest.raises(InvalidArgumentError, match="^key_mean: expected"):
        FoscarCache(key_mean=torch.zeros(3))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("backend", ("auto", "triton", "cute"))
def test_every_gpu_backend_decodes_a_centred_cache_gpu(backend):
    """Centred and rotated keys through foscar.decode on the GPU: output within the kernels' bound of the
    oracle, LSE the uncentred keys'."""
    from _helpers import bf16_attention, kernel_error_bound
    q, k, v = (x.cuda() for x in _inputs(L=3000))
    fmt = foscar.KVFormat(bits=2, head_dim=128, group_size=128, rotation="hadamard")
    cache = foscar.quantize_kv(k, v, fmt, page_size=64, key_mean="prefill")
    status = {s.name: s for s in foscar.backend_status(q.device, fmt, 4)}
    if backend != "auto" and not status[backend].usable:
        pytest.skip(status[backend].why)
    q = q.bfloat16()
    out, lse = foscar.decode(q, cache, backend=backend, return_lse=True)
    exact, lse_exact = foscar.decode_exact(q, cache, return_lse=True)
    assert rel(out, exact) <= kernel_error_bound(fmt, rel(bf16_attention(q, cache, sdpa=True), exact))
    assert bool(((lse.double() - lse_exact).abs() <= 2e-3 * (lse_exact.abs() + 1)).all())
