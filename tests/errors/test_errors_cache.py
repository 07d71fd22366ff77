"""Bad-input tests: ``QuantKVCache(...)`` and ``QuantKVCache.from_quantized`` (the rule and the
helpers: ``_bad_inputs.py``)."""
from __future__ import annotations

import math
import re

import pytest
import torch
from _bad_inputs import (
    FMT,
    FMT2,
    FMT_CH,
    FMT_WIN,
    bad_arg,
    ctor_kwargs,
    fq_kwargs,
    unsupported,
)

from foscar import (
    KVFormat,
    PageTable,
    QuantKVCache,
    quantize_kv,
)

# --------------------------------------------------------------------------------------------
# QuantKVCache(...) directly
# --------------------------------------------------------------------------------------------
def test_ctor_controls(paged, cache_win):
    for c in (paged, cache_win):
        QuantKVCache(c.fmt, **ctor_kwargs(c))


def test_ctor_fmt(paged):
    for fmt in (None, "fmt", {"bits": 4}):
        with bad_arg("fmt"):
            QuantKVCache(fmt, **ctor_kwargs(paged))


def test_ctor_page_table_type(paged):
    with bad_arg("page_table"):
        QuantKVCache(FMT, **{**ctor_kwargs(paged), "page_table": paged.page_table.block_table})


def test_ctor_page_table_batch(paged):
    pt = PageTable.from_block_table(paged.page_table.block_table[:1])
    with bad_arg("page_table"):
        QuantKVCache(FMT, **{**ctor_kwargs(paged), "page_table": pt})


def test_ctor_page_table_out_of_pool(paged):
    table = paged.page_table.block_table.clone()
    table[1, 0] = paged.num_pool_pages
    with bad_arg("page_table"):
        QuantKVCache(FMT, **{**ctor_kwargs(paged), "page_table": PageTable.from_block_table(table)})


@pytest.mark.parametrize("make", [
    lambda c: c.tolist(),
    lambda c: c.long(),
    lambda c: c.float(),
    lambda c: c[0],  # 2-D
    lambda c: c[..., :100],  # W not a whole number of tokens
    lambda c: torch.empty_strided(c.shape, (1, c.shape[0], c.shape[0] * c.shape[1]), dtype=torch.int32),
], ids=["list", "int64", "float", "2d", "ragged_W", "non_contiguous"])
def test_ctor_k_codes(paged, make):
    with bad_arg("k_codes"):
        QuantKVCache(FMT, **{**ctor_kwargs(paged), "k_codes": make(paged.k_codes)})


def test_ctor_k_codes_page_size_unsupported(paged):
    """W = 64 words = 8 tokens per page: not a multiple of 16. The error names k_codes."""
    with unsupported(re.escape("k_codes page_size=8")):
        QuantKVCache(FMT, **{**ctor_kwargs(paged), "k_codes": paged.k_codes[..., :64].contiguous()})


@pytest.mark.parametrize("make", [
    lambda c: c.long(),
    lambda c: c[:-1],  # fewer pages than k_codes
    lambda c: c[:, :1].contiguous(),  # fewer heads
    lambda c: torch.cat([c, c], -1),
    lambda c: None,
], ids=["int64", "pages", "heads", "words", "none"])
def test_ctor_v_codes(paged, make):
    with bad_arg("v_codes"):
        QuantKVCache(FMT, **{**ctor_kwargs(paged), "v_codes": make(paged.v_codes)})


@pytest.mark.parametrize("name", ["k_params", "v_params"])
@pytest.mark.parametrize("make", [
    lambda p: p.double(),
    lambda p: p.half(),
    lambda p: p[..., 0].contiguous(),  # no (s', z') pair dim
    lambda p: p[:, :, :8].contiguous(),  # too few rows
    lambda p: torch.cat([p, p], 3),  # too many columns
    lambda p: p[:-1].contiguous(),
    lambda p: p.transpose(0, 1).contiguous().transpose(0, 1),  # non-contiguous
], ids=["f64", "f16", "no_pair", "rows", "cols", "pages", "non_contiguous"])
def test_ctor_params(paged, name, make):
    with bad_arg(name):
        QuantKVCache(FMT, **{**ctor_kwargs(paged), name: make(getattr(paged, name))})


