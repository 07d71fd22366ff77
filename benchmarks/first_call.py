"""The first decode of a process, with a cold and then a warm disk compile cache: each run is a fresh
Python process (the in-process caches are empty), timing ``import foscar`` and then
``foscar.decode(..., backend=...)`` from the call to its end on the GPU, and reporting where each CuTe
kernel came from (compiled, or loaded from disk).

    python3 benchmarks/first_call.py [--shapes 2:4096 ...] [--backend cute|triton] [--profile]

``--profile``: one more warm run of the first shape under cProfile; prints the functions that took the
most of the first call (cumulative seconds). Needs an sm_90 GPU with foscar[cute] installed.
"""
import argparse
import os
import subprocess
import sys
import tempfile

CHILD = r"""
import time
t0 = time.perf_counter()
import torch, foscar
t_import = time.perf_counter() - t0
fmt = foscar.KVFormat(bits={bits}, head_dim=128, group_size=128)
k, v = torch.randn(2, {B}, 8, {L}, 128, device="cuda", dtype=torch.bfloat16).unbind(0)
cache = foscar.quantize_kv(k, v, fmt, page_size=64)
q = torch.randn({B}, 32, 128, device="cuda", dtype=torch.bfloat16)
torch.cuda.synchronize()
if {profile}:
    import cProfile, pstats, sys
    prof = cProfile.Profile(); prof.enable()
t = time.perf_counter(); foscar.decode(q, cache, backend="{backend}"); torch.cuda.synchronize()
first = time.perf_counter() - t
if {profile}:
    prof.disable(); pstats.Stats(prof, stream=sys.stderr).sort_stats("cumulative").print_stats(40)
t = time.perf_counter(); foscar.decode(q, cache, backend="{backend}"); torch.cuda.synchronize()
second = time.perf_counter() - t
src = "-"
if "{backend}" == "cute":
    from foscar.cute.launch import compile_seconds
    src = ",".join(r.source for r in compile_seconds(detail=True).values())
print("%.3f %.3f %.4f %s" % (t_import, first, second, src))
"""


def child(bits, B, L, backend, env, profile=False):
    code = CHILD.format(bits=bits, B=B, L=L, backend=backend, profile=profile)
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    if run.returncode:
        raise SystemExit(f"the child process failed:\n{run.stderr}")
    return run.stdout.split(), run.stderr


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", nargs="+", default=["2:4096"], help="B:L of the cache (default 2:4096)")
    p.add_argument("--bits", type=int, nargs="+", default=[2, 4])
    p.add_argument("--backend", default="cute", choices=("cute", "triton"))
    p.add_argument("--profile", action="store_true", help="a warm run of the first shape under cProfile")
    a = p.parse_args()
    print(f"backend {a.backend}; seconds: `import foscar`, then the first call (where its kernels came from), "
          "then the second call\n\n| shape | bits | cold: import, first call | warm: import, first call | "
          "warm: second call |\n|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as d:
        for shape in a.shapes:
            B, L = (int(x) for x in shape.split(":"))
            for bits in a.bits:
                env = {**os.environ, "FOSCAR_CACHE_DIR": os.path.join(d, f"{B}-{L}-{bits}")}
                (ci, cf, _, cs), _ = child(bits, B, L, a.backend, env)
                (wi, wf, w2, ws), _ = child(bits, B, L, a.backend, env)
                print(f"| {B}:{L} | {bits} | {ci}, {cf} ({cs}) | {wi}, {wf} ({ws}) | {w2} |", flush=True)
        if a.profile:
            B, L = (int(x) for x in a.shapes[0].split(":"))
            env = {**os.environ, "FOSCAR_CACHE_DIR": os.path.join(d, f"{B}-{L}-{a.bits[0]}")}
            _, stats = child(a.bits[0], B, L, a.backend, env, profile=True)
            print(f"\nThe warm first call of {B}:{L} INT{a.bits[0]} under cProfile:\n\n```\n{stats.strip()}\n```")
    return 0


if __name__ == "__main__":
    sys.exit(main())
