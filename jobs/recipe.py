"""The recipe: prompts -> responses -> hidden states -> a DSpark AND a DFlash drafter (equal data, equal steps) ->
STS calibration -> evaluation, in one command, inside a wall-clock budget.

    python -m jobs.recipe --budget-hours 2.5 --out work/recipe \\
        --prompts corpus/gsm8k_train.jsonl:3000 corpus/thealgorithms_py_doctest.jsonl:800 ... \\
        --benchmarks eval/gsm8k.jsonl eval/humaneval.jsonl eval/mt-bench.jsonl

The budget is split over the stages by fractions (--split-*), except that STS and the evaluation, whose sizes are
fixed (prompts x tokens x systems), first get what a single-stream decode rate measured at the start says they need.
Stages 1 and 2 share their two fractions and run in rounds: each round answers the mix's current share with vLLM,
stores the new responses' hidden states, measures what that cost (the engines' start-up and a cost per response),
and grows every source's share to what the rest of the two stages' budget fits, until less than one batch more fits
(the first round is a small probe; a source's prompts are a seeded shuffle cut to its share, so growing keeps every
answered request id and resumes).  Training runs a short probe of each drafter, logging as the full run logs, to
measure its seconds per step and its start-up, then trains both drafters for the same number of steps in its share
of the budget, plus what stages 1-2 left unused or less what they overran (down to half the share).  Every stage is
the code of its own job (jobs.generate / extract / train / calibrate / evaluate) and resumable: a rerun continues
where the last one stopped and never redoes a finished stage.
Writes <out>/recipe_results.json (stage times and their estimates, data sizes, tau and speed per suite and system),
<out>/learning_curves.png and the evaluation's PNGs under <out>/eval."""
from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.core.config_fields import target_field, temperature_field
from pipeline.launch.recipe import (BudgetSplit, decode_seconds, mix_sizes, next_growth, parse_mix, plan_budget,
                                    probe_step_seconds, steps_that_fit, training_seconds, write_mix)
from pipeline.core.runtime import apply_env, run_job_main
from pipeline.data.shards import atomic_write_json

