"""The one measurement harness every benchmark of ``python -m jobs.bench`` uses.

A benchmark is a module ``jobs/bench/<name>.py`` (picked up by its file name; helpers start with ``_``) with

    NAME = "<name>"                  # string literals: the listing reads them without importing the module
    HELP = "one line for the listing"

    def add_arguments(parser: argparse.ArgumentParser) -> None: ...    # its own options
    def run(args, harness: Harness) -> dict: ...                        # measures; returns the numbers to keep

Heavy dependencies (vllm, ray, transformers, matplotlib, mooncake) are imported inside ``run``.  The CLI adds
``--out DIR`` (default ``<work>/bench/<name>``), prints :func:`environment` as a header, calls ``run`` and writes
``results.json`` there atomically: ``{"benchmark", "argv", "environment", "elapsed_s", "results": run's dict,
"samples": every Samples, "tables": every printed table}``.  A benchmark sets ``harness.exit_status`` to make the
CLI exit non-zero after writing (e.g. the exit code of a wrapped command).

Measuring:

    s = harness.interleave({"A": fa, "B": fb}, reps=10, warmup=1)   # A B, B A, A B, ... (order="alternate")
    harness.compare(s, baseline="A", scale=1e3, unit="ms")            # medians, spread, ratio to A, side by side

Each case is called as ``fn(rep)`` (``rep`` counts warm-up repetitions too, from 0) and returns None, a number
(recorded as metric "value") or a dict of numbers (one metric each); the harness always records the call's wall
time as metric "wall_s".  ``order="rotate"`` starts each repetition one case later (A B C, B C A, C A B) instead.
"""
from __future__ import annotations

import importlib.metadata
import math
import os
import platform
import statistics
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping

from pipeline.core.runtime import PROJECT_ROOT
from pipeline.data.shards import atomic_write_json

CaseFn = Callable[[int], "float | Mapping[str, float] | None"]
ORDERS = ("alternate", "rotate")


def call_order(cases: list[str], rep: int, order: str) -> list[str]:
    """The order in which repetition ``rep`` calls ``cases``: alternating (A B / B A) or rotating (A B C / B C A)."""
    if order == "alternate":
        return list(cases) if rep % 2 == 0 else list(cases)[::-1]
    if order == "rotate":
        k = rep % len(cases)
        return list(cases[k:]) + list(cases[:k])
    raise ValueError(f"order must be one of {ORDERS}, got {order!r}")


@dataclass
class Samples:
    """What one :meth:`Harness.interleave` measured: per case, per metric, one value per measured call."""
    label: str
    cases: list[str]
    warmup: int
    order: str
    calls: list[list[str]] = field(default_factory=list)  # the call order of every measured repetition
    metrics: dict[str, dict[str, list[float]]] = field(default_factory=dict)  # case -> metric -> values

    def record(self, case: str, values: Mapping[str, float]) -> None:
        per = self.metrics.setdefault(case, {})
        for k, v in values.items():
            per.setdefault(k, []).append(float(v))

    def values(self, case: str, metric: str = "wall_s") -> list[float]:
        try:
            return self.metrics[case][metric]
        except KeyError:
            raise KeyError(f"{self.label}: no metric {metric!r} for case {case!r} "
                           f"(has {sorted(self.metrics.get(case, {}))})") from None

    def median(self, case: str, metric: str = "wall_s") -> float:
        return statistics.median(self.values(case, metric))

    def total(self, case: str, metric: str = "wall_s") -> float:
        return math.fsum(self.values(case, metric))

    def medians(self, metric: str = "wall_s") -> dict[str, float]:
        return {c: self.median(c, metric) for c in self.cases if self.metrics.get(c, {}).get(metric)}

    def to_json(self) -> dict:
        return {"cases": self.cases, "warmup": self.warmup, "order": self.order, "calls": self.calls,
                "metrics": self.metrics,
                "medians": {c: {m: statistics.median(v) for m, v in per.items() if v}
                            for c, per in self.metrics.items()}}


def _as_metrics(out) -> dict[str, float]:
    if out is None:
        return {}
    if isinstance(out, bool):
        raise TypeError("a case returned a bool; return a number or a dict of numbers")
    if isinstance(out, (int, float)):
        return {"value": float(out)}
    if isinstance(out, Mapping):
        return {str(k): float(v) for k, v in out.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    raise TypeError(f"a case returned {type(out).__name__}; return None, a number or a dict of numbers")


def _cpu_flags_and_model() -> tuple[str, set[str]]:
    model, flags = None, set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, val = line.partition(":")
            key = key.strip()
            if key == "model name" and model is None:
                model = val.strip()
            elif key == "flags" and not flags:
                flags = set(val.split())
    except OSError:
        pass
    return model or platform.processor() or "unknown", flags


def _version(module: str) -> str | None:
    """Installed version of the distribution that provides import name ``module`` (without importing it)."""
    for dist in importlib.metadata.packages_distributions().get(module, [module]):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _git_commit() -> str | None:
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=PROJECT_ROOT, capture_output=True, text=True,
                              timeout=10)
        if head.returncode != 0:
            return None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=PROJECT_ROOT,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return None
    return head.stdout.strip() + ("-dirty" if dirty else "")


def environment() -> dict:
    """CPU model, cores, native bf16 (avx512_bf16 / AMX flags), package versions and git commit - read without
    importing torch, vllm or ray."""
    model, flags = _cpu_flags_and_model()
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        usable = os.cpu_count()
    return {"cpu": model, "cores": os.cpu_count(), "usable_cores": usable,
            "bf16": sorted(flags & {"avx512_bf16", "amx_bf16", "amx_tile"}),
            "python": platform.python_version(),
            "torch": _version("torch"), "vllm": _version("vllm"), "ray": _version("ray"),
            "git_commit": _git_commit()}


