"""Benchmark tau against each benchmark's share of the training data, for drafters trained on different mixes.

    python -m jobs.bench domain_share --data work/bench_hidden \\
        --domain gsm8k=gsm8k_train --domain humaneval=thealgorithms_py_doctest,gpteacher_codegen \\
        --domain mt-bench=dolly_partial,hh_rlhf_helpful_test,gpteacher_roleplay \\
        math=work/mix_math code=work/mix_code uniform=work/mix_uniform ...

Each drafter is LABEL=RUN, a jobs.train --out folder (e.g. runs of `jobs.train --mix` on one store): its plan.json
says which samples it trained on.  --data is a disk store of the target's greedy responses to the benchmark prompts
(jobs.generate + jobs.extract on eval/*.jsonl), one suite per source file; --domain names, for each suite, the
training prompt files that are its domain (one --domain per suite).  For every run and suite this prints the
domain's share of the run's training samples and the suite's tau: replayed greedy rounds over --walk-tokens response
tokens (what a greedy fp32 jobs.evaluate rollout counts) and, in results.json, the teacher-forced tau.  The PNG
puts tau against share, one colour per suite, so whether a benchmark follows its own domain's share (and how
steeply) can be seen."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from jobs.bench.heldout_tau import open_suites
from pipeline.dspark.checkpoint import load_drafter
from pipeline.data.subsets import by_source_file
from pipeline.data.target_model import resolve_target
from pipeline.train.heldout import greedy_walk_tau, teacher_forced_tau

NAME = "domain_share"
HELP = "benchmark tau against the benchmark's domain share of each run's training data (runs on different mixes)"


def add_arguments(p) -> None:
    p.add_argument("runs", nargs="+", help="LABEL=RUN_FOLDER (a jobs.train --out folder with plan.json and drafter/)")
    p.add_argument("--data", type=Path, required=True,
                   help="disk store of the target's greedy responses to the benchmark prompts, one suite per file")
    p.add_argument("--domain", action="append", required=True, metavar="SUITE=SOURCE[,SOURCE...]",
                   help="the training prompt files (stems, as in sample ids) that make up a suite's domain; "
                        "once per suite")
    p.add_argument("--walk-tokens", type=int, default=128, help="response tokens replayed per sample (default 128)")
    p.add_argument("--blocks", type=int, default=64, help="blocks per sample of the teacher-forced tau")
    p.add_argument("--limit", type=int, default=0, help="at most N samples per suite (a fixed seeded subset); 0: all")
    p.add_argument("--png", type=Path, default=None, help="PNG to write (default: <out>/domain_share.png)")


def parse_domains(specs: list[str], suites: list[str]) -> dict[str, set[str]]:
    domains = {}
    for spec in specs:
        suite, sep, sources = spec.partition("=")
        names = {s for s in sources.split(",") if s}
        if not sep or not names:
            raise SystemExit(f"--domain: expected SUITE=SOURCE[,SOURCE...], got {spec!r}")
        if suite not in suites:
            raise SystemExit(f"--domain {suite}: no such suite in --data (it holds {', '.join(suites)})")
        domains[suite] = names
    return domains


def training_sources(run: Path) -> dict[str, int]:
    """{prompt file stem: training samples} of a jobs.train run, from its plan.json."""
    plan = run / "plan.json"
    if not plan.is_file() or not (run / "drafter" / "config.json").is_file():
        raise SystemExit(f"{run}: not a finished jobs.train run folder (plan.json and drafter/ expected)")
    return {tag: len(ids) for tag, ids in by_source_file(json.loads(plan.read_text())["train_ids"]).items()}


def plot(rows: list[dict], suites: list[str], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    for i, suite in enumerate(suites):
        pts = sorted((r["share"][suite], r["walk_tau"][suite], r["label"]) for r in rows)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", color=f"C{i}", label=suite)
        for x, y, label in pts:
            ax.annotate(label, (x, y), textcoords="offset points", xytext=(4, 3), fontsize=7, color=f"C{i}")
    ax.set_xlabel("share of the suite's domain in the training samples")
    ax.set_ylabel("tau (replayed greedy rounds, block size 7)")
    ax.set_title("benchmark tau against its domain's share of the training data")
    ax.grid(alpha=0.3)
    ax.legend()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def run(a, harness) -> dict:
    if a.walk_tokens <= 0:
        raise SystemExit(f"--walk-tokens must be > 0, got {a.walk_tokens}")
    store, manifest, by_tag = open_suites(a.data, a.limit)
    suites = sorted(by_tag)
    domains = parse_domains(a.domain, suites)
    suites = [s for s in suites if s in domains]
    samples = {t: [store.get(sid) for sid in by_tag[t]] for t in suites}
    target = resolve_target(manifest.get("target"))
    rows = []
    for spec in a.runs:
        label, sep, path = spec.partition("=")
        if not sep:
            raise SystemExit(f"expected LABEL=RUN_FOLDER, got {spec!r}")
        sources = training_sources(Path(path))
        total = sum(sources.values())
        model = load_drafter(Path(path) / "drafter", target, dtype=torch.float32)
        row = dict(label=label, run=path, train_samples=sources,
                   share={s: sum(n for t, n in sources.items() if t in domains[s]) / total for s in suites},
                   walk_tau={s: greedy_walk_tau(model, samples[s], a.walk_tokens)["tau"] for s in suites},
                   teacher_forced_tau={s: teacher_forced_tau(model, samples[s], a.blocks)["tau"] for s in suites})
        rows.append(row)
        print(f"{label:16s} " + "  ".join(f"{s} share {row['share'][s]:.2f} tau {row['walk_tau'][s]:.3f}"
                                           for s in suites), flush=True)
    harness.table(f"tau (replayed {a.walk_tokens} tokens) and domain share, {sum(map(len, samples.values()))} "
                  f"samples of {a.data}", ["run", "train samples"] + [f"{s} share" for s in suites]
                  + [f"{s} tau" for s in suites],
                  [[r["label"], sum(r["train_samples"].values())] + [f"{r['share'][s]:.2f}" for s in suites]
                   + [f"{r['walk_tau'][s]:.3f}" for s in suites] for r in rows])
    png = a.png or harness.out_dir / "domain_share.png"
    plot(rows, suites, png)
    print(f"wrote {png}")
    return dict(data=str(a.data), domains={s: sorted(domains[s]) for s in suites}, png=str(png), runs=rows)
