"""Shared by the bad-input tests of this folder: the formats, the expectations of an error and small inputs (the
module-scoped caches they are checked against: ``conftest.py``).

Project rule: a bad argument fails with ``foscar.InvalidArgumentError(name, expected, got)``
("name: expected X, got Y") or ``foscar.UnsupportedError(what, reason)`` ("what: unsupported: ..."),
never with ``assert`` or a bare torch/Python error. Every test checks the exception type and that the message
names the offending argument; positive controls next to the bad calls show that the error comes from the bad
argument and not from the surrounding setup."""
from __future__ import annotations

import contextlib
import re

import pytest
import torch

from foscar import (
    InvalidArgumentError,
    KVFormat,
    QuantKVCache,
    UnsupportedError,
    decode_exact,
    decode_folded,
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
