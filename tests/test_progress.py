"""The progress bar of long runs: one line per step, the bar filled in proportion, the time left."""
import io

from foscar.progress import Progress


def test_one_bar_line_per_step():
    out = io.StringIO()
    p = Progress(4, width=8, stream=out)
    for what in ("a", "b", "c", "d"):
        p.step(what)
    lines = out.getvalue().splitlines()
    assert [line.split(" ")[0] for line in lines] == ["[##------]", "[####----]", "[######--]", "[########]"]
    assert lines[0].split("] ")[1].startswith("1/4 ") and "s left: a" in lines[0]
    assert lines[-1].endswith("s: d") and "left" not in lines[-1]
