"""The decode benchmark as a pytest-benchmark suite, over the same code as ``foscar bench speed``:
random packed caches from :mod:`foscar.bench.common`, ``foscar.decode`` on the auto backend, FlashInfer
BF16 where installed. GPU only; not part of the test run (``testpaths = ["tests"]``):

    python3 -m pytest benchmarks/test_pytest_benchmark.py --benchmark-only --benchmark-json out.json

Each round is one call with the L2 flushed before it and the device synchronized after it
(``benchmark.pedantic``), so rounds measure what ``foscar bench speed`` measures in eager mode.
"""
import pytest
import torch

import foscar
from foscar.bench.common import L2_FLUSH_BYTES, flush_l2, make_block_table, random_cache

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: a benchmark of GPU kernels")
SHAPES = [(1, 8192), (8, 32768), (8, 131072), (64, 32768)]
HQ, HKV, D, PAGE = 32, 8, 128, 64


@pytest.fixture(scope="module")
def flush():
    return torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device="cuda")


def _run(benchmark, fn, flush):
    def setup():
        flush_l2(flush)
        torch.cuda.synchronize()

    def call():
        fn()
        torch.cuda.synchronize()
    benchmark.pedantic(call, setup=setup, rounds=10, warmup_rounds=3)


@pytest.mark.parametrize("bits", (2, 4))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"B{s[0]}-L{s[1] // 1024}K")
def test_foscar_decode(benchmark, flush, shape, bits):
    B, L = shape
    fmt = foscar.KVFormat(bits=bits, head_dim=D, group_size=128)
    cache = random_cache(fmt, make_block_table(B, L // PAGE).cuda(), L, kv_heads=HKV, page=PAGE)
    q = torch.randn(B, HQ, D, dtype=torch.bfloat16, device="cuda")
    p = foscar.plan(q, cache)
    out = torch.empty_like(q)
    benchmark.extra_info.update(backend=p.backend, bits=bits, B=B, L=L, bytes=B * L * HKV * fmt.bytes_per_token())
    _run(benchmark, lambda: p.run(q, cache, out), flush)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"B{s[0]}-L{s[1] // 1024}K")
def test_flashinfer_bf16(benchmark, flush, shape):
    flashinfer = pytest.importorskip("flashinfer", reason="FlashInfer not installed: the BF16 baseline is missing")
    B, L = shape
    pages = L // PAGE
    kv = torch.randn(B * pages, 2, PAGE, HKV, D, dtype=torch.bfloat16, device="cuda")
    q = torch.randn(B, HQ, D, dtype=torch.bfloat16, device="cuda")
    ws = torch.empty(256 * 2 ** 20, dtype=torch.uint8, device="cuda")
    w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=True)
    indptr = torch.arange(B + 1, dtype=torch.int32, device="cuda") * pages
    indices = make_block_table(B, pages).reshape(-1).cuda()
    last = torch.full((B,), PAGE, dtype=torch.int32, device="cuda")
    w.plan(indptr, indices, last, HQ, HKV, D, PAGE, q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
    benchmark.extra_info.update(B=B, L=L, bytes=B * L * HKV * 2 * D * 2)
    _run(benchmark, lambda: w.run(q, kv), flush)
