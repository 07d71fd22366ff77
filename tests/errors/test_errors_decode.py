"""Bad-input tests: ``decode_exact`` / ``decode_folded``, ``QuantKVCache.dequantize``,
``pack_codes`` / ``unpack_codes``, ``combine_partials`` (the rule and the
helpers: ``_bad_inputs.py``)."""
from __future__ import annotations

import math

import pytest
import torch
from _bad_inputs import (
    B,
    D,
    DECODERS,
    HKV,
    bad_arg,
    query,
)

import foscar
from foscar import (
    combine_partials,
    decode_folded,
    pack_codes,
    unpack_codes,
)

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
