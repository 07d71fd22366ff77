"""Bad-input tests for every public entry point of foscar.

Project rule: a bad argument fails with ``foscar.InvalidArgumentError(name, expected, got)``
("name: expected X, got Y") or ``foscar.UnsupportedError(what, reason)`` ("what: unsupported: ..."),
never with ``assert`` or a bare torch/Python error. Every test checks the exception type and that the
message names the offending argument; positive controls next to the bad calls show that the error
comes from the bad argument and not from the surrounding setup.
"""
from __future__ import annotations

import contextlib
import math
import re

import pytest
import torch

import foscar
from foscar import (
    InvalidArgumentError,
    KVFormat,
    PageTable,
    QuantKVCache,
    UnsupportedError,
    combine_partials,
    decode_exact,
    decode_folded,
    pack_codes,
    quantize_kv,
    unpack_codes,
)

D = 64
B, HKV, L = 2, 2, 40
FMT = KVFormat(bits=4, head_dim=D, group_size=32)
FMT2 = KVFormat(bits=2, head_dim=D, group_size=32)
FMT_WIN = KVFormat(bits=4, head_dim=D, group_size=32, sink=4, recent=8)
FMT_CH = KVFormat(bits=4, head_dim=D, group_size=32, k_axis="channel")

DECODERS = pytest.mark.parametrize("decode", [decode_exact, decode_folded], ids=["exact", "folded"])


# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------
@contextlib.contextmanager
def bad_arg(name: str):
    """Expect an InvalidArgumentError whose message starts with ``name: expected``."""
    with pytest.raises(InvalidArgumentError, match=r"^" + re.escape(name) + r": expected ") as info:
        yield info
    assert info.value.argument == name


@contextlib.contextmanager
def unsupported(what_regex: str):
    """Expect an UnsupportedError whose ``what`` matches ``what_regex`` (anchored at the start)."""
    with pytest.raises(UnsupportedError, match=r"^" + what_regex + r".*: unsupported: ") as info:
        yield info


def kv(b=B, h=HKV, length=L, d=D, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(b, h, length, d, generator=gen).to(dtype)
    v = torch.randn(b, h, length, d, generator=gen).to(dtype)
    return k, v


def query(b=B, hq=2 * HKV, d=D, dtype=torch.float32, seed=1):
    return torch.randn(b, hq, d, generator=torch.Generator().manual_seed(seed)).to(dtype)


def ctor_kwargs(cache: QuantKVCache) -> dict:
    return dict(k_codes=cache.k_codes, k_params=cache.k_params, v_codes=cache.v_codes, v_params=cache.v_params,
                seq_lens=cache.seq_lens, page_table=cache.page_table, k_sink=cache.k_sink, v_sink=cache.v_sink,
                k_recent=cache.k_recent, v_recent=cache.v_recent)


FQ_KEYS = ("k_codes", "k_scale", "k_offset", "v_codes", "v_scale", "v_offset", "seq_lens")


def fq_kwargs(cache: QuantKVCache, windows: bool = False) -> dict:
    e = cache.export()
    keys = FQ_KEYS + (("k_sink", "v_sink", "k_recent", "v_recent") if windows else ())
    return {k: e[k] for k in keys}


@pytest.fixture(scope="module")
def data():
    return kv()


@pytest.fixture(scope="module")
def cache(data):
    return quantize_kv(*data, FMT)


@pytest.fixture(scope="module")
def paged(data):
    return quantize_kv(*data, FMT, page_size=16)


@pytest.fixture(scope="module")
def cache2(data):
    return quantize_kv(*data, FMT2)


@pytest.fixture(scope="module")
def cache_win(data):
    return quantize_kv(*data, FMT_WIN, page_size=16)


@pytest.fixture(scope="module")
def cache_ch():
    return quantize_kv(*kv(length=72), FMT_CH)


# --------------------------------------------------------------------------------------------
# the error classes themselves
# --------------------------------------------------------------------------------------------
def test_error_classes_and_wording():
    e = InvalidArgumentError("q", "a 3-D tensor", "shape (1,)")
    assert str(e) == "q: expected a 3-D tensor, got shape (1,)"
    assert (e.argument, e.expected, e.got) == ("q", "a 3-D tensor", "shape (1,)")
    assert isinstance(e, ValueError) and isinstance(e, foscar.FoscarError)
    u = UnsupportedError("page_size=8", "why")
    assert str(u) == "page_size=8: unsupported: why"
    assert isinstance(u, NotImplementedError) and isinstance(u, foscar.FoscarError)


# --------------------------------------------------------------------------------------------
# KVFormat
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kw", [
    dict(bits=4, head_dim=64, group_size=32),
    dict(bits=2, head_dim=128, group_size=128, k_axis="channel", v_axis="token"),
    dict(bits=4, head_dim=64, group_size=64),
    dict(bits=4, head_dim=64, group_size=128, k_axis="channel", v_axis="channel"),
    dict(bits=4, head_dim=64, group_size=256, k_axis="channel", v_axis="channel"),
    dict(bits=2, head_dim=256, group_size=256),
    dict(bits=2, head_dim=64, group_size=32, mapping="e2m1"),
    dict(bits=4, head_dim=64, group_size=32, mapping="e4m3"),
    dict(bits=4, head_dim=64, group_size=32, sink=0, recent=0),
    dict(bits=4, head_dim=64, group_size=32, sink=4, recent=100),
    dict(bits=4, head_dim=64, group_size=32, layout=foscar.LAYOUT_TAG),
])
def test_kvformat_valid(kw):
    KVFormat(**kw)