@pytest.mark.parametrize("seq_lens", [
    torch.tensor([40.0, 40.0]),
    torch.tensor([[40, 40]]),
    torch.tensor([-1, 40]),
    torch.tensor([40, 49]),  # beyond the 3 pages of 16 this sequence has
    [40, 40],
], ids=["float", "2d", "negative", "beyond_capacity", "list"])
def test_ctor_seq_lens(paged, seq_lens):
    with bad_arg("seq_lens"):
        QuantKVCache(FMT, **{**ctor_kwargs(paged), "seq_lens": seq_lens})


def test_ctor_seq_lens_batch_mismatch_names_page_table(paged):
    with bad_arg("page_table"):
        QuantKVCache(FMT, **{**ctor_kwargs(paged), "seq_lens": torch.tensor([40, 40, 40])})


@pytest.mark.parametrize("name", ["k_sink", "v_sink", "k_recent", "v_recent"])
@pytest.mark.parametrize("make", [
    lambda w: w.float(),
    lambda w: w[:, :, :-1],  # one token short
    lambda w: w[:1],
    lambda w: w[..., :32],
    lambda w: None,
], ids=["float32", "tokens", "batch", "hd", "none"])
def test_ctor_windows(cache_win, name, make):
    with bad_arg(name):
        QuantKVCache(FMT_WIN, **{**ctor_kwargs(cache_win), name: make(getattr(cache_win, name))})


@pytest.mark.parametrize("name", ["v_sink", "k_recent", "v_recent"])
def test_ctor_mixed_window_dtypes(cache_win, name):
    with bad_arg(name) as info:
        QuantKVCache(FMT_WIN, **{**ctor_kwargs(cache_win), name: getattr(cache_win, name).half()})
    assert "k_sink" in str(info.value)


def test_ctor_all_float16_windows_ok(cache_win):
    kw = ctor_kwargs(cache_win)
    for name in ("k_sink", "v_sink", "k_recent", "v_recent"):
        kw[name] = kw[name].half()
    assert QuantKVCache(FMT_WIN, **kw).window_dtype == torch.float16


# --------------------------------------------------------------------------------------------
# QuantKVCache.from_quantized
# --------------------------------------------------------------------------------------------
def test_from_quantized_controls(cache, cache_win, cache_ch):
    QuantKVCache.from_quantized(FMT, **fq_kwargs(cache))
    QuantKVCache.from_quantized(FMT, **fq_kwargs(cache), page_size=16)
    QuantKVCache.from_quantized(FMT_WIN, **fq_kwargs(cache_win, windows=True))
    QuantKVCache.from_quantized(FMT_CH, **fq_kwargs(cache_ch, windows=True))
    kw = fq_kwargs(cache)
    kw["k_codes"] = kw["k_codes"].to(torch.int64)  # any integer dtype
    QuantKVCache.from_quantized(FMT, **kw)


def test_from_quantized_fmt(cache):
    for fmt in (None, "int4"):
        with bad_arg("fmt"):
            QuantKVCache.from_quantized(fmt, **fq_kwargs(cache))


@pytest.mark.parametrize("name", ["k_codes", "v_codes"])
@pytest.mark.parametrize("fmt_bits,value", [(4, 16), (4, 255), (4, -1), (2, 4), (2, -3)])
def test_from_quantized_codes_out_of_range(data, name, fmt_bits, value):
    fmt = FMT if fmt_bits == 4 else FMT2
    kw = fq_kwargs(quantize_kv(*data, fmt))
    codes = kw[name].to(torch.int32)
    codes[1, 0, 3, 7] = value
    kw[name] = codes
    with bad_arg(name) as info:
        QuantKVCache.from_quantized(fmt, **kw)
    assert f"[0, {1 << fmt_bits})" in str(info.value)


