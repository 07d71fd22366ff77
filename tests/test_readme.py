"""The README: its test command is the one CI runs, its main-job command names a real subcommand, and
its API lines run as written."""
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


def test_the_api_snippet_runs():
    """The README's API lines, run as written (CPU: the reference backend)."""
    block = re.search(r"## The API in a few lines\n\n```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    scope: dict = {}
    exec(compile(block.group(1), "README.md", "exec"), scope)  # noqa: S102 - our own README
    assert scope["out"].shape == (2, 32, 128) and scope["lse"].shape == (2, 32)
    assert scope["ref"].shape == scope["spec"].shape == (2, 32, 128)


def test_the_value_limits_quoted_are_the_formats():
    """The supported-configurations table quotes ``fmt.max_abs_value`` of the ``bf16`` mapping."""
    import foscar
    readme = (ROOT / "README.md").read_text()
    for bits in (2, 4):
        lim = foscar.KVFormat(bits=bits, head_dim=128, group_size=128).max_abs_value
        assert f"{lim:.1e}".replace("e+", "e") + f" at INT{bits}" in readme, (bits, lim)