@pytest.mark.parametrize("bits", [0, 1, 3, 8, 16, -4, 4.0, 2.0, True, False, "4", None])
def test_kvformat_bits(bits):
    with bad_arg("bits"):
        KVFormat(bits=bits, head_dim=64, group_size=32)


@pytest.mark.parametrize("head_dim", [0, 32, 96, 80, 512, -64, 64.0, True, "64", None])
def test_kvformat_head_dim(head_dim):
    with bad_arg("head_dim"):
        KVFormat(bits=4, head_dim=head_dim, group_size=32)


@pytest.mark.parametrize("group_size", [0, 1, 16, 48, 96, 512, 32.0, True, "32", None])
def test_kvformat_group_size(group_size):
    with bad_arg("group_size"):
        KVFormat(bits=4, head_dim=64, group_size=group_size)


@pytest.mark.parametrize("head_dim,group_size,axes,name", [
    (64, 128, ("token", "token"), "k_axis"),
    (64, 128, ("channel", "token"), "v_axis"),
    (64, 256, ("token", "channel"), "k_axis"),
    (128, 256, ("channel", "token"), "v_axis"),
])
def test_kvformat_tokenwise_group_must_divide_head_dim(head_dim, group_size, axes, name):
    with unsupported(re.escape(f"{name}='token' with group_size={group_size}")) as info:
        KVFormat(bits=4, head_dim=head_dim, group_size=group_size, k_axis=axes[0], v_axis=axes[1])
    assert f"head_dim={head_dim}" in str(info.value)


@pytest.mark.parametrize("name", ["k_axis", "v_axis"])
@pytest.mark.parametrize("axis", ["tokens", "Token", "CHANNEL", "", "row", None, 0, ["token"]])
def test_kvformat_axis(name, axis):
    with bad_arg(name):
        KVFormat(bits=4, head_dim=64, group_size=32, **{name: axis})


@pytest.mark.parametrize("mapping", ["fp8", "BF16", "int4", "", None, 0, ["bf16"]])
def test_kvformat_mapping_unknown(mapping):
    with bad_arg("mapping"):
        KVFormat(bits=4, head_dim=64, group_size=32, mapping=mapping)


def test_kvformat_mapping_e2m1_needs_2_bits():
    KVFormat(bits=2, head_dim=64, group_size=32, mapping="e2m1")  # control
    with unsupported(re.escape("mapping='e2m1'")) as info:
        KVFormat(bits=4, head_dim=64, group_size=32, mapping="e2m1")
    assert "bits=4" in str(info.value)


@pytest.mark.parametrize("name", ["sink", "recent"])
@pytest.mark.parametrize("value", [-1, -16, 1.5, 4.0, True, "4", None])
def test_kvformat_sink_recent(name, value):
    with bad_arg(name):
        KVFormat(bits=4, head_dim=64, group_size=32, **{name: value})


@pytest.mark.parametrize("layout", ["foscar-wgmma-rs-v0", "foscar-wgmma-rs-v2", "", "kivi"])
def test_kvformat_layout(layout):
    with unsupported("layout") as info:
        KVFormat(bits=4, head_dim=64, group_size=32, layout=layout)
    assert repr(layout) in str(info.value)


