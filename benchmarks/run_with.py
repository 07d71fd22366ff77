"""Run a module of foscar with v1's kernel switches of ``foscar.cute.config`` set, to measure a switch before it
becomes a default:

    python benchmarks/run_with.py EARLY_PRODUCER_BITS=2,4 LAZY_ONE_TILE=0 -- foscar.tune --backend cute ...
    python benchmarks/run_with.py @/tmp/variant -- foscar.bench.decode --grid paper ...

Each ``NAME=VALUE`` sets that module constant: ``0``/``1`` for a flag, comma-separated ints (``none``: empty)
for a tuple; ``@FILE`` reads such words from a file (a choice written by ``sweep_producer.py --choose FILE``). Every switch is part of the kernels' static
config (``Sm90Config``), so compiled kernels and the disk compile cache keep the variants apart.
"""
import runpy
import sys

SWITCHES = {"EARLY_PRODUCER_BITS": tuple, "LAZY_ONE_TILE": bool}


def settings(words: list[str]) -> dict:
    out = {}
    for w in words:
        if w.startswith("@"):
            out.update(settings(open(w[1:]).read().split()))
            continue
        name, _, value = w.partition("=")
        items = [] if value == "none" else value.split(",")
        if name not in SWITCHES or not all(x.isdigit() for x in items) or (SWITCHES.get(name) is bool and
                                                                            value not in ("0", "1")):
            raise SystemExit(f"run_with: expected NAME=VALUE with NAME one of {tuple(SWITCHES)}, got {w!r}")
        out[name] = tuple(int(x) for x in items) if SWITCHES[name] is tuple else value == "1"
    return out


def main() -> None:
    if "--" not in sys.argv:
        raise SystemExit(__doc__)
    cut = sys.argv.index("--")
    chosen = settings(sys.argv[1:cut])
    module, *args = sys.argv[cut + 1:]
    from foscar.cute import config
    for name, value in chosen.items():
        setattr(config, name, value)
    config.config_for.cache_clear()
    print(f"run_with: {chosen or 'shipped switches'}", file=sys.stderr)
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
