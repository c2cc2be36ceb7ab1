"""The pieces of the one-command recipe (jobs.recipe) that need no engine: the prompt mix and the time budget.

A *mix* is a list of prompt files with a count each (``PATH:COUNT``, or ``PATH`` for all of it).  Each source is
shuffled with a fixed seed and written, cut to its share, as ``<out>/prompts/<stem>.jsonl``: the first N lines of
that file are the same for every N, so a run that grows its share later (after measuring how fast generation is)
keeps every request id it already answered (``<stem>:<line>``) and stage 1 resumes instead of redoing.

The *budget* is a wall-clock total split over the stages by fixed fractions; each stage's size is derived from a
throughput measured on this machine during the run (responses per second on a probe, seconds per training step on
a probe), never assumed.
"""
from __future__ import annotations

import json
import math
import random
from dataclasses import asdict, dataclass
from functools import cached_property
from pathlib import Path

from pipeline.prompts import read_prompt_files
from pipeline.shards import atomic_write_bytes

MIX_SEED = 20260402  # the shuffle of every source; fixed so that reruns and other machines pick the same prompts


@dataclass
class MixEntry:
    path: Path
    count: int | None  # None = all valid prompts of the file

    @property
    def stem(self) -> str:
        return self.path.stem

    @cached_property
    def lines(self) -> list[str]:
        """The valid prompt lines of this source (as JSON rows {"turns": [text]}) in the fixed seeded order, cut to
        its count; read once per entry."""
        rows, _ = read_prompt_files([self.path])
        lines = [json.dumps({"turns": [r.text]}, ensure_ascii=False) for r in rows]
        random.Random(f"{MIX_SEED}:{self.stem}").shuffle(lines)
        return lines[:self.count] if self.count is not None else lines


def parse_mix(specs: list[str]) -> list[MixEntry]:
    """``["a.jsonl:2000", "b.jsonl"]`` -> entries; a clear error for a missing file, a bad count, a repeated stem."""
    out = []
    for spec in specs:
        path, sep, count = spec.rpartition(":")
        if not sep or not count.isdigit():  # no count given (or a ':' inside the path)
            path, count = spec, None
        else:
            count = int(count)
            if count < 1:
                raise ValueError(f"--prompts {spec}: the count must be >= 1")
        p = Path(path)
        if not p.is_file():
            raise FileNotFoundError(f"--prompts {spec}: prompt file not found: {p}")
        out.append(MixEntry(p, count))
    if not out:
        raise ValueError("--prompts: no prompt files given")
    stems = [e.stem for e in out]
    dup = sorted({s for s in stems if stems.count(s) > 1})
    if dup:
        raise ValueError(f"--prompts: two files share the name {dup[0]!r}; each source needs its own file name")
    return out


def write_mix(entries: list[MixEntry], folder: Path, fraction: float) -> list[Path]:
    """Write each source's first ceil(fraction x its count) shuffled prompts to folder/<stem>.jsonl (atomically;
    the prefix of a file never changes).  -> the files, in the mix's order."""
    if not 0 < fraction <= 1:
        raise ValueError(f"mix fraction must be in (0, 1], got {fraction}")
    folder.mkdir(parents=True, exist_ok=True)
    files = []
    for e in entries:
        lines = e.lines
        n = max(1, math.ceil(fraction * len(lines))) if lines else 0
        if n == 0:
            raise ValueError(f"--prompts {e.path}: no usable prompt in the file")
        f = folder / f"{e.stem}.jsonl"
        atomic_write_bytes(f, ("\n".join(lines[:n]) + "\n").encode())
        files.append(f)
    return files


def mix_sizes(entries: list[MixEntry]) -> dict[str, int]:
    return {e.stem: len(e.lines) for e in entries}


@dataclass
class BudgetSplit:
    """Fractions of the wall-clock budget per stage (they sum to 1)."""
    generate: float = 0.40
    extract: float = 0.07
    train: float = 0.28  # both drafters together, equal steps
    calibrate: float = 0.05
    evaluate: float = 0.20

    def __post_init__(self):
        total = sum(asdict(self).values())
        if abs(total - 1.0) > 1e-6 or min(asdict(self).values()) <= 0:
            raise ValueError(f"budget fractions must be > 0 and sum to 1, got {asdict(self)} (sum {total:.3f})")

    def seconds(self, budget_s: float) -> dict[str, float]:
        return {k: v * budget_s for k, v in asdict(self).items()}


def responses_that_fit(seconds: float, probe_rows: int, probe_seconds: float, already: int, available: int) -> int:
    """How many responses stage 1 should hold in all: what the measured rate (probe_rows in probe_seconds, engine
    start-up included, so the estimate errs low) produces in `seconds`, plus those already done, at most
    `available`, at least `already`."""
    if probe_rows <= 0 or probe_seconds <= 0:
        return min(available, max(already, 1))
    more = int(seconds * probe_rows / probe_seconds)
    return max(already, min(available, already + more))


def next_growth(remaining_s: float, rows_added: int, seconds: float, have: int, available: int,
                min_rows: int) -> int | None:
    """Stage 1 grows in rounds: after a round that added `rows_added` responses in `seconds` (engine start-up
    included), the total that fits the `remaining_s` of the stage's budget, or None when fewer than `min_rows` more
    fit (one generate batch: a smaller round would spend most of its time starting the engine) or none are left."""
    if have >= available or rows_added <= 0 or seconds <= 0:
        return None
    want = responses_that_fit(remaining_s, rows_added, seconds, have, available)
    return want if want - have >= min(min_rows, available - have) else None


def training_seconds(planned: float, elapsed: float, total: float, reserved_after: float,
                     floor_share: float = 0.5) -> float:
    """The training budget once stages 1-2 are done: the planned share, cut by what they overran (so calibration and
    evaluation keep theirs and the run ends near its total), but never below `floor_share` of the plan."""
    left = total - elapsed - reserved_after
    return max(floor_share * planned, min(planned, left))


def steps_that_fit(seconds: float, step_seconds: float, drafters: int = 2, minimum: int = 10) -> int:
    """Optimizer steps per drafter: the training budget shared equally by `drafters` runs of equal steps."""
    if step_seconds <= 0:
        raise ValueError(f"step time must be > 0, got {step_seconds}")
    return max(minimum, int(seconds / drafters / step_seconds))
