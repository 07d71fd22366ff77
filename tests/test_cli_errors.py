"""Bad options of every ``foscar`` command, and of ``python -m foscar.bench.decode`` and ``python -m
foscar.tune``, are refused before any work, with exit status 2 and one error line naming the option (after
argparse's usage lines), never a traceback; output paths are checked first; the demo reports the bytes its
cache holds; the help texts are whole sentences."""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from foscar import cli

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["--seq-len", "256", "--qo-heads", "4", "--kv-heads", "2", "--head-dim", "64", "--group-size", "64"]
NOT_JSON = "not json"
on_linux = pytest.mark.skipif(not Path("/proc/self").exists(), reason="needs /proc (Linux)")


def _run(argv, capsys):
    """``foscar argv`` in this process: (exit status, stdout, stderr)."""
    try:
        code = cli.main(argv)
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def _assert_one_error_line(err: str, prog: str, *words: str) -> str:
    """stderr is argparse's usage (if any) and then exactly one ``prog: error: ...`` line with ``words``."""
    assert "Traceback" not in err, err
    lines = err.rstrip("\n").splitlines()
    *usage, last = lines
    assert all(line.startswith(("usage:", " ")) for line in usage), err
    assert last.startswith(f"{prog}: error: "), err
    for word in words:
        assert word in last, (word, last)
    return last


@pytest.fixture
def files(tmp_path):
    """A plain file, a file that is not JSON, and a valid (empty) record file."""
    plain = tmp_path / "plain.txt"
    plain.write_text("x")
    bad = tmp_path / "bad.json"
    bad.write_text(NOT_JSON)
    good = tmp_path / "good.json"
    good.write_text(json.dumps({"records": []}))
    return {"dir": str(tmp_path), "plain": str(plain), "bad": str(bad), "good": str(good)}


# (argv, prog, words in the error line); {dir}/{plain}/{bad}/{good} from the fixture
PARSE_ERRORS = [
    ("bench accuracy --heads abc", "foscar bench accuracy", ["--heads", "'abc'"]),
    ("bench accuracy --heads 32:5", "foscar bench accuracy", ["--heads", "multiple"]),
    ("bench accuracy --heads 0:0", "foscar bench accuracy", ["--heads"]),
    ("bench accuracy --lengths 0", "foscar bench accuracy", ["--lengths", ">= 2"]),
    ("bench accuracy --lengths x", "foscar bench accuracy", ["--lengths"]),
    ("bench accuracy --seeds 100000000000000000000000", "foscar bench accuracy", ["--seeds"]),
    ("bench accuracy --group-size 100", "foscar bench accuracy", ["--group-size", "100"]),
    ("bench accuracy --group-size 0", "foscar bench accuracy", ["--group-size"]),
    ("bench accuracy --head-dim 100", "foscar bench accuracy", ["--head-dim"]),
    ("bench accuracy --backend cuda", "foscar bench accuracy", ["--backend", "'cuda'"]),
    ("bench accuracy --k-operand e4m3x3", "foscar bench accuracy", ["--k-operand", "--backend cute"]),
    ("bench accuracy --k-operand e5m2", "foscar bench accuracy", ["--k-operand", "'e5m2'"]),
    ("bench accuracy --out {plain}/x", "foscar bench accuracy", ["--out", "not a folder"]),
    ("bench ops --out {plain}", "foscar bench ops", ["--out", "expected a folder"]),
    ("bench ops --out {plain}/x", "foscar bench ops", ["--out", "not a folder"]),
    ("bench plot missing.json", "foscar bench plot", ["json", "missing.json", "no such file"]),
    ("bench plot {dir}", "foscar bench plot", ["json", "folder"]),
    ("bench plot {bad}", "foscar bench plot", ["json", "bad.json", "JSON"]),
    ("bench plot {plain}", "foscar bench plot", ["json", "plain.txt"]),
    ("bench plot {good} --name a/b", "foscar bench plot", ["--name"]),
    ("bench plot {good} --out {plain}/x", "foscar bench plot", ["--out"]),
    ("bench speed --heads abc", "foscar bench speed", ["--heads"]),
    ("bench speed --heads 32:5", "foscar bench speed", ["--heads"]),
    ("bench speed --iters 2", "foscar bench speed", ["--iters"]),
    ("bench speed --warmup 0", "foscar bench speed", ["--warmup"]),
    ("bench speed --num-splits 0", "foscar bench speed", ["--num-splits"]),
    ("bench speed --max-gb -1", "foscar bench speed", ["--max-gb"]),
    ("bench speed --ceiling-gib 0", "foscar bench speed", ["--ceiling-gib"]),
    ("bench speed --shape-factor nan", "foscar bench speed", ["--shape-factor"]),
    ("bench speed --out {plain}/x", "foscar bench speed", ["--out"]),
    ("bench speed --shapes 1:100", "foscar bench speed", ["--shapes"]),
    ("demo --json /nonexistent/x.json", "foscar demo", ["--json", "/nonexistent", "does not exist"]),
    ("demo --json {dir}", "foscar demo", ["--json", "folder"]),
    ("demo --json {plain}/x.json", "foscar demo", ["--json"]),
    ("demo --threads 100000", "foscar demo", ["--threads"]),
    ("demo --seed 100000000000000000000000", "foscar demo", ["--seed"]),
    ("demo --head-dim 3", "foscar demo", ["--head-dim"]),
    ("demo --seq-len 1", "foscar demo", ["--seq-len"]),
    ("demo --batch 0", "foscar demo", ["--batch"]),
    ("demo --sink -1", "foscar demo", ["--sink"]),
    ("tune --dry-run --page-size 0", "foscar tune", ["--page-size"]),
    ("tune --dry-run --page-size 24", "foscar tune", ["--page-size", "page_size=24"]),
    ("tune --dry-run --group-size 100", "foscar tune", ["--group-size", "100"]),
    ("tune --dry-run --head-dim 0", "foscar tune", ["--head-dim"]),
    ("tune --dry-run --head-dim 100", "foscar tune", ["--head-dim"]),
    ("tune --dry-run --iters 0", "foscar tune", ["--iters"]),
    ("tune --dry-run --warmup -1", "foscar tune", ["--warmup"]),
    ("tune --out {plain}/x", "foscar tune", ["--out"]),
    ("info extra", "foscar", ["unrecognized arguments: extra"]),
]