# --------------------------------------------------------------------------------------------
# KVFormat.check_page_size: multiple of lcm(16, 64/bits); channel-wise groups need page | g or g | page
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt,page", [
    (FMT, 16), (FMT, 48), (FMT, 80), (FMT, 256),
    (FMT2, 32), (FMT2, 96), (FMT2, 128),
    (FMT_CH, 16), (FMT_CH, 32), (FMT_CH, 64), (FMT_CH, 96),
    (KVFormat(4, 64, 64, v_axis="channel"), 16), (KVFormat(4, 64, 64, v_axis="channel"), 128),
    (KVFormat(2, 64, 64, k_axis="channel", v_axis="channel"), 32),
])
def test_check_page_size_valid(fmt, page):
    assert fmt.check_page_size(page) == page


@pytest.mark.parametrize("page", [0, -16, 16.0, True, "16", None])
def test_check_page_size_not_an_int(page):
    with bad_arg("page_size"):
        FMT.check_page_size(page)


@pytest.mark.parametrize("fmt,page", [
    (FMT, 8), (FMT, 24), (FMT, 40), (FMT, 1), (FMT, 100),
    (FMT2, 16), (FMT2, 48), (FMT2, 80),  # INT2: the V pack block is 32 tokens
    (FMT_CH, 48),  # g=32: 48 neither divides nor is a multiple of 32
    (KVFormat(4, 64, 64, v_axis="channel"), 48),
    (KVFormat(4, 64, 64, v_axis="channel"), 96),
    (KVFormat(2, 64, 64, k_axis="channel", v_axis="channel"), 96),
])
def test_check_page_size_unsupported(fmt, page):
    with unsupported(re.escape(f"page_size={page}")):
        fmt.check_page_size(page)


def test_check_page_size_uses_given_name():
    with unsupported(re.escape("tile=8")):
        FMT.check_page_size(8, name="tile")
    with bad_arg("tile"):
        FMT.check_page_size(0, name="tile")


# --------------------------------------------------------------------------------------------
# quantize_kv
# --------------------------------------------------------------------------------------------
def test_quantize_kv_controls(data):
    k, v = data
    quantize_kv(k, v, FMT)
    quantize_kv(k, v, FMT, page_size=16)
    quantize_kv(k.half(), v.bfloat16(), FMT, seq_lens=torch.tensor([0, L]), window_dtype=torch.float16)
    quantize_kv(k, v, FMT, quantizer="quantile", clip=0.0)
    quantize_kv(k, v, FMT, quantizer="mse")


@pytest.mark.parametrize("fmt", [None, "int4", dict(bits=4, head_dim=64, group_size=32), 4])
def test_quantize_kv_fmt(data, fmt):
    with bad_arg("fmt"):
        quantize_kv(*data, fmt)


@pytest.mark.parametrize("make_k", [
    lambda k: k.tolist(),
    lambda k: None,
    lambda k: k[0],  # 3-D
    lambda k: k[None],  # 5-D
    lambda k: k.to(torch.int32),
    lambda k: k > 0,
    lambda k: k.to(torch.complex64),
    lambda k: torch.randn(B, HKV, L, 128),  # head_dim mismatch with fmt
    lambda k: torch.randn(B, HKV, L, 32),
], ids=["list", "none", "3d", "5d", "int32", "bool", "complex", "hd128", "hd32"])
def test_quantize_kv_k(data, make_k):
    k, v = data
    with bad_arg("k"):
        quantize_kv(make_k(k), v, FMT)


@pytest.mark.parametrize("make_v", [
    lambda v: v.tolist(),
    lambda v: v[0],
    lambda v: v[:, :, :-1],  # L mismatch
    lambda v: v[:1],  # B mismatch
    lambda v: v[:, :1],  # H mismatch
    lambda v: torch.randn(B, HKV, L, 128),  # D mismatch
    lambda v: v.to(torch.int64),
    lambda v: v.to("meta"),  # another device than k
], ids=["list", "3d", "len", "batch", "heads", "hd", "int64", "device"])
def test_quantize_kv_v(data, make_v):
    k, v = data
    with bad_arg("v"):
        quantize_kv(k, make_v(v), FMT)


@pytest.mark.parametrize("quantizer", ["max", "MINMAX", "", None, 0])
def test_quantize_kv_quantizer(data, quantizer):
    with bad_arg("quantizer"):
        quantize_kv(*data, FMT, quantizer=quantizer)


@pytest.mark.parametrize("clip", [-0.1, 0.5, 0.7, 1.0, math.nan, math.inf, "0.01", None, True])
def test_quantize_kv_clip(data, clip):
    with bad_arg("clip"):
        quantize_kv(*data, FMT, quantizer="quantile", clip=clip)


