"""The cache layout is the register fragment CuTe DSL builds for Hopper ``wgmma.m64nNk16`` with A from
registers: for every thread, register and half, the code the CuTe kernel extracts from the packed
words (``foscar.cute.fragment.tile_register_source``) is the code of the element CuTe assigns to that
slot (``rs_fragment_ownership``, traced on the host: no GPU)."""
import os

import pytest
import torch

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")  # trace and compile for Hopper without a GPU
pytest.importorskip("cutlass", reason="needs nvidia-cutlass-dsl (pip install -e '.[test]')")

from foscar.cute.fragment import TILE_TOKENS, rs_fragment_ownership, tile_register_source, tile_words  # noqa: E402
from foscar.format import pack_codes  # noqa: E402


def decode(words, word, shift, bits):
    w = words.long() & 0xFFFFFFFF
    return (w[word] >> shift) & ((1 << bits) - 1)


@pytest.mark.parametrize("head_dim", (64, 128, 256))
@pytest.mark.parametrize("bits", (2, 4))
@pytest.mark.parametrize("tensor", ("k", "v"))
def test_packed_tile_feeds_the_cute_fragment(tensor, bits, head_dim):
    gen = torch.Generator().manual_seed(bits * 1000 + head_dim)
    codes = torch.randint(0, 1 << bits, (TILE_TOKENS, head_dim), generator=gen, dtype=torch.int32)
    words = pack_codes(codes, bits, tensor)
    assert words.numel() == tile_words(bits, head_dim, tensor)
    word, shift = tile_register_source(bits, head_dim, tensor)
    if tensor == "k":  # S^T = K Q^T: rows = tokens, k = channels
        own = rs_fragment_ownership(TILE_TOKENS, head_dim)
        expected = codes[own[..., 0], own[..., 1]]
    else:  # O^T = V^T P^T: rows = channels, k = tokens
        own = rs_fragment_ownership(head_dim, TILE_TOKENS)
        expected = codes[own[..., 1], own[..., 0]]
    assert (own >= 0).all(), "a fragment slot CuTe did not assign"
    assert torch.equal(decode(words, word, shift, bits), expected.long())
    # every word of the tile is read, by exactly one thread
    readers = torch.zeros(words.numel(), dtype=torch.long)
    for t in range(word.shape[0]):
        readers[word[t].unique()] += 1
    assert bool((readers == 1).all())


@pytest.mark.parametrize("m", (64, 128, 256))
def test_accumulator_ownership(m):
    """What ``foscar.cute.decode_sm90`` assumes of the C fragment (``S^T`` with m = 64, ``O^T`` with
    m = head_dim): thread 32w + l holds in register e = v0 + 2 v1 + 4 mt the row
    64 mt + 16 w + l // 4 + 8 v1 and the column 2 (l % 4) + v0."""
    from foscar.cute.fragment import rs_accumulator_ownership
    own = rs_accumulator_ownership(m)
    t = torch.arange(128)[:, None]
    e = torch.arange(m * 8 // 128)[None, :]
    w, lane = t // 32, t % 32
    v0, v1, mt = e % 2, (e // 2) % 2, e // 4
    assert torch.equal(own[..., 0], 64 * mt + 16 * w + lane // 4 + 8 * v1)
    assert torch.equal(own[..., 1], 2 * (lane % 4) + v0 + 0 * mt)
