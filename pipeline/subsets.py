"""Fixed, seeded subsets of a list: the same prompts / samples for every system, run and session.

A cut taken from the start of a sorted or stored order is biased: sorted request ids ("<file>:<line>") put one
source file first (the training curve's held-out tau once measured arena-hard prompts only), and a store's order is
its generation order.  Every "use at most N of these" in evaluation, calibration and training goes through here."""
from __future__ import annotations

import random

EVAL_SEED = 980406  # DeepSpec's subsampling seed (docs/dspark.md §9)


def subsample(rows: list, limit: int) -> list:
    """At most `limit` rows: all of them in their order, or a shuffle with the fixed EVAL_SEED cut to `limit`."""
    if len(rows) <= limit:
        return list(rows)
    rows = list(rows)
    random.Random(EVAL_SEED).shuffle(rows)
    return rows[:limit]


def by_source_file(ids: list[str], limit: int = 0) -> dict[str, list[str]]:
    """Request / sample ids ("<file>:<line>") grouped by their source file, files in sorted order; each group sorted,
    then cut to `limit` with `subsample` (0 = all)."""
    groups: dict[str, list[str]] = {}
    for sid in ids:
        groups.setdefault(sid.rsplit(":", 1)[0], []).append(sid)
    return {tag: subsample(sorted(g), limit or len(g)) for tag, g in sorted(groups.items())}
