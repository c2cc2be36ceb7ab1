"""The pieces of the one-command recipe (jobs.recipe) that need no engine: the prompt mix and the time budget.

A *mix* is a list of prompt files with a count each (``PATH:COUNT``, or ``PATH`` for all of it).  Each source is
shuffled with a fixed seed and written, cut to its share, as ``<out>/prompts/<stem>.jsonl``: the first N lines of
that file are the same for every N, so a run that grows its share later (after measuring how fast generation is)
keeps every request id it already answered (``<stem>:<line>``) and stage 1 resumes instead of redoing.

The *budget* is a wall-clock total split over the stages by fractions, except where a stage's fixed size is
known to need more: calibration and evaluation decode a set number of tokens (prompts x tokens x systems), so their
time is estimated from a single-stream decode rate measured at the start and reserved first (`plan_budget`).  Every
other size is derived from a throughput measured on this machine during the run (responses per second of a round
of generation AND extraction, seconds per training step on a probe), never assumed.
"""
from __future__ import annotations

import json
import math
import random
import statistics
from dataclasses import asdict, dataclass
from functools import cached_property
from pathlib import Path

from pipeline.data.prompts import read_prompt_files
from pipeline.data.shards import atomic_write_bytes

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


# decode estimates x this, for what the probe's rate leaves out: prefills, engine loads, systems slower than the
# probe's (measurements: docs/results/recipe.md)
DECODE_SLACK = 1.15


def decode_seconds(tokens: int, tok_s: float, slack: float = DECODE_SLACK) -> float:
    """Seconds to decode `tokens` single-stream at the measured `tok_s`, with `slack` for what the rate leaves out
    (prefills, slower systems, loading engines and drafters)."""
    if tok_s <= 0:
        raise ValueError(f"decode rate must be > 0, got {tok_s}")
    return slack * tokens / tok_s


def plan_budget(split: BudgetSplit, total_s: float, needs: dict[str, float], min_rest: float = 0.25) -> dict:
    """Seconds per stage: a stage in `needs` gets the larger of its fraction and its need; the stages not in `needs`
    share what is left in proportion to their fractions.  A ValueError names the needs when they leave the other
    stages less than `min_rest` of the total (a run that could only evaluate would measure nothing worth having)."""
    share = split.seconds(total_s)
    fixed = {k: max(share[k], v) for k, v in needs.items()}
    rest = total_s - sum(fixed.values())
    if rest < min_rest * total_s:
        wants = ", ".join(f"{k} ~{v / 60:.0f} min" for k, v in needs.items())
        raise ValueError(f"the budget of {total_s / 3600:.2f} h is too small: {wants} leave "
                         f"{max(rest, 0) / 60:.0f} min for generation, extraction and training; raise "
                         f"--budget-hours, or evaluate fewer prompts or systems (--eval-prompts, --eval-args)")
    others = {k: v for k, v in share.items() if k not in fixed}
    scale = rest / sum(others.values())
    return {k: fixed[k] if k in fixed else others[k] * scale for k in share}


def round_cost(rounds: list[tuple[int, float]]) -> tuple[float, float]:
    """(fixed seconds per round, seconds per response) of stages 1-2 from the rounds so far, [(responses added,
    seconds)]: a least-squares line through them once their sizes differ (the fixed part is both engines' start-up,
    which a small last round would otherwise underrate), else the last round's rate through the origin (start-up
    spread over its responses: errs towards a smaller next round)."""
    pts = [(n, s) for n, s in rounds if n > 0 and s > 0]
    if not pts:
        raise ValueError(f"no round with responses and time in {rounds}")
    if len({n for n, _ in pts}) >= 2:
        mn, ms = sum(n for n, _ in pts) / len(pts), sum(s for _, s in pts) / len(pts)
        slope = sum((n - mn) * (s - ms) for n, s in pts) / sum((n - mn) ** 2 for n, _ in pts)
        if slope > 0 and ms - slope * mn >= 0:
            return ms - slope * mn, slope
    n, s = pts[-1]
    return 0.0, s / n


def next_growth(remaining_s: float, rounds: list[tuple[int, float]], have: int, available: int,
                min_rows: int) -> int | None:
    """Stages 1-2 grow in rounds: after `rounds` ([(responses added, seconds)], each with its hidden states and
    both engines' start-up), the total that one more round fits into the `remaining_s` of the two stages' budget
    (`round_cost`), or None when fewer than `min_rows` more fit (one generate batch: a smaller round would spend
    most of its time starting engines), the mix is answered, or the last round added nothing."""
    if have >= available or not rounds or rounds[-1][0] <= 0:
        return None
    fixed, per_row = round_cost(rounds)
    more = min(available - have, int((remaining_s - fixed) / per_row))
    return have + more if more > 0 and more >= min(min_rows, available - have) else None


def training_seconds(planned: float, elapsed: float, total: float, reserved_after: float,
                     floor_share: float = 0.5) -> float:
    """The training budget once stages 1-2 are done: what the total leaves after them and the reserve of
    calibration and evaluation, i.e. the planned share plus what they left unused or less what they overran (so the
    run ends near its total), but never below `floor_share` of the plan."""
    return max(floor_share * planned, total - elapsed - reserved_after)


def steps_that_fit(seconds: float, step_seconds: list[float], minimum: int = 10) -> int:
    """Optimizer steps per drafter when every drafter trains the same number of steps, one after another: the
    training budget over the sum of their seconds per step (a DFlash step is cheaper than a DSpark one: no Markov
    head, no confidence head; measurements: docs/results/recipe.md)."""
    if not step_seconds or min(step_seconds) <= 0:
        raise ValueError(f"step time must be > 0, got {step_seconds}")
    return max(minimum, int(seconds / sum(step_seconds)))


def probe_step_seconds(rows: list[tuple[int, float]], eval_steps: set[int], eval_every: int) -> float:
    """Seconds per step of a full training run from a probe's logged (step, time) rows, in step order, logged as the
    full run logs.  A row's time is taken before the held-out evaluation of its step (`eval_steps`), so an interval
    that starts at such a row holds one evaluation: the steady step time comes from the other intervals (none before
    the first row: that is start-up), the evaluation's extra time from those, and the evaluation is spread over
    `eval_every` steps.  (A probe that logs more often than the full run would overestimate its step time, since
    each log costs time; measurements: docs/results/recipe.md.)"""
    steps = [s for s, _ in rows]
    if steps != sorted(set(steps)):
        raise ValueError(f"a training probe's rows must be in step order, got steps {steps}")
    spans = [(b[0] - a[0], b[1] - a[1], a[0] in eval_steps) for a, b in zip(rows, rows[1:])]
    clean = [(ds, dt) for ds, dt, ev in spans if not ev]
    if not clean or len(clean) == len(spans):
        raise ValueError(f"a training probe needs intervals with and without an evaluation, got rows at {steps} "
                         f"and evaluations at {sorted(eval_steps)}")
    step_s = sum(dt for _, dt in clean) / sum(ds for ds, _ in clean)
    evals = [dt - ds * step_s for ds, dt, ev in spans if ev]
    return step_s + max(0.0, statistics.mean(evals)) / max(1, eval_every)