def test_quantize_kv_clip_checked_even_without_quantized_tokens(data):
    fmt = KVFormat(bits=4, head_dim=64, group_size=32, recent=L)  # everything stays BF16
    with bad_arg("clip"):
        quantize_kv(*data, fmt, quantizer="quantile", clip=0.7)


def test_quantize_kv_clip_ignored_by_other_quantizers(data):
    """``clip`` only parameterises the quantile quantizer; other quantizers ignore it (documented)."""
    quantize_kv(*data, FMT, quantizer="minmax", clip=0.7)


@pytest.mark.parametrize("wd", [torch.float32, torch.float64, torch.int8, "bfloat16", None])
def test_quantize_kv_window_dtype(data, wd):
    with bad_arg("window_dtype"):
        quantize_kv(*data, FMT, window_dtype=wd)


@pytest.mark.parametrize("seq_lens", [
    [L, L],
    torch.tensor([L, L], dtype=torch.float32),
    torch.tensor([True, True]),
    torch.tensor([L, L], dtype=torch.int16),
    torch.tensor([L, L, L]),  # wrong batch
    torch.tensor([L]),
    torch.tensor([[L, L]]),  # 2-D
    torch.tensor(L),  # 0-D
    torch.tensor([L, L + 1]),  # beyond k.shape[2]
    torch.tensor([-1, L]),
    torch.tensor([L, L], device="meta"),  # another device than k
], ids=["list", "float", "bool", "int16", "batch3", "batch1", "2d", "0d", "too_long", "negative", "device"])
def test_quantize_kv_seq_lens(data, seq_lens):
    with bad_arg("seq_lens"):
        quantize_kv(*data, FMT, seq_lens=seq_lens)


@pytest.mark.parametrize("name", ["k", "v"])
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("fmt,token", [
    (FMT, 17),  # quantized part
    (FMT, L - 1),  # last valid token
    (FMT_WIN, 1),  # BF16 sink
    (FMT_WIN, L - 2),  # BF16 recent window
], ids=["quant", "last", "sink", "recent"])
def test_quantize_kv_nonfinite_inside_length(data, name, bad, fmt, token):
    k, v = (t.clone() for t in data)
    (k if name == "k" else v)[1, 1, token, 5] = bad
    with bad_arg(name) as info:
        quantize_kv(k, v, fmt)
    assert "finite" in str(info.value)


@pytest.mark.parametrize("name", ["k", "v"])
def test_quantize_kv_nonfinite_past_seq_lens_is_ignored(data, name):
    """Tokens past ``seq_lens`` are ignored (documented), so NaN/Inf there is accepted."""
    k, v = (t.clone() for t in data)
    x = k if name == "k" else v
    x[0, :, 20:] = math.nan
    x[1, 0, 33] = math.inf
    cache = quantize_kv(k, v, FMT, seq_lens=torch.tensor([20, 33]))
    kd, vd = cache.dequantize()
    assert torch.isfinite(kd).all() and torch.isfinite(vd).all()
    # ... but a NaN exactly at the last valid token is rejected.
    with bad_arg(name):
        quantize_kv(k, v, FMT, seq_lens=torch.tensor([21, 33]))


def test_quantize_kv_page_table_type(data):
    table = torch.arange(6, dtype=torch.int32).reshape(2, 3)
    for pt in (table, table.tolist(), "pages"):
        with bad_arg("page_table"):
            quantize_kv(*data, FMT, page_size=16, page_table=pt, num_pages=6)
    quantize_kv(*data, FMT, page_size=16, page_table=PageTable.from_block_table(table), num_pages=6)  # control


def test_quantize_kv_page_table_without_num_pages(data):
    pt = PageTable.from_block_table(torch.arange(6, dtype=torch.int32).reshape(2, 3))
    with bad_arg("num_pages"):
        quantize_kv(*data, FMT, page_size=16, page_table=pt)


@pytest.mark.parametrize("num_pages", [0, -1, 6.0, "6", True])
def test_quantize_kv_num_pages(data, num_pages):
    pt = PageTable.from_block_table(torch.arange(6, dtype=torch.int32).reshape(2, 3))
    with bad_arg("num_pages"):
        quantize_kv(*data, FMT, page_size=16, page_table=pt, num_pages=num_pages)