def format_environment(env: dict) -> str:
    bf16 = ", ".join(env["bf16"]) or "none (emulated)"
    return (f"[bench] CPU {env['cpu']}, {env['cores']} cores ({env['usable_cores']} usable), native bf16: {bf16}\n"
            f"[bench] python {env['python']}, torch {env['torch']}, vLLM {env['vllm']}, ray {env['ray']}, "
            f"git {env['git_commit']}")


def _jsonable(obj):
    """Plain JSON types: paths and other objects as strings, tuples as lists, mapping keys as strings."""
    if isinstance(obj, Mapping):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set)):
        return [_jsonable(v) for v in obj]
    if obj is None or isinstance(obj, (bool, int, str)):
        return obj
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if hasattr(obj, "item") and callable(obj.item):  # numpy / torch scalars
        return _jsonable(obj.item())
    return str(obj)


def format_table(header: list[str], rows: list[list]) -> str:
    """Right-aligned columns (the first left-aligned); floats printed as given, so format them before."""
    cells = [[str(c) for c in header]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = []
    for r in cells:
        lines.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))))
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


class Harness:
    """Interleaved repetitions, medians, printed tables and the results.json of one benchmark run."""

    def __init__(self, name: str, out_dir: Path, argv: list[str]):
        self.name = name
        self.out_dir = Path(out_dir)
        self.argv = list(argv)
        self.environment = environment()
        self.samples: dict[str, Samples] = {}
        self.tables: dict[str, dict] = {}
        self.exit_status = 0
        self._t0 = time.time()

    def header(self) -> str:
        return f"[bench] {self.name}: {' '.join(self.argv[1:]) or '(defaults)'}\n" + format_environment(
            self.environment)

    def interleave(self, cases: Mapping[str, CaseFn], reps: int, *, warmup: int = 0, order: str = "alternate",
                   label: str | None = None, after_warmup: Callable[[], None] | None = None,
                   on_call: Callable[[str, int, dict], None] | None = None) -> Samples:
        """Run ``warmup + reps`` repetitions; in each, every case once, in :func:`call_order`.  Warm-up calls
        are not recorded; ``after_warmup()`` runs once before the first measured repetition; ``on_call(case,
        rep, metrics)`` after every measured call (to print progress).  Kept under ``label`` in results.json."""
        if not cases:
            raise ValueError("interleave needs at least one case")
        if reps < 1 or warmup < 0:
            raise ValueError(f"reps must be >= 1 and warmup >= 0, got reps={reps}, warmup={warmup}")
        names = list(cases)
        label = label or f"run{len(self.samples)}"
        if label in self.samples:
            raise ValueError(f"samples label {label!r} used twice")
        s = Samples(label=label, cases=names, warmup=warmup, order=order)
        for rep in range(warmup + reps):
            if rep == warmup and after_warmup is not None:
                after_warmup()
            seq = call_order(names, rep, order)
            for case in seq:
                t0 = time.perf_counter()
                out = cases[case](rep)
                wall = time.perf_counter() - t0
                if rep < warmup:
                    continue
                metrics = {"wall_s": wall, **_as_metrics(out)}
                s.record(case, metrics)
                if on_call is not None:
                    on_call(case, rep - warmup, metrics)
            if rep >= warmup:
                s.calls.append(seq)
        self.samples[label] = s
        return s

    def compare(self, samples: Samples, metric: str = "wall_s", *, baseline: str | None = None, scale: float = 1.0,
                unit: str = "s", title: str | None = None, digits: int = 2) -> dict[str, dict]:
        """Print (and keep) one row per case: median, min, max of ``metric`` x ``scale`` and the ratio of the
        median to ``baseline``'s (default: the first case).  Returns {case: {median, min, max, n, ratio}}."""
        baseline = baseline or samples.cases[0]
        base = samples.median(baseline, metric)
        out, rows = {}, []
        for c in samples.cases:
            v = samples.values(c, metric)
            med = statistics.median(v)
            ratio = med / base if base else float("nan")
            out[c] = {"median": med * scale, "min": min(v) * scale, "max": max(v) * scale, "n": len(v),
                      "ratio": ratio}
            rows.append([c, f"{med * scale:.{digits}f}", f"{min(v) * scale:.{digits}f}",
                         f"{max(v) * scale:.{digits}f}", len(v), f"{ratio:.3f}"])
        self.table(title or f"{samples.label}: {metric} ({unit}), ratio to {baseline}",
                   ["case", f"median {unit}", "min", "max", "n", f"/ {baseline}"], rows)
        return out

    def table(self, title: str, header: list[str], rows: list[list]) -> None:
        """Print a table and keep it for results.json."""
        print(f"\n{title}\n{format_table(header, rows)}", flush=True)
        self.tables[title] = {"header": list(header), "rows": _jsonable(rows)}

    def write(self, results: Mapping | None) -> Path:
        """results.json under out_dir, written atomically (whole or absent)."""
        self.out_dir.mkdir(parents=True, exist_ok=True)
        path = self.out_dir / "results.json"
        doc = {"benchmark": self.name, "argv": self.argv, "environment": self.environment,
               "elapsed_s": time.time() - self._t0, "results": results or {},
               "samples": {k: s.to_json() for k, s in self.samples.items()}, "tables": self.tables}
        atomic_write_json(path, _jsonable(doc))
        return path
