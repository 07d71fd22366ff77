"""Where a launch of thread-block clusters puts its CTAs, on an sm_90 GPU:

    python3 benchmarks/cluster_placement.py --heads 8 --splits 16 8 4 --ctas 1 2 --spin-us 20

Each case launches a grid shaped as stage 1's at B 1 (KV heads x splits, 384 threads, the shared memory that holds
``--ctas`` CTAs an SM), the splits of one KV head one cluster (and, for comparison, the same grid without
clusters). Thread 0 of each CTA records its SM (``%smid``), its rank in the cluster and ``%globaltimer`` as it
starts, spins ``--spin-us``, and records the end. Printed per case: the SMs used, the most CTAs an SM ran at once,
the SMs a cluster's CTAs took (fewest and most), and the rounds the launch took (the CTAs that started more than
half a spin after the first). The question it answers (``docs/hopper-e4m3-plan.md``, the next device window): does
a 16-CTA cluster at one CTA an SM fit every KV head's cluster at once, and at two CTAs an SM does it pack two of its
CTAs on an SM where a launch without clusters spreads them?
"""
import argparse
import os
import sys

import torch

THREADS = 384  #: stage 1's CTA: a producer and two consumer warpgroups
SM_SHARED_BYTES = 227 * 1024  #: an H100/H200 SM's shared memory for CTAs (228 KB less 1 KB a CTA reserves)


def shared_bytes(ctas: int) -> int:
    """The dynamic shared memory a CTA takes so that at most ``ctas`` of them fit an SM (more than half of an SM's
    for one, more than a third for two)."""
    return (SM_SHARED_BYTES // ctas - 1024) // 1024 * 1024 if ctas > 1 else SM_SHARED_BYTES - 1024


def build(cluster: int, smem: int, ctas: int):
    """The probe of ``cluster`` CTAs a cluster (0: no cluster) taking ``smem`` bytes of shared memory, launched
    with ``min_blocks_per_mp=ctas``: ``probe(out [heads, splits, 4] int64, spin_ns, stream)``."""
    import cuda.bindings.driver as cuda
    import cutlass
    import cutlass.cute as cute
    from cutlass import Int64
    from cutlass.memory import SmemAllocator

    class PlacementProbe:
        @cute.jit
        def __call__(self, mOut: cute.Tensor, spin_ns: Int64, stream: cuda.CUstream):
            heads = cute.size(mOut, mode=[0])
            splits = cute.size(mOut, mode=[1])
            self.kernel(mOut, spin_ns).launch(grid=(heads, 1, splits), block=(THREADS, 1, 1),
                                              cluster=[1, 1, cluster] if cluster else None, stream=stream,
                                              min_blocks_per_mp=ctas)

        @cute.kernel
        def kernel(self, mOut: cute.Tensor, spin_ns: Int64):
            alloc = SmemAllocator()
            held = alloc.allocate_array(cutlass.Int64, smem // 8)  # the shared memory that sets the CTAs an SM
            tidx, _, _ = cute.arch.thread_idx()
            h, _, s = cute.arch.block_idx()
            if tidx == 0:
                t0 = cute.arch.globaltimer()
                held[0] = t0
                now = t0
                while now - t0 < spin_ns:
                    now = cute.arch.globaltimer()
                rank = cutlass.Int32(0)
                if cutlass.const_expr(cluster > 0):
                    rank = cute.arch.block_idx_in_cluster()
                mOut[h, s, 0] = Int64(cute.arch.smid())
                mOut[h, s, 1] = Int64(rank)
                mOut[h, s, 2] = held[0]
                mOut[h, s, 3] = now

    return PlacementProbe()


def summarize(rec: torch.Tensor, spin_ns: int) -> dict:
    """``rec [heads, splits, 4]`` (SM, rank, start, end) as the figures printed."""
    sm, start, end = rec[..., 0].flatten(), rec[..., 2].flatten(), rec[..., 3].flatten()
    most = 0
    for s in sm.unique():
        on = (sm == s).nonzero().flatten()
        for i in on:  # the CTAs of this SM running when CTA i started
            most = max(most, int(((start[on] <= start[i]) & (end[on] > start[i])).sum()))
    per_cluster = [len(rec[h, :, 0].unique()) for h in range(rec.shape[0])]
    late = int((start - start.min() > spin_ns // 2).sum())
    return {"sms": len(sm.unique()), "most_an_sm": most, "cluster_sms": (min(per_cluster), max(per_cluster)),
            "late_ctas": late, "span_us": float(end.max() - start.min()) / 1e3}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--heads", type=int, default=8, help="KV heads (clusters), B 1")
    p.add_argument("--splits", type=int, nargs="+", default=[16, 8, 4], help="CTAs a KV head (a cluster's size)")
    p.add_argument("--ctas", type=int, nargs="+", default=[1, 2], choices=(1, 2), help="CTAs an SM")
    p.add_argument("--spin-us", type=float, default=20.0)
    p.add_argument("--compile-only", action="store_true", help="compile every case (CUTE_DSL_ARCH=sm_90a, no GPU)")
    a = p.parse_args()
    import cutlass.cute as cute
    from cutlass.cute.runtime import from_dlpack
    dev = "cpu" if a.compile_only else "cuda"
    if a.compile_only:
        os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    spin_ns = int(a.spin_us * 1e3)
    print("| splits (cluster) | CTAs an SM | clusters | SMs used | most CTAs an SM | SMs a cluster took | CTAs that "
          "started late | µs start to end |\n|---|---|---|---|---|---|---|---|")
    for splits in a.splits:
        for ctas in a.ctas:
            for cluster in (splits, 0):
                out = torch.zeros(a.heads, splits, 4, dtype=torch.int64, device=dev)
                fn = cute.compile(build(cluster, shared_bytes(ctas), ctas), from_dlpack(out), spin_ns,
                                  _stream(a.compile_only))
                if a.compile_only:
                    print(f"| {splits} | {ctas} | {'yes' if cluster else 'no'} | compiled | | | | |")
                    continue
                fn(from_dlpack(out), spin_ns, _stream(False))
                torch.cuda.synchronize()
                f = summarize(out.cpu(), spin_ns)
                print(f"| {splits} | {ctas} | {'yes' if cluster else 'no'} | {f['sms']} | {f['most_an_sm']} | "
                      f"{f['cluster_sms'][0]}-{f['cluster_sms'][1]} | {f['late_ctas']} | {f['span_us']:.1f} |")
    return 0


def _stream(cpu: bool):
    import cuda.bindings.driver as cuda
    return cuda.CUstream(0 if cpu else torch.cuda.current_stream().cuda_stream)


if __name__ == "__main__":
    sys.exit(main())