@pytest.mark.parametrize("name", ["k_codes", "v_codes"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bool])
def test_from_quantized_codes_not_integer(cache, name, dtype):
    kw = fq_kwargs(cache)
    kw[name] = kw[name].to(dtype)
    with bad_arg(name):
        QuantKVCache.from_quantized(FMT, **kw)


@pytest.mark.parametrize("make", [
    lambda c: c[0],  # 3-D
    lambda c: c.tolist(),
    lambda c: torch.zeros(*c.shape[:3], 128, dtype=torch.uint8),  # head_dim mismatch
], ids=["3d", "list", "hd"])
def test_from_quantized_k_codes_shape(cache, make):
    kw = fq_kwargs(cache)
    kw["k_codes"] = make(kw["k_codes"])
    with bad_arg("k_codes"):
        QuantKVCache.from_quantized(FMT, **kw)


@pytest.mark.parametrize("make", [
    lambda c: c[:, :, :-16],
    lambda c: c[:1],
    lambda c: c[:, :1],
    lambda c: None,
], ids=["tokens", "batch", "heads", "none"])
def test_from_quantized_v_codes_shape(cache, make):
    kw = fq_kwargs(cache)
    kw["v_codes"] = make(kw["v_codes"])
    with bad_arg("v_codes"):
        QuantKVCache.from_quantized(FMT, **kw)


def test_from_quantized_too_short_q_dim(cache):
    """``Q`` (dim 2) must hold every sequence's quantized tokens: lengths longer than the codes given are
    the lengths' fault, and the message says how many tokens the codes hold."""
    kw = fq_kwargs(cache)
    Q = kw["k_codes"].shape[2]
    for name in ("k_codes", "k_scale", "k_offset", "v_codes", "v_scale", "v_offset"):
        kw[name] = kw[name][:, :, : Q - 1]
    with bad_arg("seq_lens") as info:
        QuantKVCache.from_quantized(FMT, **kw)
    assert f"fit the {Q - 1} tokens of k_codes" in str(info.value)
    # Control: shorter sequences need fewer quantized tokens.
    QuantKVCache.from_quantized(FMT, **{**kw, "seq_lens": torch.tensor([Q - 1, Q - 1], dtype=torch.int32)})


@pytest.mark.parametrize("name", ["k_scale", "k_offset", "v_scale", "v_offset"])
@pytest.mark.parametrize("make", [
    lambda s: s.transpose(-1, -2),  # the channel-wise shape [B, H, D/g->?, ...] instead of token-wise
    lambda s: s[..., :1],
    lambda s: s[:, :, :-1],
    lambda s: s[0],
    lambda s: s.to(torch.int32),
    lambda s: s.tolist(),
    lambda s: None,
], ids=["transposed", "groups", "tokens", "3d", "int", "list", "none"])
def test_from_quantized_params_shape_tokenwise(cache, name, make):
    kw = fq_kwargs(cache)
    kw[name] = make(kw[name])
    with bad_arg(name):
        QuantKVCache.from_quantized(FMT, **kw)