def test_quantize_kv_contiguous_rejects_page_table(data):
    pt = PageTable.from_block_table(torch.arange(6, dtype=torch.int32).reshape(2, 3))
    with bad_arg("page_table/num_pages"):
        quantize_kv(*data, FMT, page_table=pt, num_pages=6)
    with bad_arg("page_table/num_pages") as info:
        quantize_kv(*data, FMT, num_pages=6)
    assert "num_pages=6" in str(info.value)


def test_quantize_kv_duplicate_pages(data):
    # 40 tokens in pages of 16 need 3 pages per sequence; page 2 would hold tokens of both.
    pt = PageTable.from_block_table(torch.tensor([[0, 1, 2], [2, 3, 4]], dtype=torch.int32))
    with bad_arg("page_table") as info:
        quantize_kv(*data, FMT, page_size=16, page_table=pt, num_pages=8)
    assert "twice" in str(info.value)
    # Control: a repeated entry past the pages in use is fine.
    pt = PageTable.from_block_table(torch.tensor([[0, 1, 2, 0], [3, 4, 5, 0]], dtype=torch.int32))
    quantize_kv(*data, FMT, page_size=16, page_table=pt, num_pages=8)


@pytest.mark.parametrize("bad_page", [6, 100, -1])
def test_quantize_kv_page_index_out_of_pool(data, bad_page):
    pt = PageTable.from_block_table(torch.tensor([[0, 1, 2], [3, 4, bad_page]], dtype=torch.int32))
    with bad_arg("page_table") as info:
        quantize_kv(*data, FMT, page_size=16, page_table=pt, num_pages=6)
    assert "[0, 6)" in str(info.value)


def test_quantize_kv_too_few_pages(data):
    """Lengths beyond the capacity of the pages given."""
    pt = PageTable.from_block_table(torch.tensor([[0, 1], [2, 3]], dtype=torch.int32))
    with bad_arg("seq_lens"):
        quantize_kv(*data, FMT, page_size=16, page_table=pt, num_pages=4)
    pt = PageTable.from_block_table(torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int32), torch.tensor([3, 2]))
    with bad_arg("seq_lens") as info:
        quantize_kv(*data, FMT, page_size=16, page_table=pt, num_pages=6)
    assert "sequence 1" in str(info.value)
    # Control: shorter sequences fit in two pages.
    quantize_kv(*data, FMT, page_size=16, page_table=pt, num_pages=6, seq_lens=torch.tensor([40, 32]))


def test_quantize_kv_page_table_batch_mismatch(data):
    pt = PageTable.from_block_table(torch.tensor([[0, 1, 2]], dtype=torch.int32))
    with bad_arg("page_table"):
        quantize_kv(*data, FMT, page_size=16, page_table=pt, num_pages=6)


@pytest.mark.parametrize("page", [0, -16, 16.0, True, "16"])
def test_quantize_kv_page_size_not_an_int(data, page):
    with bad_arg("page_size"):
        quantize_kv(*data, FMT, page_size=page)


@pytest.mark.parametrize("fmt,page", [(FMT, 8), (FMT, 24), (FMT2, 16), (FMT2, 48), (FMT_CH, 48)])
def test_quantize_kv_page_size_unsupported(fmt, page):
    k, v = kv(length=64)
    with unsupported(re.escape(f"page_size={page}")):
        quantize_kv(k, v, fmt, page_size=page)


# --------------------------------------------------------------------------------------------
# PageTable
# --------------------------------------------------------------------------------------------
def test_page_table_controls():
    pt = PageTable.from_block_table(torch.tensor([[3, 4], [5, 0]]), torch.tensor([2, 1], dtype=torch.int32))
    assert pt.num_pages.tolist() == [2, 1]
    pt = PageTable.from_csr(torch.tensor([0, 2, 3]), torch.tensor([5, 6, 7], dtype=torch.int32))
    assert pt.block_table.tolist() == [[5, 6], [7, 0]] and pt.num_pages.tolist() == [2, 1]
    PageTable.from_csr(torch.tensor([0, 0]), torch.zeros(0, dtype=torch.int64))  # one empty sequence
    PageTable.from_csr(torch.tensor([0, 1]), torch.tensor([0, 9]))  # trailing unused indices are fine


@pytest.mark.parametrize("table", [
    [[0, 1]],
    None,
    torch.tensor([0, 1]),  # 1-D
    torch.zeros(1, 2, 2, dtype=torch.int32),  # 3-D
    torch.tensor([[0.0, 1.0]]),
    torch.tensor([[True, False]]),
    torch.tensor([[0, 1]], dtype=torch.int16),
], ids=["list", "none", "1d", "3d", "float", "bool", "int16"])
def test_from_block_table_block_table(table):
    with bad_arg("block_table"):
        PageTable.from_block_table(table)


