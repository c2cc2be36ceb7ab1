"""Teacher-forced held-out tau of exported drafters, per source prompt file, on ONE training run's held-out split.

    python -m jobs.bench heldout_tau --split-of work/big3/train_dspark_1ep \\
        big3_1ep=work/big3/train_dspark_1ep/drafter big2_6ep=work/big2/train_dspark_w1emb_6ep/drafter

The split is --split-of's plan.json holdout_ids; the samples (features, tokens) come from the hidden-state store
that run trained from.  jobs.train holds a sample out by a hash of its id, so runs over nested stores (a store
resumed to more prompts) share their held-out samples and their drafters can be compared on the larger split; the
benchmark refuses a drafter whose own run (its parent folder's plan.json) trained on any of them.

Or --data STORE: the samples of another store, per source file, e.g. the target's greedy responses to the
benchmark prompts (jobs.generate + jobs.extract on eval/*.jsonl); --walk-tokens 128 then gives the tau a greedy
fp32 jobs.evaluate rollout of 128 new tokens counts, at a fraction of its cost:

    python -m jobs.bench heldout_tau --data work/bench_hidden --walk-tokens 128 a=work/a/drafter b=work/b/drafter

tau is the training curve's measure (pipeline.train.heldout.teacher_forced_tau: greedy, full depth, true
predecessors, up to --blocks evenly spaced blocks per sample) on ALL held-out samples, not the curve's subset,
computed with the exported checkpoint (the weights that are served).  Prints one row per drafter; the numbers go
to results.json (results.drafters)."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from pipeline.dspark.checkpoint import load_drafter
from pipeline.eval.evaluation import load_heldout_suites
from pipeline.stores import open_hidden_store
from pipeline.data.subsets import by_source_file
from pipeline.data.target_model import resolve_target
from pipeline.train.heldout import greedy_walk_tau, teacher_forced_tau

NAME = "heldout_tau"
HELP = "teacher-forced (and replayed) held-out tau of exported drafters on one training run's held-out split"


def add_arguments(p) -> None:
    p.add_argument("drafters", nargs="+", help="LABEL=DRAFTER_FOLDER (an exported checkpoint)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--split-of", type=Path, help="training run folder whose held-out split is used")
    src.add_argument("--data", type=Path,
                     help="or: a disk store of the target's greedy responses to other prompts (jobs.generate + "
                          "jobs.extract on e.g. the benchmark files), measured per source file")
    p.add_argument("--blocks", type=int, default=64, help="blocks per sample (default: 64, as training)")
    p.add_argument("--walk-tokens", type=int, default=0,
                   help="also replay greedy rounds over the first N response tokens of each sample and print that "
                        "round-averaged tau (what an engine rollout of N new tokens measures); 0: off")
    p.add_argument("--limit", type=int, default=0,
                   help="only the held-out samples `jobs.evaluate --heldout-of SPLIT_OF --limit N` uses (N per prompt "
                        "file, same seeded choice); 0: all of them")


def parse_drafters(specs: list[str], hold: list[str]) -> dict[str, Path]:
    drafters = {}
    for spec in specs:
        label, sep, path = spec.partition("=")
        if not sep or not (Path(path) / "config.json").is_file():
            raise SystemExit(f"expected LABEL=DRAFTER_FOLDER (with a config.json), got {spec!r}")
        own = Path(path).parent / "plan.json"
        if own.is_file():
            leaked = set(json.loads(own.read_text()).get("train_ids") or []) & set(hold)
            if leaked:
                raise SystemExit(f"{label}: its run trained on {len(leaked)} of these held-out samples "
                                 f"(e.g. {sorted(leaked)[0]}); compare on a split it never saw")
        drafters[label] = Path(path)
    return drafters


def open_suites(data: Path, limit: int = 0):
    """A finished disk store of responses to other prompts (e.g. the benchmarks) -> (store, manifest, {source file:
    sample ids}), each file's ids cut to `limit` with the fixed seeded subset (0 = all)."""
    if not (data / "manifest.json").is_file():  # checked first: opening a store creates its folder
        raise SystemExit(f"--data {data}: not a finished hidden-state store (no manifest.json)")
    store = open_hidden_store("disk", data)
    manifest = store.manifest()
    return store, manifest, by_source_file(sorted(manifest["sample_ids"]), limit)


