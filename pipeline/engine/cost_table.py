"""The SPS(B) cost table: what one target forward of B tokens costs on this machine, profiled once and cached.

``CostTable`` is the curve t(B) (and SPS(B) = 1 / t(B)) the load-aware schedulers of pipeline/engine/scheduler.py
price verification with.  ``load_or_profile_cost_table`` profiles it for a runner (``CostTable.profile``) and keeps
it at ``<work>/cache/sps-<key>.json``, the key being everything the curve depends on (target, dtype, device,
threads, profile settings, torch version, the CPU linear back end).  The cache is written whole or not at all, so it
is read without a lock; profiling runs under an OS lock (pipeline/core/file_lock.py: dropped by the kernel if its
holder dies, waited for at most a bound), one profiler at a time on the machine, because a concurrent profile would
measure the other's contention.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import torch

from pipeline.core.file_lock import DEFAULT_TIMEOUT_S, atomic_write_text, file_lock, sweep_temporaries
from pipeline.core.runtime import work_dir
from pipeline.ops import bf16_linear, layer_ops

logger = logging.getLogger(__name__)


@dataclass
class ProfileSpec:
    """What an SPS profile measures and where it is cached."""

    target: str  # the target's HF folder
    dtype: str = "float32"  # the runner's precision string
    device: str = "cpu"
    batch_sizes: list = field(default_factory=lambda: [1, 2, 4, 8, 16, 32])  # B values profiled
    context_len: int = 128  # cached tokens per request while profiling
    repeats: int = 3
    cache_dir: str | None = None  # None: <work>/cache


class CostTable:
    """Target step time t(B) for B tokens in one forward, and SPS(B) = 1 / t(B).

    Built from measured points (B -> seconds), piecewise-linear in between, linear extrapolation (last segment's slope,
    never decreasing) beyond the last point.  Lookups are O(1) from a dense array up to ``dense_max``.
    """

    def __init__(self, step_seconds: dict, meta: dict | None = None, dense_max: int = 4096):
        if not step_seconds:
            raise ValueError("empty cost table")
        pts = sorted((int(b), float(t)) for b, t in step_seconds.items())
        if pts[0][0] < 1 or any(t <= 0 for _, t in pts):
            raise ValueError(f"bad cost table points {pts}")
        self.points = pts
        self.meta = dict(meta or {})
        self._dense_max = max(dense_max, pts[-1][0])
        self._t = [0.0] + [self._interp(b) for b in range(1, self._dense_max + 1)]
        self._sps = [0.0] + [1.0 / t for t in self._t[1:]]
        self._env = list(self._t)  # _env[B] = min over B' >= B of t(B') (beyond the dense range t only grows)
        for b in range(self._dense_max - 1, 0, -1):
            self._env[b] = min(self._env[b], self._env[b + 1])

    def _interp(self, b: int) -> float:
        pts = self.points
        if b <= pts[0][0]:
            return pts[0][1]
        for (b0, t0), (b1, t1) in zip(pts, pts[1:]):
            if b <= b1:
                return t0 + (t1 - t0) * (b - b0) / (b1 - b0)
        if len(pts) == 1:
            return pts[0][1]
        (b0, t0), (b1, t1) = pts[-2], pts[-1]
        slope = max(0.0, (t1 - t0) / (b1 - b0))
        return t1 + slope * (b - b1)

    def step_time(self, B: int) -> float:
        return self._t[B] if 1 <= B <= self._dense_max else self._interp(max(1, int(B)))

    def verify_time(self, B: int) -> float:
        """What a verification round of B tokens is priced at: min over B' >= B of t(B').  A measured table need not
        be monotone (on some CPUs the fp32 forward of 1-2 tokens through MKL is slower than one of 4-8 through
        oneDNN's packed layout); priced at t(B), the early-stopping search would stop at the bump and never
        reach the cheaper, deeper verification behind it.  Any fixed price keeps the search lossless."""
        return self._env[B] if 1 <= B <= self._dense_max else self._interp(max(1, int(B)))

    def sps(self, B: int) -> float:
        return self._sps[B] if 1 <= B <= self._dense_max else 1.0 / self._interp(max(1, int(B)))

    @classmethod
    def from_sps(cls, sps: dict | Sequence[float], **kw) -> "CostTable":
        """From SPS values: a dict B -> steps/s, or a sequence (SPS(1), SPS(2), ...)."""
        items = sps.items() if isinstance(sps, dict) else enumerate(sps, start=1)
        return cls({int(b): 1.0 / float(s) for b, s in items}, **kw)

    @classmethod
    def flat(cls, seconds: float = 1.0) -> "CostTable":
        return cls({1: seconds})

    @classmethod
    def profile(cls, runner, batch_sizes: Sequence[int] = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64),
                context_len: int = 300, max_tokens_per_request: int = 8, repeats: int = 5,
                warmup: int = 2) -> "CostTable":
        """Time the target runner's forward for each B (``TargetRunner.time_forwards``: B new tokens over
        ceil(B / max_tokens_per_request) requests with ``context_len`` cached tokens each; interleaved sweeps,
        medians)."""
        pts = runner.time_forwards([int(b) for b in batch_sizes], context_len=context_len,
                                   max_tokens_per_request=max_tokens_per_request, repeats=repeats, warmup=warmup)
        meta = {"context_len": context_len, "max_tokens_per_request": max_tokens_per_request, "repeats": repeats,
                "device": str(getattr(runner, "device", "")), "dtype": str(getattr(runner, "dtype", "")),
                "threads": torch.get_num_threads()}
        return cls(pts, meta=meta)

    def inversion(self) -> float:
        """How far the measured points are from "more tokens never cost less": max over B1 < B2 of
        t(B1) / t(B2) - 1 (0 for a monotone table).  A large value means the profile caught contention."""
        worst, ts = 0.0, [t for _, t in self.points]
        for i, t1 in enumerate(ts):
            for t2 in ts[i + 1:]:
                worst = max(worst, t1 / t2 - 1.0)
        return worst

    def to_dict(self) -> dict:
        return {"step_seconds": {str(b): t for b, t in self.points}, "meta": self.meta}

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1))

    @classmethod
    def load(cls, path: str | Path) -> "CostTable":
        d = json.loads(Path(path).read_text())
        return cls({int(b): float(t) for b, t in d["step_seconds"].items()}, meta=d.get("meta"))


def cost_table_key(spec: ProfileSpec, max_tokens_per_request: int, linear_backend: str | None = None) -> str:
    """The SPS cache key: everything the cost curve depends on, the runner's CPU linear back end included (an
    automatic ``float32`` picks one per machine)."""
    tgt = Path(spec.target)
    cfg = tgt / "config.json"
    ident = {
        "target": str(tgt.resolve()), "config_mtime": cfg.stat().st_mtime if cfg.is_file() else None,
        "dtype": spec.dtype, "device": spec.device, "threads": torch.get_num_threads(),
        "batch_sizes": [int(b) for b in spec.batch_sizes], "context_len": spec.context_len,
        "repeats": spec.repeats, "max_tokens_per_request": max_tokens_per_request,
        "torch": torch.__version__, "cpus": os.cpu_count(),
        "v": 4,  # v2: interleaved sweeps; v3: oneDNN pre-packed fp32 linears by default (a different cost curve);
        # v4: the linear back end in the key
        "linear_backend": linear_backend,
    }
    if linear_backend == "invariant":  # the kernels' source versions: a faster kernel is another curve
        ident["kernels"] = f"{bf16_linear.version()} {layer_ops.version()}".strip()
    return hashlib.sha1(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]


MAX_INVERSION = 0.25  # a table where fewer tokens cost 25% more than more tokens caught contention: measure again
SAME_SHAPE = 0.15  # two profiles within 15% at every B: an inversion they share is the hardware's, not contention


def same_shape(a: CostTable, b: CostTable, tol: float = SAME_SHAPE) -> bool:
    """Whether two profiles of the same B agree within ``tol`` (relative) at every point."""
    pa, pb = dict(a.points), dict(b.points)
    return pa.keys() == pb.keys() and all(abs(pa[k] - pb[k]) <= tol * min(pa[k], pb[k]) for k in pa)


PROFILE_LOCK = "sps-profile.lock"  # in the cache folder


def _plausible_cache(path: Path) -> CostTable | None:
    """The cached table at ``path`` if it exists, parses and is plausible (see load_or_profile_cost_table)."""
    if not path.is_file():
        return None
    try:
        table = CostTable.load(path)
    except Exception:  # corrupt cache: profile again
        logger.warning("corrupt SPS cache %s; re-profiling", path)
        return None
    if table.inversion() <= MAX_INVERSION or table.meta.get("inversion_reproduced"):
        return table
    logger.warning("SPS cache %s is implausible (inversion %.2f); re-profiling", path, table.inversion())
    return None


def load_or_profile_cost_table(runner, spec: ProfileSpec, max_tokens_per_request: int, force: bool = False,
                               attempts: int = 3, lock_timeout_s: float = DEFAULT_TIMEOUT_S):
    """The cached SPS table for this (target, dtype, device, threads, profile settings), profiling it if missing.

    A profile (or a cached one) whose points are implausible -- ``CostTable.inversion() > MAX_INVERSION``, e.g. a
    1-token step measured slower than a 16-token one because another process took the cores -- is measured again,
    up to ``attempts`` times, keeping the most plausible.  An inversion that two successive profiles reproduce
    (``same_shape``) is the hardware's and is kept as measured (e.g. fp32 on a CPU where MKL's 1-2 row GEMM is
    slower than oneDNN's 4-8 row one); the scheduler prices verification at the cheapest larger batch
    (``CostTable.verify_time``).  (The live scale in pipeline.engine.scheduler.LiveRoundCost corrects the level to the speed
    the replica actually sees.)  Returns (CostTable, path, profiled: bool)."""
    cache = Path(spec.cache_dir) if spec.cache_dir else work_dir() / "cache"
    cache.mkdir(parents=True, exist_ok=True)
    key = cost_table_key(spec, max_tokens_per_request, getattr(runner, "linear_backend", None))
    path = cache / f"sps-{key}.json"
    if not force and (table := _plausible_cache(path)) is not None:  # written whole or not at all: no lock
        return table, path, False
    # An OS lock (dropped by the kernel if its holder dies), waited for at most lock_timeout_s: one profiler at a
    # time on this machine, whatever its key (two profiles at once would each measure the other's contention).
    with file_lock(cache / PROFILE_LOCK, timeout_s=lock_timeout_s, what="the SPS profile"):
        sweep_temporaries(cache, path.name)
        if not force and (table := _plausible_cache(path)) is not None:  # profiled while this one waited
            return table, path, False
        best = prev = None
        for attempt in range(max(1, attempts)):
            table = CostTable.profile(runner, batch_sizes=[int(b) for b in spec.batch_sizes],
                                      context_len=spec.context_len, max_tokens_per_request=max_tokens_per_request,
                                      repeats=spec.repeats, warmup=1)
            if best is None or table.inversion() < best.inversion():
                best = table
            if best.inversion() <= MAX_INVERSION:
                break
            if prev is not None and same_shape(prev, table):
                best = table
                best.meta["inversion_reproduced"] = True
                logger.info("SPS profile not monotone, reproduced by two profiles (inversion %.2f): kept as the "
                            "hardware's cost curve: %s", table.inversion(), table.points)
                break
            logger.warning("SPS profile attempt %d implausible (inversion %.2f): %s", attempt + 1,
                           table.inversion(), table.points)
            prev = table
        best.meta["key"] = key
        best.meta["inversion"] = round(best.inversion(), 4)
        atomic_write_text(path, json.dumps(best.to_dict(), indent=1))
        return best, path, True
