"""The Triton folded kernel's lazy rescale (``foscar.triton.decode(..., lazy_rescale=True)``, ``LAZY`` in
``fold_decode_stage1``; token-wise V of one channel group): each row's running maximum and the P' units are kept
while no score passes the maximum by 2^8 and no ``|s'_V|`` passes the units, so that a tile usually takes no
reduction of maxima and no rescale. Against the float64 oracle as the eager kernel is (the interpreter on a CPU
machine: the float32 bound of the fold), at every shape that makes it rescale: scores growing along the sequence
(a new maximum every few tiles), V scales growing tile by tile, columns that see no token for several tiles (a
step's causal limit, windows), NaN in one query head (NaN in its rows only), GQA 16 and 32, steps, rotation."""
import pytest
import torch
from _helpers import V_MAGNITUDES, rel
from _cases import DEV, GPU, make, run_and_check

import foscar
import foscar.triton as ft


@pytest.mark.parametrize("bits,G,lens,splits,kw", [
    (2, 4, [1, 77, 300], 3, {}), (4, 16, [130, 64], 2, {}), (2, 32, [200], 1, {}),
    (4, 4, [3, 70, 150], 2, {"sink": 4, "recent": 9}), (2, 4, [1, 77, 161], 3, {"k_axis": "channel"}),
    (4, 8, [90, 33], 5, {"rotation": "hadamard", "rotation_seed": 1})])
def test_the_lazy_rescale_is_the_oracles(bits, G, lens, splits, kw):
    fmt = foscar.KVFormat(bits=bits, head_dim=64, group_size=64, **kw)
    q, cache = make(fmt, lens, Hkv=2 if G <= 8 else 1, G=G, page=32, seed=bits + G)
    if "rotation" in kw:  # a query whose rotation is BF16 (the interpreter's float32 bound, as test_triton's)
        from foscar.rotation import rotate
        q = rotate(rotate(q.double(), fmt).to(torch.bfloat16).double(), fmt, inverse=True).to(
            q.dtype if GPU else torch.float32)
    run_and_check(q, cache, num_splits=splits, lazy_rescale=True)


def _growing(fmt, L, G, seed, keys: float, values: float):
    """A cache of one KV head whose keys grow along the sequence (``keys``: each row's scores rise by about
    ``7 keys`` units of log2 over 64 tokens, a new running maximum at every tile; far past FP32's range over
    the sequence, unless the maxima follow) and whose V scales grow by ``2^values`` a tile (the P' units follow)."""
    gen = torch.Generator().manual_seed(seed)
    t = torch.arange(L, dtype=torch.float32) / 64
    k = torch.randn(1, 1, L, fmt.head_dim, generator=gen).abs() * (1 + keys * t)[None, None, :, None]
    v = torch.randn(1, 1, L, fmt.head_dim, generator=gen) * (2.0 ** (values * t))[None, None, :, None]
    q = torch.randn(1, G, fmt.head_dim, generator=gen).abs().bfloat16()  # the keys point the query's way
    cache = foscar.quantize_kv(k, v, fmt, seq_lens=torch.tensor([L], dtype=torch.int32), page_size=64)
    if DEV != "cpu":
        from foscar.bench import cache_to
        cache, q = cache_to(cache, DEV), q.to(DEV)
    return q, cache


@pytest.mark.parametrize("bits,G,splits,keys,values", [(2, 4, 1, 2.0, 0.0), (4, 32, 2, 2.0, 0.0), (2, 4, 1, 0.0, 1.0),
                                                       (4, 16, 1, 2.0, 1.0)])
def test_growing_scores_and_scales_rescale_when_they_must(bits, G, splits, keys, values):
    """Scores that pass the running maxima by more than the headroom at every tile (over 640 tokens they rise by
    about 140 units of log2: without the rescale, P overflows FP32), V scales that grow at every tile."""
    fmt = foscar.KVFormat(bits=bits, head_dim=64, group_size=64)
    q, cache = _growing(fmt, 640, G, bits, keys, values)
    lazy = run_and_check(q, cache, num_splits=splits, lazy_rescale=True, tol=2e-5)
    eager = run_and_check(q, cache, num_splits=splits, lazy_rescale=False, tol=2e-5)
    assert lazy <= 2 * eager + 1e-7, (lazy, eager)


