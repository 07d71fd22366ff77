"""Bad-input tests: ``quantize_kv`` and ``PageTable`` (the rule and the
helpers: ``_bad_inputs.py``)."""
from __future__ import annotations

import math
import re

import pytest
import torch
from _bad_inputs import (
    B,
    FMT,
    FMT2,
    FMT_CH,
    FMT_WIN,
    HKV,
    L,
    bad_arg,
    kv,
    unsupported,
)

from foscar import (
    KVFormat,
    PageTable,
    quantize_kv,
)

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


