"""The recipe: prompts -> responses -> hidden states -> a DSpark AND a DFlash drafter (equal data, equal steps) ->
STS calibration -> evaluation, in one command, inside a wall-clock budget.

    python -m jobs.recipe --budget-hours 2.5 --out work/recipe \\
        --prompts corpus/gsm8k_train.jsonl:3000 corpus/thealgorithms_py_doctest.jsonl:800 ... \\
        --benchmarks eval/gsm8k.jsonl eval/humaneval.jsonl eval/mt-bench.jsonl

The budget is split over the stages by fixed fractions (--split-*).  Stage 1 first answers a small probe of every
source, measures responses per second, then grows every source's share to what fits, in rounds that each measure
their own rate, until less than one batch more fits (a source's prompts are a seeded shuffle cut to its share, so
growing keeps every answered request id and resumes).  Training runs a short probe to measure seconds per step,
then trains both drafters for the same number of steps in its share of the budget, less what stages 1-2 overran
(down to half the share).  Every stage is the code of its own job (jobs.generate / extract / train / calibrate /
evaluate) and resumable: a rerun continues where the last one stopped and never redoes a finished stage.  Writes
<out>/recipe_results.json (stage times, data sizes, tau and speed per suite and system), <out>/learning_curves.png
and the evaluation's PNGs under <out>/eval."""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.config_fields import target_field, temperature_field
from pipeline.recipe import (BudgetSplit, mix_sizes, next_growth, parse_mix, responses_that_fit, steps_that_fit,
                             training_seconds, write_mix)
from pipeline.runtime import apply_env, run_job_main
from pipeline.shards import atomic_write_json


