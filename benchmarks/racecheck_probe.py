"""racecheck's report on the E4M3 K kernels, probed: ``sanitize_one.py``'s decode with one change to the traced
kernel, to tell a hazard of the kernel from one of the tool's model.

    compute-sanitizer --tool racecheck --racecheck-report hazard python3 benchmarks/racecheck_probe.py VARIANT [KIND]

``KIND``: a kind of ``sanitize_one.py`` (default ``cute_pair``: INT4, E4M3 K, two tiles a pass). ``VARIANT``:

- ``shipped``: the kernel as it ships;
- ``qbar=N``: Q's staging (the row scales' named barrier of the producer warpgroup) on barrier ``N`` instead of
  :data:`foscar.cute.operands.Q_LOAD_BARRIER`;
- ``sleep=NS``: every consumer thread sleeps ``NS`` ns (``nanosleep``) after raising its registers, before its first
  read of ``sum(Q)``: the kernel's order unchanged, only the time between the CTA barrier and that read;
- ``sumwarps=N``: ``sum(Q)`` written by the producer's threads ``32 N...`` (``tidx ^ 32 N``) instead of its first
  warp's (whose thread 0 goes on to issue the TMA copies while its other lanes wait for it);
- ``bars=N``: ``N`` barriers (each after a fence) after the sums' stores, not
  :data:`foscar.cute.operands.Q_SUMS_BARRIERS`.

Each run compiles into a fresh compile cache (``FOSCAR_CACHE_DIR``): the variants' changes are not part of the
kernels' config, so a cached kernel would hide them. Prints ``sanitize_one.py``'s line (the error against the
float64 oracle).
"""
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def sleeping(ns: int):
    """``cute.arch.setmaxregister_increase`` (the consumers' first instruction in v1) followed by ``nanosleep``."""
    import cutlass.cute as cute
    from cutlass._mlir.dialects import llvm

    raise_registers = cute.arch.setmaxregister_increase

    def increase(*args, **kwargs):
        raise_registers(*args, **kwargs)
        llvm.inline_asm(None, [], f"nanosleep.u32 {int(ns)};", "", has_side_effects=True, is_align_stack=False,
                        asm_dialect=llvm.AsmDialect.AD_ATT)

    return increase


def summing(warps: int):
    """v1's ``q_sums`` with its thread index remapped (``tidx ^ 32 warps``)."""
    from foscar.cute import folds, kernel_v1

    def q_sums(cfg, sQ, sQsum, tidx, sQinv=None):
        folds.q_sums(cfg, sQ, sQsum, tidx ^ (32 * warps), sQinv)

    kernel_v1.q_sums = q_sums


def apply(variant: str) -> None:
    """Set ``variant``'s change before any kernel is traced."""
    name, _, value = variant.partition("=")
    if name == "shipped":
        return
    if name == "qbar":
        from foscar.cute import operands
        operands.Q_LOAD_BARRIER = int(value)
    elif name == "sleep":
        import cutlass.cute as cute
        cute.arch.setmaxregister_increase = sleeping(int(value))
    elif name == "sumwarps":
        summing(int(value))
    elif name == "bars":
        from foscar.cute import operands
        operands.Q_SUMS_BARRIERS = int(value)
    else:
        raise SystemExit(f"unknown variant {variant!r}: shipped, qbar=N, sleep=NS, sumwarps=N or bars=N")


def main() -> None:
    variant = sys.argv[1] if len(sys.argv) > 1 else "shipped"
    kind = sys.argv[2] if len(sys.argv) > 2 else "cute_pair"
    os.environ["FOSCAR_CACHE_DIR"] = tempfile.mkdtemp(prefix="foscar-probe-")
    apply(variant)
    import sanitize_one
    sanitize_one.main(kind)


if __name__ == "__main__":
    main()
