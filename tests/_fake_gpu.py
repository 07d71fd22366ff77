"""The CPU standing in for a GPU, for the decode benchmark's driver run end to end in the tests: CUDA's host calls
(events timed by the host clock, no-op syncs, a device name), the Triton backend usable with a stand-in
``foscar.triton`` module (:func:`fake_triton_module`), FlashInfer absent, and the driver's target
(:data:`CPU_TARGET`)."""
import sys
import time
import types

import torch

import foscar
import foscar.bench.decode as bd
from foscar import backends
from foscar.backends import BackendStatus


class FakeEvent:
    """``torch.cuda.Event`` on the host clock."""

    def __init__(self, enable_timing=False):
        self.t = None

    def record(self):
        self.t = time.perf_counter()

    def elapsed_time(self, end):
        return (end.t - self.t) * 1e3


def fake_triton_module(folded_ok: bool = True) -> types.ModuleType:
    """A ``foscar.triton`` stand-in at any head dim: ``decode`` the folded reference with BF16 operands (without
    ``folded_ok``, its last row left NaN: an unwritten row), no reconstruct kernel; ``decode_bf16`` SDPA over each
    sequence's pages."""
    mod = types.ModuleType("foscar.triton")

    def decode(q, cache, *, sm_scale=None, out=None, num_splits=None, kernel="folded"):
        if kernel != "folded":
            raise NotImplementedError(f"kernel={kernel!r} not written yet")
        o = foscar.decode_folded(q, cache, dtype=torch.float32, operand_dtype=torch.bfloat16)
        if not folded_ok:
            o[-1, -1] = float("nan")  # one unwritten row
        return out.copy_(o)

    def decode_bf16(q, k_cache, v_cache, block_table, seq_lens, *, out):  # caches [pages, Hkv, page, D]
        _, hkv, _, d = k_cache.shape
        for b in range(q.shape[0]):
            pages = block_table[b].long()
            k, v = (c[pages].transpose(0, 1).reshape(hkv, -1, d).float() for c in (k_cache, v_cache))
            o = torch.nn.functional.scaled_dot_product_attention(q[b].float().unsqueeze(1), k, v, enable_gqa=True)
            out[b] = o.squeeze(1)
        return out

    mod.decode, mod.decode_bf16 = decode, decode_bf16
    return mod


def no_triton_reader():
    raise RuntimeError("no GPU for the Triton reader here")  # (its own test runs it interpreted)


#: The CPU stands in for the GPU: a small L2 flush, no Triton reader.
CPU_TARGET = bd.Target(device="cpu", flush_bytes=1 << 20, read_kernel=no_triton_reader)


def stand_in(monkeypatch, triton_module=None) -> None:
    """CUDA's host calls stood in for, FlashInfer absent, the Triton backend usable on the CPU, and (given)
    ``triton_module`` as ``foscar.triton``; run the driver with ``bd.main(argv, target=CPU_TARGET)``."""
    monkeypatch.setattr(backends.get("triton"), "status",
                        lambda key: BackendStatus("triton", True, "fake Triton on the CPU"))
    for name, fake in (("is_available", lambda: True), ("synchronize", lambda: None), ("empty_cache", lambda: None),
                       ("Event", FakeEvent), ("_sleep", lambda cycles: None),
                       ("get_device_name", lambda *a: "fake CPU device"),
                       ("get_device_properties", lambda *a: types.SimpleNamespace(multi_processor_count=0,
                                                                                   total_memory=0))):
        monkeypatch.setattr(torch.cuda, name, fake)
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: None)
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # import fails as on a machine without the wheel
    if triton_module is not None:
        use_triton(monkeypatch, triton_module)


def use_triton(monkeypatch, module) -> None:
    """``module`` as ``foscar.triton``."""
    monkeypatch.setitem(sys.modules, "foscar.triton", module)
    monkeypatch.setattr(foscar, "triton", module, raising=False)
