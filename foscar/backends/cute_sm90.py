"""The CuTe DSL sm_90a backend: the kernels of :mod:`foscar.cute`, on Hopper with nvidia-cutlass-dsl and
apache-tvm-ffi (``foscar[cute]``), for the formats :func:`foscar.cute.config.config_for` takes.
``auto`` takes it for token-wise K (:meth:`CuteSm90.preferred`)."""
from __future__ import annotations

import importlib.util

import torch

from ..errors import UnsupportedError
from .base import Backend, BackendStatus, ProblemKey


class CuteSm90(Backend):
    name = "cute"

    def status(self, key: ProblemKey) -> BackendStatus:
        dev = key.device
        if dev.type != "cuda":
            return BackendStatus(self.name, False, f"needs an sm_90 GPU (device is {dev})")
        cap = torch.cuda.get_device_capability(dev)
        if cap != (9, 0):
            return BackendStatus(self.name, False, f"needs sm_90 (Hopper); this GPU is sm_{cap[0]}{cap[1]}"
                                 + ("; the sm_100a kernel is not written yet" if cap[0] == 10 else ""))
        if importlib.util.find_spec("cutlass") is None:
            return BackendStatus(self.name, False, "nvidia-cutlass-dsl is not installed (pip install 'foscar[cute]')")
        if importlib.util.find_spec("tvm_ffi") is None:  # the kernels' calling convention
            return BackendStatus(self.name, False, "apache-tvm-ffi is not installed (pip install 'foscar[cute]')")
        try:
            from ..cute.config import config_for  # imports cutlass
        except Exception as e:  # noqa: BLE001 -- a broken install is reported, never raised from a status query
            return BackendStatus(self.name, False, f"nvidia-cutlass-dsl does not import: {type(e).__name__}: {e}")
        if key.fmt is not None:
            try:
                config_for(key.fmt, key.gqa or 1, key.page_size or 64)
            except UnsupportedError as e:
                return BackendStatus(self.name, False, str(e))
        return BackendStatus(self.name, True, f"CuTe DSL sm_90a kernel on {torch.cuda.get_device_name(dev)}")

    def rotates(self, fmt) -> bool:
        """The query rotated as stage 1 stages it, the output as the split merge writes it
        (:mod:`foscar.cute.rotation`): a rotated cache costs no launch of its own."""
        return True

    def steps(self, fmt) -> bool:
        """A step's tokens are N columns of the kernel beside the heads, causal among them, where the cache has no
        BF16 windows; with :data:`foscar.cute.config.WINDOWED_STEPS` over windows too (rows of the combine's
        windows), and more rows than the columns in parts of the step's tokens (:func:`foscar.cute.launch.step_parts`;
        else the causal view's rows, one token each)."""
        from ..cute.config import WINDOWED_STEPS
        from ..splitkv import num_window_parts
        return WINDOWED_STEPS or num_window_parts(fmt) == 0

    def preferred(self, fmt) -> bool:
        """Every format but INT2 channel-wise K and V with token groups of 64: v1, the CuTe default, is faster
        than Triton on every other axis combination, GQA 1 to 8 and head dim 256 (``docs/results-h200.md``,
        ``docs/bench/h200/axes-fold-runs.json``, ``docs/bench/h200/rows-d256.md``). With groups of 64 a consumer
        folds channel-wise K's ``Q'`` at every tile, and INT2 channel-wise K and V folded so ran no faster than
        Triton (``docs/bench/h200/axes-channel-fold.json``): Triton is kept there."""
        return fmt.k_axis == "token" or fmt.v_axis == "token" or fmt.bits == 4 or fmt.group_size >= 128

    def launch_config(self, problem) -> dict:
        """The launch of the step, of its first part where it runs in parts (:func:`foscar.cute.launch.step_parts`)."""
        from ..cute.launch import launch_config, step_form
        T, cache = problem.q_len, problem.cache
        parts, viewed = step_form(problem.fmt, problem.gqa, T)
        step, tail = parts[0][1], T - parts[0][1]  # the first part's
        if viewed:  # the causal view's rows, one token each (its batch sizes the splits, as a call's)
            from ..multitoken import causal_view
            step, cache = 1, causal_view(cache, T)
        return launch_config(problem.q, cache, problem.gqa, num_splits=problem.num_splits, step=step,
                             tail=tail)._asdict()

    def num_parts(self, problem, config: dict) -> int:
        from ..cute.launch import num_parts, split_partials
        return num_parts(problem.fmt, config["num_splits"], config["warp_specialized"],
                         split_partials(problem.fmt, problem.gqa, problem.cache.page_size, problem.q_len, config))

    def execute(self, problem, workspace=None, **config) -> None:
        from ..cute.launch import run
        run(problem, workspace=workspace, **config)

    def tunes_step(self, fmt, gqa: int, q_len: int) -> str | None:
        """A step of more rows than a kernel's columns runs in parts (:func:`foscar.cute.launch.step_parts`), which
        take no tuned entry."""
        from ..cute.config import max_rows
        from ..cute.launch import step_form
        why = super().tunes_step(fmt, gqa, q_len)
        if why is None and len(step_form(fmt, gqa, q_len)[0]) > 1:
            why = (f"{gqa * q_len} query rows a KV head run in parts of at most {max_rows(fmt)}, which take no tuned "
                   "entry")
        return why

    def candidates(self, case, device: torch.device) -> list[dict]:
        """A step (``case.q_len > 1``): :meth:`_step_candidates`. Else the launch an untuned call runs first
        (:meth:`_untuned`: the time a tuned entry is held against); then v0, v1 with two CTAs per SM and v1 with one,
        each at its split heuristic times {1/2, 1, 2}; then, where the format takes them, v1 with E4M3 K operands at the
        splits of the BF16 v1, every v1 candidate with two tiles per softmax pass, and v1 at two CTAs per SM
        with E4M3 K and two tiles a pass also at a quarter and four times its heuristic (and, with
        :data:`~foscar.cute.config.CLUSTER_MERGE`, at the split counts between that a cluster merges). Every v1
        candidate at the format's default stages, and again at twice as many where its CTAs per SM hold that ring
        (one CTA an SM, mostly: a deeper ring keeps more bytes in flight where fewer CTAs stream); where the CTAs of
        an SM do not hold the default ring (two CTAs at 32 query rows), the deepest that they hold."""
        from ..cute.budget import default_ring, fits_shared_memory
        from ..cute.config import CLUSTER_MERGE, STAGE_CHOICES, TILE, config_for
        from ..cute.launch import DEFAULT_WARP_SPECIALIZED, V0_RESIDENT, WS_CTAS_PER_SM, default_num_splits, takes
        if case.q_len > 1:
            return self._step_candidates(case, device)
        tiles = case.seq_len // TILE
        variants = [(False, None), (True, 2), (True, 1)]
        first = (DEFAULT_WARP_SPECIALIZED, WS_CTAS_PER_SM if DEFAULT_WARP_SPECIALIZED else None)
        out = []
        for ws, ctas in [first] + [v for v in variants if v != first]:
            base = default_num_splits(case.batch, case.kv_heads, tiles, device, ctas if ws else V0_RESIDENT)
            for s in [base] + sorted({max(1, min(tiles, round(base * m))) for m in (0.5, 2)} - {base}):
                out.append({"warp_specialized": ws, "num_splits": s, **({"ctas_per_sm": ctas} if ws else {}),
                            "k_operand": "bf16", "tiles_per_pass": 1})
        fmt, gqa, page = case.fmt, case.q_heads // case.kv_heads, case.page
        e4m3 = [{**c, "k_operand": "e4m3"} for c in out if c["warp_specialized"]]
        if takes(fmt, gqa, page, "e4m3", 1):
            out += e4m3
        # every variant field given: a candidate left to the defaults would run what an earlier tuned
        # entry of the case says, and be recorded as another
        out += [{**c, "tiles_per_pass": 2} for c in out if c["warp_specialized"]
                and takes(fmt, gqa, page, c["k_operand"], 2)]
        if not takes(fmt, gqa, page, "e4m3", 1) and takes(fmt, gqa, page, "e4m3", 2):  # E4M3 K a pass of two only
            out += [{**c, "tiles_per_pass": 2} for c in e4m3]  # (the producer's fold of channel-wise K's Q')
        # the fastest variant on the H200 (E4M3 K, two tiles a pass, two CTAs per SM, where the format takes
        # them) over a wider range of splits: its best split count was half the heuristic's or less in 18 of
        # the 26 paper cases (docs/hopper-e4m3-plan.md)
        def best(s):
            return {"warp_specialized": True, "num_splits": s, "ctas_per_sm": 2, "k_operand": "e4m3",
                    "tiles_per_pass": 2}
        if takes(fmt, gqa, page, "e4m3", 2):
            base = default_num_splits(case.batch, case.kv_heads, tiles, device, 2)
            tried = {c["num_splits"] for c in out if c == best(c["num_splits"])}
            wider = {max(1, min(tiles, round(base * m))) for m in (0.25, 4)}
            if CLUSTER_MERGE:  # the split counts a cluster merges (1-16, powers of two) within that range
                wider |= {n for n in (1, 2, 4, 8, 16) if base / 4 <= n <= 4 * base and n <= tiles}
            out += [best(s) for s in sorted(wider - tried)]
        stages = config_for(fmt, gqa, page).stages  # the format's default ring

        def fits(c, n):
            return fits_shared_memory(config_for(fmt, gqa, page, c["k_operand"], c["tiles_per_pass"], stages=n),
                                      c["ctas_per_sm"])

        def ring(c):  # the default stages, or the deepest choice below them that the CTAs of an SM hold
            return default_ring(fmt, gqa, page, c["k_operand"], c["tiles_per_pass"], 1, c["ctas_per_sm"]).stages
        out = [{**c, "stages": ring(c)} if c["warp_specialized"] else c for c in out]
        if 2 * stages in STAGE_CHOICES:
            out += [{**c, "stages": 2 * stages} for c in out
                    if c["warp_specialized"] and c["stages"] == stages and fits(c, 2 * stages)]
        untuned = self._untuned(case, device)
        untuned = {**untuned, "stages": ring(untuned)} if untuned["warp_specialized"] else untuned
        return [untuned] + [c for c in out if c != untuned]

    def _step_candidates(self, case, device: torch.device) -> list[dict]:
        """A step's launches (v1: v0's registers hold one token's columns): the untuned one first; then one CTA an
        SM, and two up to 16 columns (32 columns' accumulators take one CTA's registers), each at its split
        heuristic times {1/2, 1, 2}, with the K operands the step takes (E4M3, BF16), one tile a pass (a pass of
        two takes one token), the ring an untuned launch takes (:func:`~foscar.cute.budget.default_ring`) and twice
        as deep where the CTAs of an SM hold it."""
        from ..cute.budget import default_ring, fits_shared_memory
        from ..cute.config import STAGE_CHOICES, TILE, TWO_CTA_COLUMNS, columns_for, config_for
        from ..cute.launch import default_num_splits, default_waves, takes
        fmt, gqa, page, T = case.fmt, case.q_heads // case.kv_heads, case.page, case.q_len
        tiles = case.seq_len // TILE
        out = []
        for ctas in (2, 1) if columns_for(gqa * T) in TWO_CTA_COLUMNS else (1,):
            base = default_num_splits(case.batch, case.kv_heads, tiles, device, ctas, default_waves(gqa * T))
            for s in [base] + sorted({max(1, min(tiles, round(base * m))) for m in (0.5, 2)} - {base}):
                for k in ("e4m3", "bf16"):
                    if takes(fmt, gqa, page, k, 1, T):
                        c = {"warp_specialized": True, "num_splits": s, "ctas_per_sm": ctas, "k_operand": k,
                             "tiles_per_pass": 1}
                        ring = default_ring(fmt, gqa, page, k, 1, T, ctas).stages
                        out.append({**c, "stages": ring})
                        if 2 * ring in STAGE_CHOICES and fits_shared_memory(
                                config_for(fmt, gqa, page, k, 1, T, stages=2 * ring), ctas):
                            out.append({**c, "stages": 2 * ring})
        untuned = self._untuned(case, device)
        untuned["stages"] = default_ring(fmt, gqa, page, untuned["k_operand"], untuned["tiles_per_pass"], T,
                                         untuned["ctas_per_sm"]).stages
        return [untuned] + [c for c in out if c != untuned]

    @staticmethod
    def _untuned(case, device: torch.device) -> dict:
        """The launch an untuned call of ``case`` runs (:func:`foscar.cute.launch.launch_config` with no entry): the
        default variant, its CTAs an SM for the case's rows (a step's tokens times the heads), its K operands and
        passes, its split heuristic."""
        from ..cute.config import TILE
        from ..cute.launch import (DEFAULT_WARP_SPECIALIZED, V0_RESIDENT, default_ctas_per_sm, default_num_splits,
                                   default_variant, default_waves)
        gqa, tiles, T = case.q_heads // case.kv_heads, case.seq_len // TILE, case.q_len
        if not DEFAULT_WARP_SPECIALIZED:
            splits = default_num_splits(case.batch, case.kv_heads, tiles, device, V0_RESIDENT, default_waves(gqa * T))
            return {"warp_specialized": False, "num_splits": splits, "k_operand": "bf16", "tiles_per_pass": 1}
        ctas = default_ctas_per_sm(gqa * T, case.fmt.head_dim)
        k_operand, tiles_per_pass = default_variant(case.fmt, gqa, case.page, step=T)
        splits = default_num_splits(case.batch, case.kv_heads, tiles, device, ctas, default_waves(gqa * T))
        return {"warp_specialized": True, "num_splits": splits, "ctas_per_sm": ctas, "k_operand": k_operand,
                "tiles_per_pass": tiles_per_pass}

    def launch(self, q, cache, config: dict):
        if q.dim() == 4:
            return self.launch_step(q, cache, config)
        from ..cute.launch import decode
        return decode(q, cache, **config)