DRAFTER_KINDS = ("dspark", "dflash")  # trained on equal data for equal steps; the probe times each of them


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

    from transformers import AutoTokenizer

    from actors.extraction import ExtractConfig, run_extraction
    from actors.generation import GenerateConfig, run_generation
    from jobs import calibrate as calibrate_job
    from jobs import evaluate as evaluate_job
    from jobs import train as train_job
    from pipeline.eval.sts_rollouts import CalibrateConfig
    from pipeline.core.config_cli import parse_config
    from pipeline.eval.evaluation import EvalConfig, planned_systems, single_stream_tok_s
    from pipeline.data.prompts import DEFAULT_PROMPTS, chat_prompt_ids, read_prompt_files
    from pipeline.core.runtime import init_ray, resolve_device
    from pipeline.data.shards import ShardSet
    from pipeline.data.target_model import resolve_target
    from pipeline.train.config import TrainConfig
    from pipeline.train.metrics import plot_learning_curves

    cfg = parse_config(RecipeConfig, argv, description=__doc__)
    mix = parse_mix(cfg.prompts or [str(DEFAULT_PROMPTS)])
    for b in cfg.benchmarks:
        if not Path(b).is_file():
            raise SystemExit(f"--benchmarks: file not found: {b}")
    # the evaluation's own flags, parsed now: its systems set what it costs, and a bad flag fails before anything runs
    eval_flags = ["--scheduler", "fixed", "--also-schedulers", "hardware", *shlex.split(cfg.eval_args)]
    eval_cfg = parse_config(EvalConfig, eval_flags, description="jobs.recipe --eval-args")
    eval_systems = planned_systems(eval_cfg, [("dspark", True), ("dflash", False)])
    n_suites = len(cfg.benchmarks) + (len(mix) if cfg.eval_heldout else 0) or 1
    out = cfg.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    state = RecipeState(out / "recipe_state.json")
    split = BudgetSplit(cfg.split_generate, cfg.split_extract, cfg.split_train, cfg.split_calibrate,
                        cfg.split_evaluate)
    if state.get("decode_tok_s") is None:  # measured once per run folder, so a rerun keeps the plan
        probe_text = read_prompt_files([cfg.benchmarks[0] if cfg.benchmarks else DEFAULT_PROMPTS])[0][0].text
        target = resolve_target(cfg.target)
        ids = chat_prompt_ids(AutoTokenizer.from_pretrained(str(target)), probe_text)
        state.set(decode_tok_s=single_stream_tok_s(target, eval_cfg.spec_dtype, ids, cfg.eval_tokens,
                                                   device=resolve_device(eval_cfg.device)))
    rate = state.get("decode_tok_s")
    eval_tokens = n_suites * cfg.eval_prompts * cfg.eval_tokens * len(eval_systems)
    needs = {"calibrate": decode_seconds(cfg.calib_prompts * cfg.eval_tokens, rate),
             "evaluate": decode_seconds(eval_tokens, rate)}
    try:
        budget = plan_budget(split, cfg.budget_hours * 3600, needs)
    except ValueError as e:
        raise SystemExit(f"[recipe] {e}") from None
    print(f"[recipe] single-stream decoding {rate:.1f} tok/s: the evaluation ({len(eval_systems)} systems x {n_suites} "
          f"suites x {cfg.eval_prompts} prompts x {cfg.eval_tokens} tokens) needs ~{needs['evaluate'] / 60:.0f} min, "
          f"STS ~{needs['calibrate'] / 60:.0f} min\n[recipe] budget (min): "
          + ", ".join(f"{k} {v / 60:.1f}" for k, v in budget.items()), flush=True)
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
        add_seconds(name, time.time() - t)
        print(f"[recipe] {name}: done in {(time.time() - t) / 60:.1f} min", flush=True)

    def add_seconds(name, seconds):
        stage_seconds[name] = stage_seconds.get(name, 0.0) + seconds
        state.set(stage_seconds=stage_seconds)

    # --- stages 1-2: responses and their hidden states, in rounds --------------------------------------------------
    resp, prompts_dir, hidden = out / "responses", out / "prompts", out / "hidden"
    sizes = mix_sizes(mix)
    available = sum(sizes.values())
    data_budget = budget["generate"] + budget["extract"]

    def generate(fraction):
        files = write_mix(mix, prompts_dir, fraction)
        m = run_generation(GenerateConfig(prompts=files, out=resp, target=cfg.target, address=cfg.address,
                                          max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
                                          batch_size=cfg.gen_batch))
        if not m.get("complete"):
            raise SystemExit(f"[recipe] stage 1 left {m.get('missing')} requests unanswered; rerun to finish")
        return m

    def extract():  # resumable: stores only the responses it has not stored yet, then rewrites the manifest
        return run_extraction(ExtractConfig(responses=resp, out=hidden, target=cfg.target, address=cfg.address))

    def grow_data():
        """Each round answers the mix's current share and stores its hidden states, measures what that cost (a
        fixed start-up and a cost per response, once two rounds differ in size: `round_cost`) and grows the share to
        what the rest of the two stages' budget fits; the first round is a probe of --probe-prompts."""
        if state.get("mix_fraction") is None:
            state.set(mix_fraction=min(1.0, cfg.probe_prompts / available))
        have = len(ShardSet(resp, "request_id").done_ids())
        while True:
            t = time.time()
            m = generate(state.get("mix_fraction"))
            add_seconds("generate", time.time() - t)
            t = time.time()
            extract()
            add_seconds("extract", time.time() - t)
            added, have = m["num_rows"] - have, m["num_rows"]
            spent = stage_seconds["generate"] + stage_seconds["extract"]
            round_s = spent - sum(s for _, s in state.get("data_rounds", []))
            state.set(data_rounds=[*state.get("data_rounds", []), [added, round_s]])
            remaining = data_budget - spent
            want = next_growth(remaining, state.get("data_rounds"), have, available, cfg.gen_batch)
            print(f"[recipe] stages 1-2, round {len(state.get('data_rounds'))}: {added} responses + hidden states "
                  f"in {round_s:.0f} s, {remaining / 60:.1f} min left -> "
                  + (f"{want} of {available} prompts fit" if want else f"done at {have} responses"), flush=True)
            if want is None:
                break
            state.set(mix_fraction=min(1.0, want / available))
        state.set(generate_done=True, extract_done=True)

    print(f"\n[recipe] stages 1-2: budget {data_budget / 60:.1f} min (generate + extract)", flush=True)
    if not (state.get("generate_done") and ShardSet(resp, "request_id").has_manifest()):
        grow_data()
    elif not (state.get("extract_done") or (hidden / "manifest.json").is_file()):
        t = time.time()
        extract()
        add_seconds("extract", time.time() - t)
    else:
        print("[recipe] stages 1-2: complete, skipped", flush=True)

    # --- training: probe the step time, then dspark and dflash with equal steps --------------------------------
    # --train-args: TrainConfig's own flags (the user's, in its command-line syntax), the rest set per run here
    base_train = parse_config(TrainConfig, ["--data", str(hidden), *shlex.split(cfg.train_args)],
                              description="jobs.recipe --train-args")

    def train_cfg(kind: str, out_dir: Path, **kw) -> TrainConfig:
        return dataclasses.replace(base_train, out=out_dir, drafter=kind, target=cfg.target or base_train.target,
                                   **kw)

    def probe_train():
        t = time.time()
        run = train_cfg(DRAFTER_KINDS[0], out / "train_probe")  # the full runs' logging and evaluation
        probe_steps, probe_eval = 4 * run.log_every, 2 * run.log_every  # rows at 1-4 x log_every, evaluations at 2, 4
        step_s, fixed_s = {}, 0.0
        for kind in DRAFTER_KINDS:  # each drafter's own step time: a dflash step is the cheaper one
            probe_dir, t_kind = out / f"train_probe_{kind}", time.time()
            train_job.run(train_cfg(kind, probe_dir, max_steps=probe_steps, eval_every=probe_eval,
                                    checkpoint_every=1_000_000))
            rows = [json.loads(x) for x in (probe_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
            step_s[kind] = probe_step_seconds([(r["step"], r["time"]) for r in rows if "time" in r],
                                              {probe_eval, probe_steps}, run.eval_every)
            # start-up, the last evaluation and the export: paid once per drafter, whatever its number of steps
            fixed_s += max(0.0, time.time() - t_kind - probe_steps * step_s[kind])
        probe_s = time.time() - t
        train_s = training_seconds(budget["train"], sum(stage_seconds.values()), sum(budget.values()),
                                   budget["calibrate"] + budget["evaluate"])
        if abs(train_s - budget["train"]) > 30:
            print(f"[recipe] stages 1-2 {'overran' if train_s < budget['train'] else 'left time unused'}: training "
                  f"gets {train_s / 60:.1f} min (planned {budget['train'] / 60:.1f})")
        steps = steps_that_fit(train_s - probe_s - fixed_s, list(step_s.values()), minimum=cfg.min_steps)
        state.set(train_step_seconds=step_s, train_fixed_seconds=fixed_s, train_steps=steps)
        print(f"[recipe] training probe: " + ", ".join(f"{k} {v:.2f} s/step" for k, v in step_s.items())
              + f" + {fixed_s:.0f} s start-up -> {steps} steps per drafter")

    run_stage("train probe", state.get("train_steps") is not None, probe_train)
    steps = state.get("train_steps")
    drafters = {}
    for kind in DRAFTER_KINDS:
        run_dir = out / f"train_{kind}"
        drafters[kind] = run_dir / "drafter"
        resume = (run_dir / "ray").is_dir() and any((run_dir / "ray").rglob("checkpoint_*"))
        run_stage(f"train {kind}", (drafters[kind] / "config.json").is_file(),
                  lambda k=kind, d=run_dir, r=resume: train_job.run(train_cfg(k, d, max_steps=steps, resume=r)))

    # --- STS of the dspark drafter's confidence head ------------------------------------------------------------
    calib = drafters["dspark"] / "calibration" / "calibration.json"
    run_stage("calibrate", calib.is_file(),
              lambda: calibrate_job.run(CalibrateConfig(drafter=drafters["dspark"], responses=resp,
                                                        limit=cfg.calib_prompts, max_new_tokens=cfg.eval_tokens,
                                                        target=cfg.target)))

    # --- evaluation: both drafters, the run's held-out prompts and the benchmarks ------------------------------
    ev = out / "eval"
    run_stage("evaluate", (ev / "results.json").is_file(),
              lambda: evaluate_job.run(dataclasses.replace(
                  eval_cfg, drafter=[f"dspark={drafters['dspark']}", f"dflash={drafters['dflash']}"],
                  heldout_of=out / "train_dspark" if cfg.eval_heldout else None,
                  benchmarks=[Path(b) for b in cfg.benchmarks], limit=cfg.eval_prompts,
                  max_new_tokens=cfg.eval_tokens, out=ev, target=cfg.target or eval_cfg.target)))

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
                   train_step_seconds=state.get("train_step_seconds"), decode_tok_s=rate,
                   estimated_seconds=needs, eval_systems=eval_systems,
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
