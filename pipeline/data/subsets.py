"""Fixed, seeded subsets of a list: the same prompts / samples for every system and every run.

A cut taken from the start of a sorted or stored order is biased: sorted request ids ("<file>:<line>") put one
source file first (a held-out measurement would see one file's prompts only), and a store's order is its
generation order.  Every "use at most N of these" in evaluation, calibration and training goes through here."""
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


def source_of(sample_id: str) -> str:
    """The prompt file tag of a request / sample id ("<file>:<line>" -> "<file>")."""
    return sample_id.rsplit(":", 1)[0]


def by_source_file(ids: list[str], limit: int = 0) -> dict[str, list[str]]:
    """Request / sample ids ("<file>:<line>") grouped by their source file, files in sorted order; each group sorted,
    then cut to `limit` with `subsample` (0 = all)."""
    groups: dict[str, list[str]] = {}
    for sid in ids:
        groups.setdefault(source_of(sid), []).append(sid)
    return {tag: subsample(sorted(g), limit or len(g)) for tag, g in sorted(groups.items())}


def parse_mix(entries: list[str]) -> dict[str, int | None]:
    """["gsm8k_train:200", "dolly_partial"] -> {"gsm8k_train": 200, "dolly_partial": None} (None = all of it)."""
    mix: dict[str, int | None] = {}
    for entry in entries:
        tag, sep, count = str(entry).rpartition(":")
        if not sep:
            tag, count = str(entry), ""
        if not tag:
            raise ValueError(f"--mix {entry!r}: expected SOURCE or SOURCE:COUNT (SOURCE = a prompt file's stem)")
        if tag in mix:
            raise ValueError(f"--mix names {tag!r} twice")
        if count == "":
            mix[tag] = None
            continue
        try:
            mix[tag] = int(count)
        except ValueError:
            raise ValueError(f"--mix {entry!r}: COUNT must be an integer") from None
        if mix[tag] <= 0:
            raise ValueError(f"--mix {entry!r}: COUNT must be > 0")
    return mix


def cut_to_mix(ids: list[str], mix: dict[str, int | None]) -> list[str]:
    """Only the ids of the sources in `mix`, each source cut to its COUNT with `subsample` (the same ids every
    run); the result in `ids`' order.  A source the ids lack, or one with fewer ids than asked, is an error that
    lists what there is."""
    groups = by_source_file(ids)
    have = ", ".join(f"{t} ({len(g)})" for t, g in groups.items())
    keep: set[str] = set()
    for tag, count in mix.items():
        if tag not in groups:
            raise ValueError(f"--mix {tag}: no samples from that source; the data holds {have}")
        if count is not None and count > len(groups[tag]):
            raise ValueError(f"--mix {tag}:{count}: only {len(groups[tag])} training samples from that source "
                             f"(the data holds {have})")
        keep.update(subsample(groups[tag], count or len(groups[tag])))
    return [i for i in ids if i in keep]
