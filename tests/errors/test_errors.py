"""Bad-input tests: the error classes, ``KVFormat`` and its page-size check (the rule and the
helpers: ``_bad_inputs.py``)."""
from __future__ import annotations

import re

import pytest
from _bad_inputs import (
    FMT,
    FMT2,
    FMT_CH,
    bad_arg,
    unsupported,
)

import foscar
from foscar import (
    InvalidArgumentError,
    KVFormat,
    UnsupportedError,
)

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


