"""The README's CPU results table is what its commands print: every row names its ``foscar demo`` command;
the test runs each command (the installed console command, as a reader would) and compares every
figure of the row, to the digits the README shows, with the printed table. The ratio claimed in the text
below the table is checked against the same output."""
import re
import shlex
import subprocess
import sys
from decimal import Decimal
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
#: The demo's table columns, in order (its header: format, backend, B/tok/head, BF16 B, ratio, ...).
DEMO_COLUMNS = ("format", "backend", "bytes", "bf16_bytes", "ratio", "err_unquant", "err_dequant", "bf16_err_dequant",
                "quant_ms", "decode_ms")


def _results_table() -> list[dict]:
    """The rows of the table under ``## Results``: the cells by header, and the command."""
    section = README.split("\n## Results\n", 1)[1].split("\n## ", 1)[0]
    lines = [line for line in section.splitlines() if line.startswith("|")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    assert header[-1] == "command", header
    rows = []
    for line in lines[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) != len(header):
            break  # the next table
        rows.append(dict(zip(header, cells)))
    return rows


ROWS = _results_table()


def _command(row: dict) -> list[str]:
    cmd = row["command"].strip("`")
    argv = shlex.split(cmd)
    assert argv[:2] == ["foscar", "demo"], cmd
    return argv[1:]


def _foscar() -> list[str]:
    script = Path(sys.executable).parent / "foscar"
    return [str(script)] if script.exists() else [sys.executable, "-m", "foscar.cli"]


@pytest.fixture(scope="module")
def printed() -> dict[tuple[str, ...], dict[str, dict[str, str]]]:
    """Each distinct command's printed table: {argv: {format: {column: text}}}. The commands run at once
    (each single-threaded, as the demo runs by default)."""
    commands = list(dict.fromkeys(tuple(_command(r)) for r in ROWS))
    procs = {c: subprocess.Popen(_foscar() + list(c), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                 cwd=ROOT) for c in commands}
    tables = {}
    for c, proc in procs.items():
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err
        lines = out.splitlines()
        start = next(i for i, line in enumerate(lines) if line.startswith("format "))
        table = {}
        for line in lines[start + 2:]:
            if not line.strip():
                break
            cells = dict(zip(DEMO_COLUMNS, line.split()))
            table[cells["format"]] = cells
        tables[c] = table
    return tables


def _significant(text: str) -> int:
    """Significant digits of a number as written: ``"2.15e-4"`` 3, ``"0.17"`` 2, ``"512"`` 3."""
    mantissa = text.lower().split("e")[0].replace(".", "").lstrip("0")
    return max(len(mantissa), 1)


def _same_figure(readme: str, shown: str) -> bool:
    """The README's figure is the printed one rounded to the README's significant digits."""
    readme, shown = readme.strip().rstrip("x"), shown.strip().rstrip("x")  # ratios: "3.56x"
    if readme == "-" or shown == "-":
        return readme == shown
    digits = _significant(readme)
    rounded = Decimal(f"{float(shown):.{digits - 1}e}")
    return rounded == Decimal(readme)


def _format_of(label: str) -> str:
    if label == "BF16":
        return "bf16"
    bits = re.match(r"INT(\d)", label).group(1)
    return f"int{bits}"


def test_the_table_names_a_command_for_every_row():
    assert len(ROWS) >= 4 and all(r["command"].startswith("`foscar demo") for r in ROWS)


@pytest.mark.parametrize("row", ROWS, ids=[f"{r['cache']} [{r['command']}]" for r in ROWS])
def test_every_figure_of_the_row_is_printed_by_its_command(row, printed):
    got = printed[tuple(_command(row))][_format_of(row["cache"])]
    arith = re.fullmatch(r"(\S+)(?: \((\S+)\))?", row["arithmetic error vs dequantized cache (BF16 attention's)"])
    pairs = [(row["bytes / token / KV head"], got["bytes"]),
             (row["vs BF16"].removesuffix(" fewer"), got["ratio"]),
             (row["error vs exact attention (unquantized)"], got["err_unquant"]),
             (arith.group(1), got["err_dequant"]),
             (arith.group(2) or "-", got["bf16_err_dequant"])]
    for readme, shown in pairs:
        assert _same_figure(readme, shown), (row["cache"], readme, shown)


def test_the_ratio_in_the_text_is_that_of_the_printed_rows(printed):
    """"N-Mx below in the first four rows": BF16 attention's error over the folded decode's."""
    claim = re.search(r"(\d+)-(\d+)x below in the first four rows", README)
    assert claim, "the README states the ratio of the first four rows"
    ratios = []
    for row in ROWS[:4]:
        got = printed[tuple(_command(row))][_format_of(row["cache"])]
        if got["err_dequant"] != "-":
            ratios.append(float(got["bf16_err_dequant"]) / float(got["err_dequant"]))
    assert (round(min(ratios)), round(max(ratios))) == (int(claim.group(1)), int(claim.group(2))), ratios