@pytest.mark.parametrize("magnitude", V_MAGNITUDES)
def test_values_of_any_magnitude_with_the_lazy_rescale(magnitude):
    """V of any magnitude the library takes, and constant groups with an offset before tiny ones: the P' units
    follow the scales up."""
    from _helpers import magnitude_cache
    q, cache = magnitude_cache(foscar.KVFormat(bits=2, head_dim=64, group_size=64), magnitude, DEV)
    run_and_check(q, cache, num_splits=2, tol=2e-5, lazy_rescale=True)


def test_tiny_then_large_values_raise_the_units():
    """V of magnitude 1e-30 for the first 320 tokens, then 1e24: the P' units set by the first tiles must follow
    the scales up by 2^180 (else ``P s' / sigma`` overflows FP32, and FP16 long before)."""
    gen = torch.Generator().manual_seed(7)
    k, v = torch.randn(2, 1, 2, 700, 64, generator=gen).unbind(0)
    v[:, :, :320] *= 1e-30
    v[:, :, 320:] *= 1e24
    fmt = foscar.KVFormat(bits=2, head_dim=64, group_size=64)
    cache = foscar.quantize_kv(k.to(DEV), v.to(DEV), fmt, seq_lens=torch.tensor([700], dtype=torch.int32, device=DEV))
    q = torch.randn(1, 4, 64, generator=gen).bfloat16().to(DEV)
    run_and_check(q, cache, num_splits=1, tol=2e-5, lazy_rescale=True)


@pytest.mark.parametrize("T,kw", [(3, {}), (4, {"sink": 4, "recent": 16, "rollback": 3})])
def test_a_step_with_the_lazy_rescale_is_the_oracles(T, kw):
    """A step's rows: columns that see no token of a split's first tiles (the causal limit) keep their maximum
    at -inf until they do; lengths whose last tile ends inside the step's tokens (the masks of 16 rows or more
    are taken by the tiles that reach the first row's limit, not only the length)."""
    from _cases import make_step
    fmt = foscar.KVFormat(bits=4, head_dim=64, group_size=64, **kw)
    q, cache = make_step(fmt, [T, 90, 161, 128, 129], T, seed=T)
    exact = foscar.decode_exact(q, cache)
    out = torch.full(q.shape, float("nan"), dtype=torch.float32, device=q.device)
    ft.decode(q, cache, out=out, num_splits=5, lazy_rescale=True)
    assert bool(torch.isfinite(out).all()) and rel(out, exact) < (1e-2 if GPU else 1e-5)


@pytest.mark.parametrize("tensor", ("k", "v"))
def test_a_broken_scale_decodes_to_nan_where_the_oracle_does(tensor):
    """A NaN planted in one token's K or V scale after the checks: NaN exactly where the oracle is NaN (the rows
    of its KV head), every other element the oracle's; a NaN passes no comparison of the lazy test, and never
    hides another column's first scores from it."""
    from _cases import broken_cache
    cache = broken_cache("params", DEV)
    if tensor == "v":  # the same token's V scale instead
        page = int(cache.page_table.block_table[0, 0])
        cache.k_params[page, 1, 5, 0, 0] = cache.k_params[page, 0, 5, 0, 0]
        cache.v_params[page, 1, 5, 0, 0] = float("nan")
    q = torch.randn(2, 4, 64, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16).to(DEV)
    out = torch.full((2, 4, 64), 7.0, dtype=torch.float32, device=DEV)
    ft.decode(q, cache, out=out, num_splits=2, lazy_rescale=True)
    ref = foscar.decode_exact(q, cache)
    assert torch.isnan(ref[0, 2:]).any()
    assert torch.equal(torch.isnan(out).cpu(), torch.isnan(ref).cpu())
    fin = ~torch.isnan(ref)
    assert float((out.double() - ref)[fin].norm() / ref[fin].norm()) < (5e-3 if GPU else 1e-4)


def test_lazy_rescale_is_checked():
    fmt = foscar.KVFormat(bits=2, head_dim=64, group_size=64)
    q, cache = make(fmt, [64], Hkv=1, G=4, page=64)
    with pytest.raises(foscar.InvalidArgumentError, match="^lazy_rescale: expected True, False or None"):
        ft.decode(q, cache, lazy_rescale=1)