def run(a, harness) -> dict:
    if a.data is not None:  # another store: its samples per source file, none of them trained on
        store, manifest, by_tag = open_suites(a.data, a.limit)
        hold, source, target_path = sorted(manifest["sample_ids"]), f"--data {a.data}", manifest.get("target")
    else:
        plan_path = a.split_of / "plan.json"
        if not plan_path.is_file():
            raise SystemExit(f"--split-of {a.split_of}: not a training run folder (plan.json missing)")
        plan = json.loads(plan_path.read_text())
        hold = sorted(plan.get("holdout_ids") or [])
        if not hold:
            raise SystemExit(f"{plan_path} has no held-out samples")
        # grouped per prompt file (and with --limit cut) exactly as `jobs.evaluate --heldout-of` does
        by_tag = {suite.removeprefix("heldout-"): [r["id"] for r in rows]
                  for suite, rows in load_heldout_suites(a.split_of, None, a.limit or len(hold))}
        source, target_path = str(a.split_of), plan.get("target")
        store = open_hidden_store("disk", plan["config"]["data"])
    drafters = parse_drafters(a.drafters, hold)
    hold = [sid for ids in by_tag.values() for sid in ids]
    samples = {sid: store.get(sid) for sid in hold}
    target = resolve_target(target_path)
    result = {}
    tags = sorted(by_tag)
    print(f"{len(hold)} held-out samples of {source}: " + ", ".join(f"{t} {len(by_tag[t])}" for t in tags))
    print("drafter".ljust(24) + "".join(t[:14].rjust(15) for t in tags) + "all".rjust(9))
    rows = []
    for label, path in drafters.items():
        model = load_drafter(path, target, dtype=torch.float32)
        per, hist_all, n_all = {}, None, 0
        for t in tags:
            ev = teacher_forced_tau(model, [samples[s] for s in by_tag[t]], a.blocks)
            per[t] = ev
            h = torch.tensor(ev["accept_hist"]) * ev["blocks"]
            hist_all = h if hist_all is None else hist_all + h
            n_all += ev["blocks"]
        walk = {t: greedy_walk_tau(model, [samples[s] for s in by_tag[t]], a.walk_tokens)
                for t in tags} if a.walk_tokens else None
        G = len(hist_all) - 1
        tau_all = float(1 + (hist_all * torch.arange(G + 1)).sum() / max(n_all, 1))
        result[label] = dict(drafter=str(path), all=dict(tau=tau_all, blocks=n_all),
                             **{t: dict(tau=per[t]["tau"], blocks=per[t]["blocks"]) for t in tags})
        print(label[:23].ljust(24) + "".join(f"{per[t]['tau']:15.3f}" for t in tags) + f"{tau_all:9.3f}", flush=True)
        rows.append([label, "teacher-forced"] + [f"{per[t]['tau']:.3f}" for t in tags] + [f"{tau_all:.3f}"])
        if walk:
            w_all = sum(w["tokens"] for w in walk.values()) / max(1, sum(w["rounds"] for w in walk.values()))
            result[label]["walk"] = dict(tokens=a.walk_tokens, all=w_all, **{t: walk[t]["tau"] for t in tags})
            print(f"  walk {a.walk_tokens} tokens".ljust(24) + "".join(f"{walk[t]['tau']:15.3f}" for t in tags)
                  + f"{w_all:9.3f}", flush=True)
            rows.append([label, f"walk {a.walk_tokens} tokens"] + [f"{walk[t]['tau']:.3f}" for t in tags]
                        + [f"{w_all:.3f}"])
    harness.table(f"held-out tau on {len(hold)} samples of {source}", ["drafter", "measure"] + tags + ["all"], rows)
    return dict(split_of=None if a.split_of is None else str(a.split_of),
                data=None if a.data is None else str(a.data), samples=len(hold), drafters=result)
