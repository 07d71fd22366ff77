"""The ``foscar`` command line (foscar.cli)."""
import json
import math

import pytest
import torch

import foscar
from foscar import backends

from foscar import cli
from foscar.cli import main

SMALL = ["--seq-len", "256", "--qo-heads", "4", "--kv-heads", "2", "--head-dim", "64", "--group-size", "64"]
KEYS = {"format", "bits", "backend", "bytes_per_token", "bf16_bytes_per_token", "compression", "err_vs_unquantized",
        "err_vs_dequantized", "bf16_err_vs_dequantized", "quantize_ms", "decode_ms"}


def test_demo_prints_both_widths_and_backend(capsys):
    assert main(["demo", *SMALL]) == 0
    out = capsys.readouterr().out
    assert f"backend: {cli._select_backend().description}" in out
    lines = out.splitlines()
    for fmt in ("bf16", "int2", "int4"):
        assert any(line.startswith(fmt + " ") for line in lines), fmt


def test_demo_json(tmp_path, capsys):
    path = tmp_path / "demo.json"
    assert main(["demo", *SMALL, "--batch", "2", "--json", str(path)]) == 0
    doc = json.loads(path.read_text())
    assert doc["command"] == "demo" and doc["backend"] == cli._select_backend().name
    assert doc["config"]["batch"] == 2 and doc["config"]["head_dim"] == 64
    rows = {r["format"]: r for r in doc["results"]}
    assert set(rows) == {"bf16", "int2", "int4"}
    for name, row in rows.items():
        assert set(row) == KEYS
        numbers = [v for k, v in row.items() if k not in ("format", "backend") and v is not None]
        assert all(isinstance(v, (int, float)) and math.isfinite(v) for v in numbers), row
    for bits in (2, 4):
        row = rows[f"int{bits}"]
        assert row["bits"] == bits and row["backend"] == cli._select_backend().name
        assert row["bytes_per_token"] == 2 * (64 * bits / 8 + 8 * 64 / 64)
        assert row["bf16_bytes_per_token"] == 2 * 64 * 2
        assert row["compression"] == pytest.approx(row["bf16_bytes_per_token"] / row["bytes_per_token"])
        assert 0 < row["err_vs_dequantized"] < 1e-2  # arithmetic error only
        assert row["err_vs_dequantized"] < row["err_vs_unquantized"]
        assert row["quantize_ms"] >= 0 and row["decode_ms"] >= 0
    assert rows["int4"]["err_vs_unquantized"] < rows["int2"]["err_vs_unquantized"]
    assert rows["bf16"]["err_vs_unquantized"] < 1e-2
    assert str(path) in capsys.readouterr().out


def test_demo_one_width_paged_channel_windows(tmp_path):
    path = tmp_path / "d.json"
    argv = ["demo", *SMALL, "--bits", "4", "--k-axis", "channel", "--v-axis", "channel", "--page-size", "64",
            "--sink", "4", "--recent", "16", "--quantizer", "mse", "--seed", "3", "--json", str(path)]
    assert main(argv) == 0
    doc = json.loads(path.read_text())
    assert [r["format"] for r in doc["results"]] == ["bf16", "int4"]
    assert doc["config"]["page_size"] == 64 and doc["config"]["k_axis"] == "channel"
    assert doc["results"][1]["err_vs_dequantized"] < 1e-2


def test_no_command_prints_help(capsys):
    assert main([]) == 2
    assert "demo" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["demo", "--bits", "3"], ["demo", "--seq-len", "0"], ["demo", "--quantizer", "x"],
                                  ["nope"]])
def test_bad_options_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2


@pytest.mark.parametrize("extra,word", [(["--group-size", "96"], "group_size"), (["--page-size", "8"], "page_size"),
                                        (["--kv-heads", "3"], "num_qo_heads")])
def test_library_errors_are_reported(extra, word, capsys):
    assert main(["demo", *SMALL, *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith("foscar demo: error:") and word in err


@pytest.mark.parametrize("threads", ["0", "2"])
def test_threads_option_leaves_torch_as_it_was(threads, tmp_path):
    before = torch.get_num_threads()
    path = tmp_path / "t.json"
    assert main(["demo", *SMALL, "--bits", "2", "--threads", threads, "--json", str(path)]) == 0
    assert torch.get_num_threads() == before
    want = before if threads == "0" else 2
    assert json.loads(path.read_text())["config"]["threads"] == want


def test_cuda_machine_selects_the_triton_backend(monkeypatch):
    import foscar.api as api
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Fake GPU")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 9))
    monkeypatch.setattr(backends.get("triton"), "status", lambda key: api.BackendStatus("triton", True, "Fake GPU"))
    backend = cli._select_backend()
    assert backend.name == "triton" and "Fake GPU" in backend.description and backend.device.type == "cuda"


@pytest.mark.gpu
def test_demo_on_the_gpu(capsys):
    assert main(["demo", *SMALL]) == 0
    out = capsys.readouterr().out
    usable = {s.name: s.usable for s in foscar.backend_status()}
    assert f"backend: {'cute' if usable['cute'] else 'triton'} " in out  # Hopper with cutlass-dsl: CuTe


def test_info_lists_versions_and_every_backend(capsys):
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("foscar ") and "torch " in out and "nvidia-cutlass-dsl " in out and "apache-tvm-ffi " in out
    for name in ("cute", "triton", "reference"):
        assert any(line.split()[:1] == [name] for line in out.splitlines()), name
    if not torch.cuda.is_available():
        assert "GPU: none" in out and "needs a CUDA GPU" in out
        assert "tuned configs shipped (package data): NVIDIA_H100_80GB_HBM3.json, NVIDIA_H200.json;" in out
    else:  # the tuning file in use and which of its entries apply
        assert "tuning files for" in out and "in use:" in out
