"""What every decode backend is: one small protocol, and the host facts it is asked about.

A backend states its limits once, in :meth:`Backend.status` (usable here, and for this format, GQA ratio
and page size, or why not); ``backend="auto"``, ``foscar info``, the tuner and the benchmark all ask it.
:meth:`Backend.plan` picks the launch config (the autotune cache's, else the backend's heuristics) and
allocates the workspace; :meth:`Backend.run` writes a validated :class:`~foscar.problem.DecodeProblem`'s
``out`` and ``lse`` with no further checks; :meth:`Backend.candidates` lists the configs the tuner times.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..format import KVFormat


@dataclass(frozen=True)
class BackendStatus:
    name: str
    usable: bool
    why: str  # what it runs on, or why it cannot run here


@dataclass(frozen=True)
class ProblemKey:
    """The host facts a backend's support and launch choice depend on (no tensor, no device read)."""

    device: torch.device
    fmt: KVFormat | None = None
    gqa: int | None = None
    page_size: int | None = None


@dataclass
class LaunchPlan:
    """A backend's launch: its config (the kernel's options; ``num_splits``) and the workspace a
    :meth:`Backend.run` writes its partials into (``None``: allocated per call)."""

    backend: str
    config: dict = field(default_factory=dict)
    workspace: tuple | None = None


class Backend:
    """The protocol (subclasses override what they have)."""

    name: str = ""
    #: whether ``auto`` may take it on this device type ("cuda" or "cpu")
    auto_devices: tuple[str, ...] = ("cuda",)
    #: whether it has launch configs to tune (:meth:`candidates`)
    tunable: bool = True

    def status(self, key: ProblemKey) -> BackendStatus:  # pragma: no cover - every backend overrides it
        raise NotImplementedError

    def rotates(self, fmt: KVFormat) -> bool:
        """Whether the backend's kernels take a rotated cache's query and output as they are (rotating them
        in and back themselves); else the caller hands it the problem in the cache's space
        (:meth:`foscar.problem.DecodeProblem.in_cache_space`)."""
        return False

    def steps(self, fmt: KVFormat) -> bool:
        """Whether the backend takes a step of several tokens per sequence as it is (a problem with
        ``q_len > 1``); else the caller hands it one decode of the step's rows over a causal view of the cache
        (:mod:`foscar.multitoken`)."""
        return False

    def preferred(self, fmt: KVFormat) -> bool:
        """Whether ``auto`` takes this backend for ``fmt`` when it is usable (measured faster)."""
        return True

    def launch_config(self, problem) -> dict:
        """The launch of ``problem``: its ``num_splits`` (and the kernel's options), decided on the host."""
        return {"num_splits": problem.num_splits}

    def num_parts(self, problem, config: dict) -> int | None:
        """The partials a launch of ``config`` for ``problem`` writes per (sequence, query head); ``None``: no
        workspace."""
        return None

    def plan(self, problem, *, workspace: bool = True) -> LaunchPlan:
        """:meth:`launch_config` and, with ``workspace``, the partial buffers :meth:`run` then writes into."""
        config = self.launch_config(problem)
        parts = self.num_parts(problem, config) if workspace else None
        ws = None
        if parts is not None:
            from ..splitkv import new_workspace
            ws = new_workspace(problem.batch, problem.q_heads, problem.kv_heads, parts, problem.head_dim,
                               problem.device)
        return LaunchPlan(self.name, config, ws)

    def run(self, problem, plan: LaunchPlan | None = None) -> None:
        """Write ``problem.out`` (and ``lse``): with ``plan``, its config and workspace; else as the
        backend chooses per call."""
        if plan is None:
            self.execute(problem)
        else:
            self.execute(problem, workspace=plan.workspace, **plan.config)

    def execute(self, problem, workspace=None, **config) -> None:  # pragma: no cover - GPU backends override it
        raise NotImplementedError

    def tunes_step(self, fmt: KVFormat, gqa: int, q_len: int) -> str | None:
        """Why the tuner cannot tune a step of ``q_len`` tokens at ``gqa`` for ``fmt``; ``None``: it can."""
        return None if self.steps(fmt) else "the backend takes one token per sequence (steps run as causal views)"

    def candidates(self, case, device: torch.device) -> list[dict]:
        """Launch configs the tuner times for ``case`` (:class:`foscar.tune.Case`), the backend's heuristic
        first; none: nothing to tune."""
        return []

    def launch(self, q: torch.Tensor, cache, config: dict) -> torch.Tensor:
        """One validated decode with an explicit launch ``config`` (one of :meth:`candidates`): the call the
        tuner times. Returns ``out``."""
        from ..problem import DecodeProblem
        problem = DecodeProblem.build(q, cache, num_splits=config.get("num_splits"))
        self.run(problem)
        return problem.out

    def launch_step(self, q: torch.Tensor, cache, config: dict) -> torch.Tensor:
        """:meth:`launch` of a step ``q [B, q_len, Hq, D]`` taken as it is (:meth:`steps`), into ``config["out"]``
        where given. Returns ``out [B, q_len, Hq, D]``."""
        from ..errors import UnsupportedError
        from ..multitoken import step_problem, unflatten
        if not self.steps(cache.fmt):
            raise UnsupportedError(f"a step with backend={self.name!r}", "its launch takes one token per sequence")
        config = dict(config)
        B, T = q.shape[:2]
        problem = step_problem(q, cache, out=config.pop("out", None), num_splits=config.get("num_splits"))
        solved = problem if self.rotates(cache.fmt) else problem.in_cache_space()
        self.execute(solved, **config)
        problem.finish(solved, lse_wanted=False)
        return unflatten(problem.out, B, T)
