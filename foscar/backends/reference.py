"""The PyTorch backend: :func:`foscar.decode_folded` with the kernels' arithmetic (BF16 QK and FP16 PV
operands, float32 accumulation), on any device. ``auto`` takes it on the CPU only. It reads the lengths back
to the host, so a CUDA graph cannot capture it (the GPU kernels' plans are for graphs)."""
from __future__ import annotations

import torch

from .base import Backend, BackendStatus, ProblemKey


class Reference(Backend):
    name = "reference"
    auto_devices = ("cpu",)
    tunable = False

    def status(self, key: ProblemKey) -> BackendStatus:
        return BackendStatus(self.name, True, f"PyTorch reference (decode_folded) on {key.device}"
                             + ("; slow on a GPU" if key.device.type == "cuda" else ""))

    def steps(self, fmt) -> bool:
        """A step's rows are the KV head's rows of the folded spec, causal among the step's tokens, whatever the
        cache's windows (:class:`foscar.multitoken.SequenceStep`)."""
        return True

    def execute(self, problem, workspace=None, **config) -> None:
        from ..fold import folded
        o, lse = folded(problem.q, problem.cache, problem.gqa, problem.sm_scale, operand_dtype=torch.bfloat16,
                        pv_operand_dtype=torch.float16, dtype=torch.float32, q_len=problem.q_len)
        problem.out.copy_(o)
        if problem.lse is not None:
            problem.lse.copy_(lse)
