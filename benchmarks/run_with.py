"""Run a module of foscar with v1's kernel switches of ``foscar.cute.config`` set, to measure a switch before it
becomes a default:

    python benchmarks/run_with.py PROLOGUE_BY_BITS=2:q_first,4:consumer_q LAZY_ONE_TILE=0 -- foscar.tune ...
    python benchmarks/run_with.py @/tmp/variant -- foscar.bench.decode --grid paper ...
    python benchmarks/run_with.py PROLOGUE_BY_BITS=4:consumer_q -- benchmarks/sass_stats_cute.py --bits 4 ...

Each ``NAME=VALUE`` sets that module constant: ``0``/``1`` for a flag, digits for a number, comma-separated ints
(or nothing) for a tuple, comma-separated ``KEY:VALUE`` pairs (an int key) for a dict, which updates the shipped one; ``@FILE`` reads
such words from a file (a choice written by ``sweep_switches.py --choose FILE``). Every switch is part of the
kernels' static config (``Sm90Config``), so compiled kernels and the disk compile cache keep the variants apart.
"""
import runpy
import sys

from foscar.cute import config as _config

#: each switch of ``foscar.cute.config.SWITCHES`` and its kind (bool, int, tuple or dict), from its shipped value
SWITCHES = {name: type(getattr(_config, name)) for name in _config.SWITCHES}


def settings(words: list[str]) -> dict:
    out = {}
    for w in words:
        if w.startswith("@"):
            out.update(settings(open(w[1:]).read().split()))
            continue
        name, _, value = w.partition("=")
        pairs = [x.partition(":") for x in value.split(",")]
        if name not in SWITCHES or (SWITCHES[name] is bool and value not in ("0", "1")) or (
                SWITCHES[name] is tuple and not all(x.isdigit() for x in value.split(",") if x)) or (
                SWITCHES[name] is dict and not all(k.isdigit() and sep for k, sep, _ in pairs)) or (
                SWITCHES[name] is int and not value.isdigit()):
            raise SystemExit(f"run_with: expected NAME=VALUE with NAME one of {tuple(SWITCHES)}, got {w!r}")
        if SWITCHES[name] is tuple:
            out[name] = tuple(int(x) for x in value.split(",") if x)
            continue
        if SWITCHES[name] is int:
            out[name] = int(value)
            continue
        out[name] = {int(k): v for k, _, v in pairs} if SWITCHES[name] is dict else value == "1"
    return out


def apply(chosen: dict, base: dict | None = None) -> None:
    """Set ``chosen``'s switches in ``foscar.cute.config`` on top of ``base`` (name -> value; unset: the values
    the module has now), a dict switch updating its base; then clear what was decided under the switches before
    (``config_for``'s configs and ``default_variant``'s choices: ``clear_switch_caches``)."""
    from foscar.cute import config
    base = {name: getattr(config, name) for name in SWITCHES} if base is None else base
    for name, value in base.items():
        new = chosen.get(name, value)
        setattr(config, name, {**value, **new} if isinstance(value, dict) else new)
    config.clear_switch_caches()


def main() -> None:
    if "--" not in sys.argv:
        raise SystemExit(__doc__)
    cut = sys.argv.index("--")
    chosen = settings(sys.argv[1:cut])
    module, *args = sys.argv[cut + 1:]
    apply(chosen)
    print(f"run_with: {chosen or 'shipped switches'}", file=sys.stderr)
    sys.argv = [module, *args]
    if module.endswith(".py"):  # a script's path
        runpy.run_path(module, run_name="__main__")
    else:
        runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
