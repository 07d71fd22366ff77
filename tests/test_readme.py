"""The README's test command is the one CI runs, and its main-job command names a real subcommand."""
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _commands():
    readme = (ROOT / "README.md").read_text()
    return [c.strip() for c in re.findall(r"```\n(python3 -m venv[^\n]*)\n```", readme)]


def test_readme_has_exactly_two_commands():
    cmds = _commands()
    assert len(cmds) == 2, cmds
    assert cmds[0].endswith("foscar demo")
    assert "pytest" in cmds[1]


def test_ci_runs_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text()
    assert _commands()[1] in ci