@pytest.mark.parametrize("cmd,prog,words", PARSE_ERRORS, ids=[c for c, _, _ in PARSE_ERRORS])
def test_bad_option_is_one_line_exit_2(cmd, prog, words, files, capsys):
    argv = [a.format(**files) for a in cmd.split()]
    code, out, err = _run(argv, capsys)
    assert code == 2, (code, err)
    assert out == ""  # refused before any work
    _assert_one_error_line(err, prog, *words)


@on_linux
@pytest.mark.parametrize("cmd", ["bench ops --out /proc/x", "bench accuracy --out /proc/x", "demo --json /proc/x.json",
                                 "bench speed --out /proc/x", "tune --out /proc/x"])
def test_unwritable_output_path_is_refused(cmd, capsys):
    code, out, err = _run(cmd.split(), capsys)
    prog = "foscar " + " ".join(w for w in cmd.split() if not w.startswith("-") and "/" not in w)
    assert code == 2 and out == ""
    _assert_one_error_line(err, prog, "/proc", "cannot write")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU refusal of a GPU backend")
def test_accuracy_refuses_a_backend_that_cannot_run_here(capsys):
    code, out, err = _run(["bench", "accuracy", "--backend", "triton"], capsys)
    assert code == 2 and out == ""
    _assert_one_error_line(err, "foscar bench accuracy", "--backend", "triton", "needs a CUDA GPU")


@pytest.mark.parametrize("extra,words", [
    (["--group-size", "96"], ["argument --group-size", "group_size"]),
    (["--page-size", "24"], ["argument --page-size", "page_size"]),
    (["--kv-heads", "3"], ["argument --qo-heads", "num_qo_heads"]),
])
def test_demo_library_errors_name_the_option_before_any_work(extra, words, capsys):
    code, out, err = _run(["demo", *SMALL, *extra], capsys)
    assert code == 2 and out == ""
    _assert_one_error_line(err, "foscar demo", *words)