@pytest.mark.parametrize("num_pages", [
    [2, 2],
    torch.tensor([2]),  # wrong batch
    torch.tensor([[2, 2]]),
    torch.tensor([2.0, 2.0]),
    torch.tensor([-1, 2]),
    torch.tensor([2, 3]),  # more than the table's width
    torch.tensor([2, 2], device="meta"),
], ids=["list", "batch", "2d", "float", "negative", "too_many", "device"])
def test_from_block_table_num_pages(num_pages):
    with bad_arg("num_pages"):
        PageTable.from_block_table(torch.zeros(2, 2, dtype=torch.int32), num_pages)


@pytest.mark.parametrize("indptr", [
    [0, 1],
    torch.tensor([[0, 1]]),
    torch.tensor([0.0, 1.0]),
    torch.zeros(0, dtype=torch.int32),  # not even the leading 0
    torch.tensor([1, 2, 3]),  # does not start at 0
    torch.tensor([0, 2, 1]),  # decreasing
    torch.tensor([0, 2, 4]),  # beyond len(indices) = 3
], ids=["list", "2d", "float", "empty", "start", "non_monotone", "beyond"])
def test_from_csr_indptr(indptr):
    with bad_arg("indptr"):
        PageTable.from_csr(indptr, torch.tensor([0, 1, 2]))


@pytest.mark.parametrize("indices", [
    [0, 1, 2],
    torch.tensor([[0, 1, 2]]),
    torch.tensor([0.0, 1.0, 2.0]),
    torch.tensor([0, 1, 2], device="meta"),
], ids=["list", "2d", "float", "device"])
def test_from_csr_indices(indices):
    with bad_arg("indices"):
        PageTable.from_csr(torch.tensor([0, 2, 3]), indices)


def test_page_table_direct_construction():
    PageTable(torch.zeros(2, 3, dtype=torch.int32), torch.zeros(2, dtype=torch.int32))  # control
    with bad_arg("block_table"):
        PageTable([[0, 1, 2]], torch.tensor([3]))
    with bad_arg("block_table"):
        PageTable(torch.zeros(2, 3), torch.zeros(2, dtype=torch.int32))
    with bad_arg("num_pages"):
        PageTable(torch.zeros(2, 3, dtype=torch.int32), torch.zeros(3, dtype=torch.int32))
    with bad_arg("num_pages"):
        PageTable(torch.zeros(2, 3, dtype=torch.int32), [3, 3])


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


# --------------------------------------------------------------------------------------------
# decode_exact / decode_folded
# --------------------------------------------------------------------------------------------
@DECODERS
def test_decode_controls(decode, cache):
    for hq in (HKV, 2 * HKV, 4 * HKV):  # MHA and GQA
        out = decode(query(hq=hq), cache)
        assert out.shape == (B, hq, D) and torch.isfinite(out).all()
    decode(query(dtype=torch.bfloat16), cache, sm_scale=1, dtype=torch.float32)
    decode(query(), cache, sm_scale=0.5, return_lse=True)


@DECODERS
@pytest.mark.parametrize("bad", [None, "cache", {"k": 1}])
def test_decode_cache(decode, bad):
    with bad_arg("cache"):
        decode(query(), bad)


@DECODERS
@pytest.mark.parametrize("make_q", [
    lambda: query().tolist(),
    lambda: None,
    lambda: query()[0],  # 2-D
    lambda: query()[None],  # 4-D
    lambda: query().to(torch.int32),
    lambda: query() > 0,
    lambda: query()[:1],  # batch mismatch
    lambda: torch.randn(3, 2 * HKV, D),
    lambda: torch.randn(B, 2 * HKV, 128),  # head_dim mismatch
    lambda: torch.randn(B, 2 * HKV, 32),
    lambda: torch.randn(B, 0, D),  # Hq = 0
    lambda: torch.randn(B, 3, D),  # Hq not a multiple of Hkv = 2
    lambda: torch.randn(B, 1, D),
    lambda: query().to("meta"),  # another device than the cache
], ids=["list", "none", "2d", "4d", "int32", "bool", "batch1", "batch3", "hd128", "hd32", "hq0", "hq3", "hq1",
        "device"])
