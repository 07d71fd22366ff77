"""The decode speed benchmark, :mod:`foscar.bench.decode` (also ``foscar bench speed``), runnable from a
checkout without installing foscar: ``python3 benchmarks/bench_decode.py --grid paper --cuda-graph``."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from foscar.bench.decode import *  # noqa: E402,F401,F403 - the names other scripts import from here
from foscar.bench.decode import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(prog="python3 benchmarks/bench_decode.py"))
