"""The caches the bad-input tests of this folder check calls against: built once a module from the same K and V."""
import pytest

from _bad_inputs import FMT, FMT2, FMT_CH, FMT_WIN, kv
from foscar import quantize_kv


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