def test_decode_q_shape_dtype(decode, cache, make_q):
    with bad_arg("q"):
        decode(make_q(), cache)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="q on another real device needs a CUDA GPU "
                    "(the meta-device case above covers the check on CPU)")
@DECODERS
def test_decode_q_on_cuda_for_cpu_cache(decode, cache):
    with bad_arg("q"):
        decode(query().cuda(), cache)


@DECODERS
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_decode_nonfinite_q(decode, cache, bad):
    q = query()
    q[1, 2, 10] = bad
    with bad_arg("q") as info:
        decode(q, cache)
    assert "finite" in str(info.value)


@DECODERS
@pytest.mark.parametrize("sm_scale", [0, 0.0, -0.125, math.nan, math.inf, -math.inf, True, False, "0.125",
                                      torch.tensor(0.125), [0.125]])
def test_decode_sm_scale(decode, cache, sm_scale):
    with bad_arg("sm_scale"):
        decode(query(), cache, sm_scale=sm_scale)


@DECODERS
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.int32, torch.int64, None, "float64",
                                   torch.complex128])
def test_decode_dtype(decode, cache, dtype):
    with bad_arg("dtype"):
        decode(query(), cache, dtype=dtype)


@pytest.mark.parametrize("tile", [0, -16, 8, 24, 40, 16.0, True, "64", None])
def test_folded_tile_tokens(cache, tile):
    with bad_arg("tile_tokens"):
        decode_folded(query(), cache, tile_tokens=tile)


@pytest.mark.parametrize("tile", [16, 48, 80])
def test_folded_tile_tokens_int2_needs_32(cache, cache2, tile):
    """INT2: the V pack block is 32 tokens, so tiles are multiples of 32."""
    with bad_arg("tile_tokens") as info:
        decode_folded(query(), cache2, tile_tokens=tile)
    assert "multiple of 32" in str(info.value)
    decode_folded(query(), cache2, tile_tokens=32)  # control
    decode_folded(query(), cache, tile_tokens=16)  # INT4 control


@pytest.mark.parametrize("splits", [0, -1, 1.5, 2.0, True, "2", None])
def test_folded_num_splits(cache, splits):
    with bad_arg("num_splits"):
        decode_folded(query(), cache, num_splits=splits)


def test_folded_num_splits_more_than_tiles_ok(cache):
    decode_folded(query(), cache, tile_tokens=16, num_splits=7)


@pytest.mark.parametrize("op", [torch.int32, torch.int8, torch.float64, torch.bool, "bf16", torch.float8_e4m3fn])
def test_folded_operand_dtype(cache, op):
    with bad_arg("operand_dtype"):
        decode_folded(query(), cache, operand_dtype=op)
    decode_folded(query(), cache, operand_dtype=torch.bfloat16)  # control


# --------------------------------------------------------------------------------------------
# QuantKVCache.dequantize, pack_codes / unpack_codes, combine_partials
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.int32, torch.bool, torch.uint8, "float64", None])
def test_dequantize_dtype(cache, dtype):
    with bad_arg("dtype"):
        cache.dequantize(dtype)
    k, _ = cache.dequantize(torch.float32)  # control
    assert k.dtype == torch.float32


@pytest.mark.parametrize("bits,tensor,tokens", [(4, "k", 16), (4, "v", 16), (2, "k", 16), (2, "v", 32),
                                                (4, "k", 48), (2, "v", 64)])
def test_pack_roundtrip_control(bits, tensor, tokens):
    codes = torch.randint(0, 1 << bits, (2, tokens, D), generator=torch.Generator().manual_seed(bits))
    words = pack_codes(codes, bits, tensor)
    assert torch.equal(unpack_codes(words, bits, tensor, D), codes.to(torch.int32))


@pytest.mark.parametrize("bits,tensor,tokens", [(4, "k", 8), (4, "k", 24), (4, "v", 8), (2, "k", 8),
                                                (2, "v", 16), (2, "v", 48)])
def test_pack_codes_token_count(bits, tensor, tokens):
    with bad_arg("codes") as info:
        pack_codes(torch.zeros(tokens, D, dtype=torch.int32), bits, tensor)
    assert "multiple of" in str(info.value)


