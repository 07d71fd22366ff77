"""``foscar bench``: the modes that run anywhere (accuracy on the CPU reference, the operation count)
write their JSON, Markdown and plot; speed refuses to run without a GPU; the usage is printed."""
import csv
import json

import pytest

from foscar import cli
from foscar.bench import ops


def test_operation_counts():
    assert ops.ops_per_value(4, 128, "paper") == {"fold": 2 * 4 / 128, "reconstruct": 2.0, "heads_computed": 4}
    assert ops.ops_per_value(4, 128, "triton")["heads_computed"] == 8  # the MMA's N, padded to 8
    assert ops.ops_per_value(32, 32, "triton")["fold"] == 2.0  # folding stops paying at G = g
    assert ops.ops_per_value(5, 64, "cute")["heads_computed"] == 8 and ops.ops_per_value(9, 64)["heads_computed"] == 16
    with pytest.raises(ValueError):
        ops.computed_heads(4, "numpy")


def test_ops_mode_writes_table_and_plot(tmp_path, capsys):
    assert cli.main(["bench", "ops", "--out", str(tmp_path)]) == 0
    assert "| paper | 4 | 0.25 | 0.125 | 0.0625 | 2 |" in capsys.readouterr().out
    assert len(json.loads((tmp_path / "ops.json").read_text())) == 2 * 3 * 6
    assert len((tmp_path / "ops.csv").read_text().splitlines()) == 1 + 2 * 3 * 6  # header and the rows
    pytest.importorskip("matplotlib")
    assert (tmp_path / "ops.png").stat().st_size > 1000


def test_accuracy_mode_on_the_cpu(tmp_path, capsys):
    argv = ["bench", "accuracy", "--lengths", "256", "--seeds", "0", "1", "--heads", "4:2", "--head-dim", "64",
            "--group-size", "64", "--out", str(tmp_path)]
    assert cli.main(argv) == 0
    doc = json.loads((tmp_path / "accuracy.json").read_text())
    names = [r["name"] for r in doc["records"]]
    assert names.count("BF16") == 2 and names.count("INT2 min-max") == 2 and len(names) == 14
    assert names.count("INT2 mse-clipped + Hadamard") == 2  # the paper's configurations, then rotated INT2
    assert names.count("INT2 OSCAR clip + Hadamard") == 2
    for r in doc["records"]:
        if r["name"] != "BF16":
            assert 0 < r["err_vs_dequantized"] < r["bf16_err_vs_dequantized"]  # arithmetic error below BF16's
            assert r["err_vs_dequantized"] < r["err_vs_unquantized"]
    md = (tmp_path / "accuracy.md").read_text()
    assert "| INT4 min-max | 256 | 2 |" in md and "0.16-0.22" in md
    rows = list(csv.DictReader((tmp_path / "accuracy.csv").open()))
    assert [r["name"] for r in rows] == names and float(rows[1]["err_vs_dequantized"]) > 0
    err = capsys.readouterr().err
    assert "[------------------------] " not in err and "] 2/2 " in err and "] 1/2 " in err  # the progress bar
    pytest.importorskip("matplotlib")
    assert (tmp_path / "accuracy.png").stat().st_size > 1000


def test_usage_and_speed_without_a_gpu(capsys, monkeypatch, tmp_path):
    assert cli.main(["bench"]) == 2 and "usage: foscar bench" in capsys.readouterr().err
    assert cli.main(["bench", "--help"]) == 0
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli.main(["bench", "speed", "--grid", "quick", "--out", str(tmp_path)]) != 0
    assert "no CUDA device" in capsys.readouterr().err


def test_plot_mode_draws_the_paper_figures_from_records(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    recs = []
    for b, n in ((1, 8192), (8, 32768)):
        for bits in (2, 4):
            for ka, va in (("token", "token"), ("channel", "token")):
                recs.append({"B": b, "L": n, "bits": bits, "k_axis": ka, "v_axis": va, "kernel": "foscar_folded",
                             "speedup_vs_baseline": 1.0 + bits / 10})
    for hkv in (1, 4, 8):
        recs.append({"B": 8, "L": 131072, "Hq": 32, "Hkv": hkv, "bits": 4, "k_axis": "token", "v_axis": "token",
                     "kernel": "foscar_folded", "speedup_vs_baseline": 1.2 + hkv / 100})
    path = tmp_path / "bench_decode.json"
    path.write_text(json.dumps({"records": recs}))
    assert cli.main(["bench", "plot", str(path), "--out", str(tmp_path), "--name", "x"]) == 0
    for fig in ("speedup", "axes", "heads"):
        assert (tmp_path / f"x-{fig}.png").stat().st_size > 1000, fig
    path.write_text(json.dumps({"records": []}))
    assert cli.main(["bench", "plot", str(path), "--out", str(tmp_path)]) == 1
    assert "nothing drawn" in capsys.readouterr().err