@dataclass
class RecipeConfig:
    out: Path = field(default=Path("work/recipe"), metadata={"help": "folder for every artifact of the run"})
    budget_hours: float = field(default=2.5, metadata={"help": "wall-clock budget of the whole run"})
    prompts: list[str] = field(default_factory=list, metadata={
        "help": "the training mix: PATH[:COUNT] per prompt file (COUNT = the most prompts taken from it, a seeded "
                "shuffle; no COUNT = all); default: the project's shipped prompt set"})
    benchmarks: list[Path] = field(default_factory=list, metadata={
        "help": "benchmark JSONL files evaluated besides the run's held-out prompts"})
    target: str | None = target_field()
    max_new_tokens: int = field(default=256, metadata={"help": "response length cap of the training data"})
    temperature: float = temperature_field("of the training responses")
    gen_batch: int = field(default=96, metadata={
        "help": "prompts per vLLM generate call in stage 1 (a 2-core CPU measured 96 at 1.47x the tok/s of 16, "
                "docs/results/data_stages.md)"})
    probe_prompts: int = field(default=32, metadata={"help": "prompts answered first to measure stage-1 speed"})
    eval_prompts: int = field(default=16, metadata={"help": "prompts per evaluation suite"})
    eval_tokens: int = field(default=128, metadata={"help": "tokens generated per evaluated prompt"})
    calib_prompts: int = field(default=24, metadata={"help": "held-out prompts rolled out for STS"})
    min_steps: int = field(default=10, metadata={"help": "fewest training steps per drafter, whatever the budget"})
    train_args: str = field(default="", metadata={
        "help": "extra jobs.train flags for both drafters, e.g. \"--num-anchors 32 --markov-w1 embedding\""})
    eval_args: str = field(default="", metadata={
        "help": "extra jobs.evaluate flags, e.g. \"--baseline-dtypes float32:packed bfloat16 --spec-dtype bfloat16\""})
    eval_heldout: bool = field(default=True, metadata={
        "help": "also evaluate on the run's held-out prompts, one suite per source file (costs one suite each)"})
    split_generate: float = field(default=0.40, metadata={"help": "budget fraction of stage 1"})
    split_extract: float = field(default=0.07, metadata={"help": "budget fraction of stage 2"})
    split_train: float = field(default=0.28, metadata={"help": "budget fraction of training (both drafters)"})
    split_calibrate: float = field(default=0.05, metadata={"help": "budget fraction of STS"})
    split_evaluate: float = field(default=0.20, metadata={"help": "budget fraction of the evaluation"})
    address: str | None = field(default=None, metadata={"help": "Ray address (default: a local ray.init())"})

    def __post_init__(self):  # clear errors naming the flag, before anything starts
        if not self.budget_hours > 0:
            raise ValueError(f"--budget-hours must be > 0, got {self.budget_hours}")
        for name in ("probe_prompts", "eval_prompts", "eval_tokens", "calib_prompts", "min_steps",
                     "max_new_tokens", "gen_batch"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        BudgetSplit(self.split_generate, self.split_extract, self.split_train, self.split_calibrate,
                    self.split_evaluate)


class RecipeState:
    """<out>/recipe_state.json: what the probes measured and the sizes derived from them, so a rerun keeps them."""

    def __init__(self, path: Path):
        self.path = path
        self.data = json.loads(path.read_text()) if path.is_file() else {}

    def get(self, key, default=None):
        return self.data.get(key, default)

    def set(self, **kv):
        self.data.update(kv)
        atomic_write_json(self.path, self.data)


def main(argv=None):
    apply_env()
    import shlex

    from actors.extraction import ExtractConfig, run_extraction
    from actors.generation import GenerateConfig, run_generation
    from jobs.calibrate import main as calibrate_main
    from jobs.evaluate import main as evaluate_main
    from jobs.train import main as train_main
    from pipeline.config_cli import parse_config
    from pipeline.prompts import DEFAULT_PROMPTS
    from pipeline.runtime import init_ray
    from pipeline.shards import ShardSet
    from pipeline.training import plot_learning_curves

    cfg = parse_config(RecipeConfig, argv, description=__doc__)
    mix = parse_mix(cfg.prompts or [str(DEFAULT_PROMPTS)])
    for b in cfg.benchmarks:
        if not Path(b).is_file():
            raise SystemExit(f"--benchmarks: file not found: {b}")
    out = cfg.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    state = RecipeState(out / "recipe_state.json")
    split = BudgetSplit(cfg.split_generate, cfg.split_extract, cfg.split_train, cfg.split_calibrate,
                        cfg.split_evaluate)
    budget = split.seconds(cfg.budget_hours * 3600)
    tgt = ["--target", cfg.target] if cfg.target else []
    init_ray(cfg.address)
    t_start = time.time()
    stage_seconds = dict(state.get("stage_seconds", {}))

    def run_stage(name, done, fn):
        if done:
            print(f"\n[recipe] {name}: complete, skipped", flush=True)
            return
        print(f"\n[recipe] {name}: budget {budget.get(name.split()[0], 0) / 60:.1f} min, "
              f"{(time.time() - t_start) / 60:.1f} min into this run", flush=True)
        t = time.time()
        fn()
        stage_seconds[name] = stage_seconds.get(name, 0.0) + time.time() - t
        state.set(stage_seconds=stage_seconds)
        print(f"[recipe] {name}: done in {(time.time() - t) / 60:.1f} min", flush=True)

    # --- stage 1: responses -------------------------------------------------------------------------------------
    resp, prompts_dir = out / "responses", out / "prompts"
    sizes = mix_sizes(mix)
    available = sum(sizes.values())

    def gen(fraction):
        files = write_mix(mix, prompts_dir, fraction)
        m = run_generation(GenerateConfig(prompts=files, out=resp, target=cfg.target, address=cfg.address,
                                          max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
                                          batch_size=cfg.gen_batch))
        if not m.get("complete"):
            raise SystemExit(f"[recipe] stage 1 left {m.get('missing')} requests unanswered; rerun to finish")
        return m

    def generate():
        t_stage = time.time()
        if state.get("mix_fraction") is None:
            probe = min(1.0, cfg.probe_prompts / available)
            t = time.time()
            m = gen(probe)
            probe_s = time.time() - t
            rows = m["num_rows"]
            want = responses_that_fit(budget["generate"] - probe_s, rows, probe_s, rows, available)
            state.set(probe_rows=rows, probe_seconds=probe_s, mix_fraction=min(1.0, want / available))
            print(f"[recipe] probe: {rows} responses in {probe_s:.0f} s -> {want} of {available} prompts fit")
        # rounds: each measures its own rate (the probe's errs low: a partial batch and the engine's start-up)
        # and grows the mix to what the rest of the budget fits
        have = len(ShardSet(resp, "request_id").done_ids())
        while True:
            t = time.time()
            m = gen(state.get("mix_fraction"))
            added, have, round_s = m["num_rows"] - have, m["num_rows"], time.time() - t
            remaining = budget["generate"] - (time.time() - t_stage)
            want = next_growth(remaining, added, round_s, have, available, cfg.gen_batch)
            if want is None:
                break
            state.set(mix_fraction=min(1.0, want / available))
            print(f"[recipe] stage 1 round: {added} responses in {round_s:.0f} s, "
                  f"{remaining / 60:.1f} min left -> {want} of {available} prompts fit")
        state.set(generate_done=True)

    run_stage("generate", state.get("generate_done") and ShardSet(resp, "request_id").has_manifest(), generate)

    # --- stage 2: hidden states (disk: the recipe must survive a restart) ---------------------------------------
    hidden = out / "hidden"
    run_stage("extract", (hidden / "manifest.json").is_file(),
              lambda: run_extraction(ExtractConfig(responses=resp, out=hidden, target=cfg.target,
                                                   address=cfg.address)))

    # --- training: probe the step time, then dspark and dflash with equal steps --------------------------------
    extra = shlex.split(cfg.train_args)

    def probe_train():
        probe_dir = out / "train_probe"
        t = time.time()
        train_main(["--data", str(hidden), "--out", str(probe_dir), "--max-steps", "6", "--log-every", "1",
                    "--eval-every", "1000000", "--checkpoint-every", "1000000", *extra, *tgt])
        rows = [json.loads(x) for x in (probe_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
        times = [r["time"] for r in rows if "time" in r]
        step_s = (times[-1] - times[1]) / (len(times) - 2) if len(times) >= 3 else (time.time() - t) / 6
        probe_s = time.time() - t
        train_s = training_seconds(budget["train"], sum(stage_seconds.values()), sum(budget.values()),
                                   budget["calibrate"] + budget["evaluate"])
        if train_s < budget["train"]:
            print(f"[recipe] stages 1-2 overran: training gets {train_s / 60:.1f} of its "
                  f"{budget['train'] / 60:.1f} min")
        steps = steps_that_fit(train_s - probe_s, step_s, drafters=2, minimum=cfg.min_steps)
        state.set(train_step_seconds=step_s, train_steps=steps)
        print(f"[recipe] training probe: {step_s:.2f} s/step -> {steps} steps per drafter")

    run_stage("train probe", state.get("train_steps") is not None, probe_train)
    steps = state.get("train_steps")
    drafters = {}
    for kind in ("dspark", "dflash"):
        run_dir = out / f"train_{kind}"
        drafters[kind] = run_dir / "drafter"
        resume = ["--resume"] if (run_dir / "ray").is_dir() and any((run_dir / "ray").rglob("checkpoint_*")) else []
        run_stage(f"train {kind}", (drafters[kind] / "config.json").is_file(),
                  lambda k=kind, d=run_dir, r=resume: train_main(
                      ["--data", str(hidden), "--out", str(d), "--drafter", k, "--max-steps", str(steps), *r,
                       *extra, *tgt]))

    # --- STS of the dspark drafter's confidence head ------------------------------------------------------------
    calib = drafters["dspark"] / "calibration" / "calibration.json"
    run_stage("calibrate", calib.is_file(),
              lambda: calibrate_main(["--drafter", str(drafters["dspark"]), "--responses", str(resp), "--limit",
                                      str(cfg.calib_prompts), "--max-new-tokens", str(cfg.eval_tokens), *tgt]))

    # --- evaluation: both drafters, the run's held-out prompts and the benchmarks ------------------------------
    ev = out / "eval"
    run_stage("evaluate", (ev / "results.json").is_file(),
              lambda: evaluate_main(["--drafter", f"dspark={drafters['dspark']}", "--drafter",
                                     f"dflash={drafters['dflash']}",
                                     *(["--heldout-of", str(out / "train_dspark")] if cfg.eval_heldout else []),
                                     *(["--benchmarks", *map(str, cfg.benchmarks)] if cfg.benchmarks else []),
                                     "--limit", str(cfg.eval_prompts), "--max-new-tokens", str(cfg.eval_tokens),
                                     "--scheduler", "fixed", "--also-schedulers", "hardware", "--out", str(ev),
                                     *shlex.split(cfg.eval_args), *tgt]))

    # --- results ------------------------------------------------------------------------------------------------
    plot_learning_curves({k: out / f"train_{k}" / "metrics.jsonl" for k in drafters}, out / "learning_curves.png",
                         title="held-out tau vs supervised positions (recipe)")
    ev_res = json.loads((ev / "results.json").read_text())
    suites = {name: {sys: {k: s.get(k) for k in ("tau", "tokens_per_s", "prompts", "generated_tokens")}
                     for sys, s in block.items()} for name, block in ev_res["benchmarks"].items()}
    overall = {sys: {k: s.get(k) for k in ("tau", "tokens_per_s", "speedup_vs_fastest_baseline",
                                           "greedy_mismatches_vs_baseline", "mean_verified_depth")}
               for sys, s in ev_res["overall"].items()}
    results = dict(budget_hours=cfg.budget_hours, budget_seconds=budget, stage_seconds=stage_seconds,
                   mix={e.stem: sizes[e.stem] for e in mix}, mix_fraction=state.get("mix_fraction"),
                   responses=len(ShardSet(resp, "request_id").done_ids()), train_steps=steps,
                   train_step_seconds=state.get("train_step_seconds"),
                   fastest_baseline=ev_res["fastest_baseline"], suites=suites, overall=overall,
                   pngs=[str(p.relative_to(out)) for p in sorted(out.glob("*.png")) + sorted(ev.glob("*.png"))])
    atomic_write_json(out / "recipe_results.json", results)
    print(f"\n{'suite':<28} {'dspark tau':>10} {'dflash tau':>10} {'ratio':>6}")
    for name, block in suites.items():
        a, b = block.get("dspark", {}).get("tau"), block.get("dflash", {}).get("tau")
        if a and b:
            print(f"{name:<28} {a:10.3f} {b:10.3f} {a / b:6.2f}")
    for sys, s in overall.items():
        print(f"{sys:<28} tok/s {s['tokens_per_s']:7.1f}  speedup vs {ev_res['fastest_baseline']}: "
              f"{s['speedup_vs_fastest_baseline']:.2f}x")
    total = sum(stage_seconds.values())
    print(f"\n[recipe] stages took {total / 3600:.2f} h of the {cfg.budget_hours:.2f} h budget; "
          f"results: {out / 'recipe_results.json'}")
    return results


if __name__ == "__main__":
    run_job_main(main)