def test_from_quantized_params_shape_channelwise(cache_ch, cache):
    """Channel-wise K wants ``[B, H, ceil(Q/g), D]``; token-wise V wants ``[B, H, Q, D/g]``."""
    kw = fq_kwargs(cache_ch, windows=True)
    B_, H_, Q, D_ = kw["k_codes"].shape
    bad = {**kw, "k_scale": torch.zeros(B_, H_, Q, D_ // 32, dtype=torch.float64)}  # token-wise shape
    with bad_arg("k_scale"):
        QuantKVCache.from_quantized(FMT_CH, **bad)
    bad = {**kw, "v_offset": torch.zeros(B_, H_, Q // 32, D_, dtype=torch.float64)}  # channel-wise shape for V
    with bad_arg("v_offset"):
        QuantKVCache.from_quantized(FMT_CH, **bad)
    # The token-wise cache's tensors do not fit a channel-wise format either.
    with bad_arg("k_scale"):
        QuantKVCache.from_quantized(KVFormat(4, 64, 32, k_axis="channel"), **fq_kwargs(cache))


@pytest.mark.parametrize("name", ["k_scale", "k_offset", "v_scale", "v_offset"])
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_from_quantized_nonfinite_params(cache, name, bad):
    kw = fq_kwargs(cache)
    kw[name] = kw[name].clone()
    kw[name][0, 1, 2, 0] = bad
    with bad_arg(name) as info:
        QuantKVCache.from_quantized(FMT, **kw)
    assert "finite" in str(info.value)


@pytest.mark.parametrize("name", ["k_sink", "v_sink", "k_recent", "v_recent"])
def test_from_quantized_missing_window(cache_win, name):
    kw = fq_kwargs(cache_win, windows=True)
    kw[name] = None
    with bad_arg(name):
        QuantKVCache.from_quantized(FMT_WIN, **kw)


def test_from_quantized_windows_optional_when_format_keeps_none(cache):
    QuantKVCache.from_quantized(FMT, **fq_kwargs(cache), k_sink=None, v_recent=None)
    # sink/recent given for a format without windows are accepted (nothing to keep).
    QuantKVCache.from_quantized(FMT, **fq_kwargs(cache, windows=True))


@pytest.mark.parametrize("name", ["k_sink", "v_sink", "k_recent", "v_recent"])
@pytest.mark.parametrize("make", [
    lambda w: w[:, :, :-1],  # too few tokens
    lambda w: w[:1],
    lambda w: w[..., :32],
    lambda w: w[0],  # 3-D
    lambda w: w.float(),
    lambda w: w.tolist(),
], ids=["tokens", "batch", "hd", "3d", "float32", "list"])
def test_from_quantized_bad_window(cache_win, name, make):
    kw = fq_kwargs(cache_win, windows=True)
    kw[name] = make(kw[name])
    with bad_arg(name):
        QuantKVCache.from_quantized(FMT_WIN, **kw)


@pytest.mark.parametrize("name", ["k_sink", "v_sink", "k_recent", "v_recent"])
def test_from_quantized_nonfinite_window(cache_win, name):
    kw = fq_kwargs(cache_win, windows=True)
    kw[name] = kw[name].clone()
    kw[name][1, 0, 0, 3] = math.nan
    with bad_arg(name):
        QuantKVCache.from_quantized(FMT_WIN, **kw)


@pytest.mark.parametrize("name", ["v_sink", "k_recent", "v_recent"])
def test_from_quantized_mixed_window_dtypes(cache_win, name):
    kw = fq_kwargs(cache_win, windows=True)
    kw[name] = kw[name].half()
    with bad_arg(name):
        QuantKVCache.from_quantized(FMT_WIN, **kw)


@pytest.mark.parametrize("seq_lens", [
    torch.tensor([40.0, 40.0]),
    torch.tensor([40]),
    torch.tensor([[40, 40]]),
    torch.tensor([-5, 40]),
    torch.tensor([40, 40], device="meta"),
    [40, 40],
], ids=["float", "batch", "2d", "negative", "device", "list"])
def test_from_quantized_seq_lens(cache, seq_lens):
    with bad_arg("seq_lens"):
        QuantKVCache.from_quantized(FMT, **{**fq_kwargs(cache), "seq_lens": seq_lens})


def test_from_quantized_page_args(cache):
    kw = fq_kwargs(cache)
    with unsupported(re.escape("page_size=24")):
        QuantKVCache.from_quantized(FMT, **kw, page_size=24)
    with bad_arg("page_size"):
        QuantKVCache.from_quantized(FMT, **kw, page_size=0)
    pt = PageTable.from_block_table(torch.arange(6, dtype=torch.int32).reshape(2, 3))
    with bad_arg("num_pages"):
        QuantKVCache.from_quantized(FMT, **kw, page_size=16, page_table=pt)
    with bad_arg("page_table"):
        QuantKVCache.from_quantized(FMT, **kw, page_size=16, page_table=pt, num_pages=5)
    QuantKVCache.from_quantized(FMT, **kw, page_size=16, page_table=pt, num_pages=6)  # control


