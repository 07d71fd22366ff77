"""The Triton backend: the Triton kernels of :mod:`foscar.triton`, on any CUDA GPU, for the ``bf16`` mapping
(they build BF16 operands) and the FP4 block formats, every other format option."""
from __future__ import annotations

import importlib.util

import torch

from .base import Backend, BackendStatus, ProblemKey


class Triton(Backend):
    name = "triton"

    def status(self, key: ProblemKey) -> BackendStatus:
        dev = key.device
        if dev.type != "cuda":
            return BackendStatus(self.name, False, f"needs a CUDA GPU (device is {dev})")
        if importlib.util.find_spec("triton") is None:
            return BackendStatus(self.name, False, "triton is not installed")
        if key.fmt is not None and key.fmt.mapping != "bf16":
            return BackendStatus(self.name, False,
                                 f"builds BF16 operands: needs mapping 'bf16', not {key.fmt.mapping!r}")
        return BackendStatus(self.name, True, f"Triton kernels on {torch.cuda.get_device_name(dev)}")

    def rotates(self, fmt) -> bool:
        """Stage 1 rotates the query as it loads it, the split merge (fused or its own kernel) the output; the
        FP4 kernel takes them in the cache's space."""
        return not fmt.is_fp4

    def steps(self, fmt) -> bool:
        """A step's tokens are rows of each program (causal among them), of stage 1 and of the BF16 windows'."""
        return True

    def launch_config(self, problem) -> dict:
        """The split count :func:`foscar.triton.launch.run` would take: a step's programs are one per sequence
        (its tokens are rows of each), so the first token's rows stand for the batch."""
        from ..triton.launch import launch_config
        num_splits = launch_config(problem.q[::problem.q_len], problem.cache, problem.gqa,
                                   num_splits=problem.num_splits, step=problem.q_len).num_splits
        return {"num_splits": num_splits}

    def num_parts(self, problem, config: dict) -> int:
        from ..splitkv import num_window_parts
        return config["num_splits"] + num_window_parts(problem.fmt)

    def execute(self, problem, workspace=None, **config) -> None:
        from ..triton.launch import run
        run(problem, workspace=workspace, **config)

    def candidates(self, case, device: torch.device) -> list[dict]:
        """The launcher's split heuristic times {1/2, 1, 2, 4}, with one or two KV tiles in flight, 4 warps;
        the heuristic's splits with 8 warps; the heuristic's splits and twice as many with the lazy rescale where
        the format takes it (token-wise V of one channel group); the largest tile that fits."""
        from ..triton.launch import block_n_for, default_num_splits, takes_lazy_rescale
        tile = block_n_for(case.fmt, case.page, case.q_heads // case.kv_heads * case.q_len)  # a step's rows
        tiles = case.seq_len // tile
        base = default_num_splits(case.batch, case.kv_heads, tiles, device)
        splits = [base] + sorted({max(1, min(tiles, round(base * m))) for m in (0.5, 2, 4)} - {base})
        out = [{"num_splits": s, "num_warps": 4, "block_n": tile, "prefetch": pf, "lazy_rescale": False}
               for pf in (1, 2) for s in splits]
        out.append({"num_splits": base, "num_warps": 8, "block_n": tile, "prefetch": 1, "lazy_rescale": False})
        if takes_lazy_rescale(case.fmt):
            out += [{"num_splits": s, "num_warps": 4, "block_n": tile, "prefetch": 1, "lazy_rescale": True}
                    for s in splits[:2]]
        return out

    def launch(self, q, cache, config: dict):
        if q.dim() == 4:
            return self.launch_step(q, cache, config)
        from ..triton import decode
        return decode(q, cache, **config)