def test_unknown_bench_mode(capsys):
    code, out, err = _run(["bench", "nope"], capsys)
    assert code == 2 and out == ""
    _assert_one_error_line(err, "foscar bench", "'nope'", "speed, accuracy, ops, plot")


def test_demo_checks_the_json_path_before_the_work(capsys):
    t0 = time.perf_counter()
    code, out, err = _run(["demo", "--json", "/nonexistent/x.json"], capsys)  # the full-size demo, were it run
    assert code == 2 and out == "" and time.perf_counter() - t0 < 2.0
    _assert_one_error_line(err, "foscar demo", "--json")


def test_speed_without_a_gpu_says_what_is_missing(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code, out, err = _run(["bench", "speed", "--grid", "quick", "--out", str(tmp_path)], capsys)
    assert code == 1 and out == ""
    assert err.splitlines() == ["foscar bench speed: error: needs a CUDA GPU (no CUDA device here): it times GPU "
                                "kernels"]


# --------------------------------------------------------------------------------------------
# The real console command: no traceback, the exit status reaches the shell
# --------------------------------------------------------------------------------------------
def _foscar() -> list[str]:
    script = Path(sys.executable).parent / "foscar"
    return [str(script)] if script.exists() else [sys.executable, "-m", "foscar.cli"]


@pytest.mark.parametrize("cmd,prog", [("bench accuracy --heads abc", "foscar bench accuracy"),
                                      ("bench plot missing.json", "foscar bench plot"),
                                      ("demo --json /nonexistent/x.json", "foscar demo")])
def test_console_command_prints_no_traceback(cmd, prog):
    res = subprocess.run(_foscar() + cmd.split(), capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert res.returncode == 2 and res.stdout == ""
    _assert_one_error_line(res.stderr, prog)


# --------------------------------------------------------------------------------------------
# What the demo reports
# --------------------------------------------------------------------------------------------
def test_demo_counts_window_tokens_at_their_bytes(tmp_path, capsys):
    path = tmp_path / "d.json"
    code, out, _ = _run(["demo", *SMALL, "--sink", "5000", "--json", str(path)], capsys)
    assert code == 0
    doc = json.loads(path.read_text())
    for row in doc["results"]:
        assert row["bytes_per_token"] == 2 * 64 * 2 and row["compression"] == 1.0  # every token is BF16
    assert doc["config"]["quantized_tokens"] == 0 and doc["config"]["window_tokens"] == 256
    assert "nothing is quantized" in out and "6.40x" not in out

    code, out, _ = _run(["demo", *SMALL, "--bits", "2", "--sink", "4", "--recent", "60", "--json", str(path)], capsys)
    assert code == 0
    row = json.loads(path.read_text())["results"][1]
    quantized = 2 * (64 * 2 / 8 + 8 * 64 / 64)  # codes and FP32 s', z' of one token, K and V
    assert row["bytes_per_token"] == pytest.approx((192 * quantized + 64 * 2 * 64 * 2) / 256)
    assert row["compression"] == pytest.approx(256 / row["bytes_per_token"])
    assert "64 of the 256 tokens of each sequence stay BF16, 192 are quantized" in out


def test_demo_footer_points_to_an_installed_command(capsys):
    code, out, _ = _run(["demo", *SMALL, "--bits", "4"], capsys)
    assert code == 0
    assert "benchmarks/" not in out and "`foscar bench speed`" in out


# --------------------------------------------------------------------------------------------
# Help texts
# --------------------------------------------------------------------------------------------
def _help(argv, capsys) -> str:
    code, out, _ = _run(argv + ["--help"], capsys)
    assert code == 0
    return out


def _description(text: str) -> str:
    """The paragraph after the usage block."""
    blocks = text.split("\n\n")
    return " ".join(blocks[1].split())


HELP_COMMANDS = [["demo"], ["info"], ["tune"], ["bench", "speed"], ["bench", "accuracy"], ["bench", "ops"],
                 ["bench", "plot"]]


@pytest.mark.parametrize("argv", HELP_COMMANDS, ids=" ".join)
def test_help_names_the_command_and_describes_it_in_whole_sentences(argv, capsys):
    text = _help(argv, capsys)
    assert text.startswith(f"usage: foscar {' '.join(argv)} ")
    desc = _description(text)
    assert desc[:1].isupper() and desc.endswith("."), desc


def _options_without_help(text: str) -> list[str]:
    """Options in an argparse help text's ``options:`` section with no help string."""
    section = text.split("options:\n", 1)[1]
    entries: list[list[str]] = []
    for line in section.splitlines():
        if line.startswith("  -"):
            entries.append([line])
        elif line.startswith("    ") and entries:
            entries[-1].append(line)
    bare = []
    for entry in entries:
        first = entry[0].strip()
        if len(entry) == 1 and "  " not in first:
            bare.append(first)
    return bare


@pytest.mark.parametrize("argv", [["demo"], ["tune"], ["bench", "speed"], ["bench", "accuracy"], ["bench", "ops"],
                                  ["bench", "plot"]], ids=" ".join)
def test_every_option_has_a_help_string(argv, capsys):
    assert _options_without_help(_help(argv, capsys)) == []


# --------------------------------------------------------------------------------------------
# The modules run directly: the same checks, help and CPU refusal as the foscar subcommands
# --------------------------------------------------------------------------------------------
MODULES = {"foscar.bench.decode": "python3 -m foscar.bench.decode", "foscar.tune": "python -m foscar.tune"}
MODULE_ERRORS = [
    ("foscar.bench.decode", "--iters 2", ["--iters", ">= 5"]),
    ("foscar.bench.decode", "--heads 32:5", ["--heads", "multiple"]),
    ("foscar.bench.decode", "--max-gb -1", ["--max-gb"]),
    ("foscar.bench.decode", "--seed x", ["--seed"]),
    ("foscar.bench.decode", "--out {plain}/x", ["--out", "not a folder"]),
    ("foscar.tune", "--dry-run --page-size 24", ["--page-size", "page_size=24"]),
    ("foscar.tune", "--dry-run --group-size 100", ["--group-size", "100"]),
    ("foscar.tune", "--dry-run --warmup -1", ["--warmup"]),
    ("foscar.tune", "--out {plain}/x", ["--out"]),
]


def _module(module: str, args: list[str]) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=120,
                          cwd=ROOT, env={**env, "CUDA_VISIBLE_DEVICES": ""})


@pytest.mark.parametrize("module,cmd,words", MODULE_ERRORS, ids=[f"{m} {c}" for m, c, _ in MODULE_ERRORS])
def test_module_bad_option_is_one_line_exit_2(module, cmd, words, files):
    res = _module(module, [a.format(**files) for a in cmd.split()])
    assert res.returncode == 2 and res.stdout == "", res.stderr
    _assert_one_error_line(res.stderr, MODULES[module], *words)


@pytest.mark.parametrize("module", MODULES)
def test_module_help_is_whole_sentences_with_every_option_explained(module):
    res = _module(module, ["--help"])
    assert res.returncode == 0 and res.stderr == "", res.stderr
    assert res.stdout.startswith(f"usage: {MODULES[module]} ")
    desc = _description(res.stdout)
    assert desc[:1].isupper() and desc.endswith("."), desc
    assert _options_without_help(res.stdout) == []


@pytest.mark.parametrize("module,args,code", [("foscar.bench.decode", ["--grid", "quick"], 1),
                                              ("foscar.tune", ["--preset", "quick"], 2)])
def test_module_without_a_gpu_says_what_is_missing(module, args, code, tmp_path):
    res = _module(module, [*args, "--out", str(tmp_path)])
    assert res.returncode == code and res.stdout == ""
    assert _assert_one_error_line(res.stderr, MODULES[module], "needs a CUDA GPU") == res.stderr.strip()


def test_numpy_is_a_dependency():
    """torch prints "Failed to initialize NumPy" at import where numpy is missing: a plain install brings it."""
    tomllib = pytest.importorskip("tomllib")
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert any(d.split(";")[0].strip().lower().startswith("numpy") for d in deps), deps