@pytest.mark.parametrize("codes", [
    [[0] * D] * 16,
    torch.zeros(16 * D, dtype=torch.int32),  # 1-D
    torch.zeros(16, D),  # float
    torch.zeros(16, D, dtype=torch.bool),
    torch.zeros(16, 48, dtype=torch.int32),  # head_dim 48
    torch.full((16, D), 16, dtype=torch.int32),  # out of range for 4 bits
    torch.full((16, D), -1, dtype=torch.int32),
], ids=["list", "1d", "float", "bool", "hd48", "too_big", "negative"])
def test_pack_codes_codes(codes):
    with bad_arg("codes"):
        pack_codes(codes, 4, "k")


@pytest.mark.parametrize("bits", [3, 8, 4.0, True, None])
def test_pack_unpack_bits(bits):
    with bad_arg("bits"):
        pack_codes(torch.zeros(32, D, dtype=torch.int32), bits, "k")
    with bad_arg("bits"):
        unpack_codes(torch.zeros(256, dtype=torch.int32), bits, "k", D)


@pytest.mark.parametrize("tensor", ["q", "K", "", None])
def test_pack_unpack_tensor(tensor):
    with bad_arg("tensor"):
        pack_codes(torch.zeros(32, D, dtype=torch.int32), 4, tensor)
    with bad_arg("tensor"):
        unpack_codes(torch.zeros(256, dtype=torch.int32), 4, tensor, D)


@pytest.mark.parametrize("words", [
    torch.zeros(2, 100, dtype=torch.int32),  # not whole pack blocks (128 words per INT4 K block, D=64)
    torch.zeros(2, 128),  # float
    torch.zeros(2, 128, dtype=torch.int64),
    [0] * 128,
], ids=["ragged", "float", "int64", "list"])
def test_unpack_codes_words(words):
    with bad_arg("words"):
        unpack_codes(words, 4, "k", D)


@pytest.mark.parametrize("head_dim", [48, 0, 64.0, None])
def test_unpack_codes_head_dim(head_dim):
    with bad_arg("head_dim"):
        unpack_codes(torch.zeros(128, dtype=torch.int32), 4, "k", head_dim)


def test_combine_partials():
    o, lse = torch.zeros(2, 3, D), torch.zeros(2, 3)
    combine_partials([o, o], [lse, lse])  # control
    with bad_arg("outs"):
        combine_partials([], [])
    with bad_arg("outs"):
        combine_partials(o, [lse])
    with bad_arg("lses"):
        combine_partials([o, o], [lse])
    with bad_arg("lses"):
        combine_partials([o], lse)


def test_csr_last_page_len_like_flashinfer():
    """FlashInfer's (indptr, indices, last_page_len) describe the quantized lengths; the cache checks them."""
    fmt = foscar.KVFormat(bits=4, head_dim=64, group_size=64)
    k = torch.randn(2, 1, 100, 64)
    indptr = torch.tensor([0, 2, 3], dtype=torch.int32)
    indices = torch.tensor([2, 0, 1], dtype=torch.int32)
    ok = foscar.PageTable.from_csr(indptr, indices, torch.tensor([36, 50], dtype=torch.int32), page_size=64)
    assert ok.quantized_lens.tolist() == [100, 50]
    cache = foscar.quantize_kv(k, k, fmt, seq_lens=torch.tensor([100, 50]), page_size=64, page_table=ok, num_pages=3)
    assert torch.isfinite(foscar.decode_exact(torch.randn(2, 1, 64), cache)).all()
    wrong = foscar.PageTable.from_csr(indptr, indices, torch.tensor([36, 49], dtype=torch.int32), page_size=64)
    with pytest.raises(foscar.InvalidArgumentError, match=r"^page_table: expected last_page_len consistent"):
        foscar.quantize_kv(k, k, fmt, seq_lens=torch.tensor([100, 50]), page_size=64, page_table=wrong, num_pages=3)
    with pytest.raises(foscar.InvalidArgumentError, match=r"^last_page_len: expected values in \[1, page_size=64\]"):
        foscar.PageTable.from_csr(indptr, indices, torch.tensor([0, 50], dtype=torch.int32), page_size=64)
    with pytest.raises(foscar.InvalidArgumentError, match=r"^page_size: expected an int"):
        foscar.PageTable.from_csr(indptr, indices, torch.tensor([36, 50], dtype=torch.int32))
    with pytest.raises(foscar.InvalidArgumentError, match=r"^page_table: expected page_size 64"):
        t32 = foscar.PageTable.from_csr(indptr, indices, torch.tensor([32, 32], dtype=torch.int32), page_size=32)
        foscar.quantize_kv(k, k, fmt, seq_lens=torch.tensor([100, 50]), page_size=64, page_table=t32, num_pages=3)
