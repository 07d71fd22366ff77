"""The first CuTe decode of a process, with a cold and then a warm disk compile cache: each run is a fresh
Python process (the in-process cache is empty), timing ``foscar.decode(..., backend="cute")`` from the
call to its end on the GPU, and reporting where each kernel came from (compiled, or loaded from disk).

    python3 benchmarks/first_call.py [--shapes 2:4096 ...]   # an sm_90 GPU with foscar[cute] installed
"""
import argparse
import os
import subprocess
import sys
import tempfile

CHILD = r"""
import time, torch, foscar
from foscar.cute.launch import compile_seconds
fmt = foscar.KVFormat(bits={bits}, head_dim=128, group_size=128)
k, v = torch.randn(2, {B}, 8, {L}, 128, device="cuda", dtype=torch.bfloat16).unbind(0)
cache = foscar.quantize_kv(k, v, fmt, page_size=64)
q = torch.randn({B}, 32, 128, device="cuda", dtype=torch.bfloat16)
torch.cuda.synchronize()
t = time.perf_counter(); foscar.decode(q, cache, backend="cute"); torch.cuda.synchronize()
rec = list(compile_seconds(detail=True).values())
print("%.3f %s" % (time.perf_counter() - t, ",".join(r.source for r in rec)))
"""


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", nargs="+", default=["2:4096"], help="B:L of the cache (default 2:4096)")
    p.add_argument("--bits", type=int, nargs="+", default=[2, 4])
    a = p.parse_args()
    print("| shape | bits | cold: first call s (kernel) | warm: first call s (kernel) |\n|---|---|---|---|")
    for shape in a.shapes:
        B, L = (int(x) for x in shape.split(":"))
        for bits in a.bits:
            with tempfile.TemporaryDirectory() as d:
                env = {**os.environ, "FOSCAR_CACHE_DIR": d}
                runs = [subprocess.run([sys.executable, "-c", CHILD.format(bits=bits, B=B, L=L)], env=env,
                                       capture_output=True, text=True, check=True).stdout.split()
                        for _ in ("cold", "warm")]
            print(f"| {B}:{L} | {bits} | " + " | ".join(f"{t} ({src})" for t, src in runs) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
