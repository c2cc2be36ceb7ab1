"""Offline evaluation: acceptance length τ, per-position acceptance, confidence calibration and speed, for one or
more drafters and the no-speculation baseline, measured side by side in one run (docs/dspark.md §6, §9).

Every prompt is run by every system in turn (baselines, vLLM's plain decoding, drafter A, drafter B, ...; the order
reversed on every other prompt) as a single stream, so machine noise hits all systems alike; wall times are summed
per system and speed is reported as a ratio to the FASTEST no-speculation system (this engine's fp32 and bf16
target, and vLLM's).  At temperature 0 every speculative
output must equal the baseline's token for token; mismatches are counted in results.json (they should be 0).
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pipeline.core.config_fields import target_field, temperature_field, top_k_field, top_p_field
from pipeline.dspark.calibration import calibration_report
from pipeline.dspark.checkpoint import load_drafter
from pipeline.engine.engine import SpecConfig, SpeculativeEngine
from pipeline.data.prompts import DEFAULT_PROMPTS, chat_prompt_ids, read_prompt_files
from pipeline.core.runtime import cpu_has_native_bf16, resolve_device, torch_threads
from pipeline.ops import bf16_linear
from pipeline.ops.packed_linear import use_bf16_kernel
from pipeline.ops.sampling import SamplingParams
from pipeline.engine.scheduler import SCHEDULERS
from pipeline.engine.cost_table import CostTable
from pipeline.data.shards import atomic_write_json
from pipeline.eval.sts_rollouts import full_length_rounds, heldout_rows
from pipeline.data.subsets import source_of, subsample
from pipeline.data.target_model import resolve_target
from pipeline.engine.target_runner import LINEAR_BACKENDS, TargetRunner


@dataclass
class EvalConfig:
    drafter: list[str] = field(default_factory=list, metadata={
        "help": "drafter checkpoint folder(s), optionally labelled: --drafter dspark=work/train/dspark/drafter "
                "--drafter dflash=work/train/dflash/drafter"})
    benchmarks: list[Path] = field(default_factory=list, metadata={
        "help": "benchmark JSONL files ({\"turns\": [...]}, first turn used); default: the shipped prompt set"})
    heldout_of: Path | None = field(default=None, metadata={
        "help": "a training run folder (jobs.train --out): also evaluate on its HELD-OUT prompts, one suite per "
                "training prompt file (heldout-<file>): same distribution as the training data, never trained on, "
                "so τ there vs on the benchmarks separates over-fitting from domain shift"})
    responses: Path | None = field(default=None, metadata={
        "help": "responses folder holding those held-out prompts (default: the one the run's hidden states were "
                "extracted from)"})
    out: Path = field(default=Path("work/eval"), metadata={"help": "output folder (results.json + PNGs)"})
    target: str | None = target_field()
    limit: int = field(default=20, metadata={"help": "prompts per benchmark (shuffled with seed 980406 if fewer "
                                                     "than the file has)"})
    max_new_tokens: int = field(default=256, metadata={"help": "generation cap per prompt"})
    temperature: float = temperature_field("for target and drafter")
    top_p: float = top_p_field("for target and drafter")
    top_k: int = top_k_field("for target and drafter")
    seed: int = field(default=0, metadata={"help": "sampling seed (each prompt gets seed + index)"})
    scheduler: str = field(default="fixed", metadata={
        "help": "verification depth: fixed (= --num-speculative-tokens), threshold (static θ), hardware (Algorithm 1), async",
        "choices": list(SCHEDULERS)})
    also_schedulers: list[str] = field(default_factory=list, metadata={
        "help": "run each drafter WITH a confidence head again under these schedulers (system label@scheduler), "
                "e.g. --scheduler fixed --also-schedulers hardware compares fixed depth with Algorithm 1"})
    num_speculative_tokens: int | None = field(default=None, metadata={
        "help": "the verification depth cap (default: the drafter's block size)", "aliases": ["--depth"]})
    threshold: float = field(default=0.5, metadata={"help": "θ for --scheduler threshold"})
    cost_table: Path | None = field(default=None, metadata={"help": "SPS(B) JSON for hardware/async (default: "
                                                                    "profiled now)"})
    spec_dtype: str = field(default="float32", metadata={"help": "target precision for speculative verification "
                                                                  "(acceptance always uses fp32 probabilities)",
                                                          "choices": ["bfloat16", "bfloat16:packed",
                                                                      "bfloat16:invariant", "float32",
                                                                      *(f"float32:{b}" for b in LINEAR_BACKENDS
                                                                        if b != "invariant")]})
    drafter_dtype: str = field(default="auto", metadata={
        "help": "drafter precision: auto = bfloat16 when --spec-dtype is bfloat16 and the device computes bf16 "
                "natively (a GPU, or a CPU with avx512_bf16 / AMX: packed bf16 weights); with bfloat16:invariant, "
                "float32 with its linear layers on the target's bf16-weight kernel; else float32.  Only the "
                "proposals depend on it; acceptance uses the fp32 probabilities the drafts were sampled from",
        "choices": ["auto", "float32", "bfloat16"]})
    baseline_dtypes: list[str] = field(default_factory=lambda: ["float32", "float32:packed", "float32:mkl",
                                                                "bfloat16"], metadata={
        "help": "target precisions of the no-speculation baseline (the fastest is the reference); on CPU float32 "
                "= automatic (float32:smallm - the AVX2 small-M kernel up to 24 rows, oneDNN pre-packed weights "
                "above - where that kernel wins at 1 and 8 rows, else float32:hybrid - F.linear for 1-2 rows - "
                "where MKL wins at 1 row, else float32:packed), float32:smallm / float32:hybrid / float32:packed "
                "force one, float32:mkl MKL's F.linear, bfloat16:packed bf16 weights packed (CPUs with native "
                "bf16)"})
    vllm_baselines: list[str] = field(default_factory=lambda: ["float32", "bfloat16"], metadata={
        "help": "precisions of vLLM's own plain decoding of the target, run as further no-speculation systems on "
                "the same prompts (the fastest of ours and vLLM's is the reference of every speed ratio); "
                "'none' = leave vLLM out"})
    threads: int | None = field(default=None, metadata={"help": "torch threads (default: all cores)"})
    device: str = field(default="auto", metadata={"help": "device of target and drafters: auto (cuda if present), "
                                                          "cpu, cuda"})
    no_bias_cache: list[str] = field(default_factory=list, metadata={
        "help": "drafter labels (--drafter LABEL=DIR) that compute the vanilla Markov head's step bias every step "
                "instead of reading it from the head's per-token cache, e.g. --drafter dspark=D --drafter "
                "dspark_nocache=D --no-bias-cache dspark_nocache: the cache's effect side by side"})

    def __post_init__(self):  # a clear error naming the flag (parse_config turns it into a usage error)
        vllm_baseline_dtypes(self.vllm_baselines)


def parse_drafters(specs: list[str]) -> list[tuple[str, Path]]:
    out = []
    for s in specs:
        label, _, path = s.partition("=") if "=" in s else ("", "", s)
        path = Path(path)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"--drafter {s}: no drafter checkpoint at {path} (config.json missing)")
        out.append((label or path.name if path.name != "drafter" else (label or path.parent.name), path))
    labels = [l for l, _ in out]
    if len(set(labels)) != len(labels):
        raise ValueError(f"drafter labels must be unique, got {labels}; use label=path")
    return out


def load_benchmark(path: Path, tokenizer, limit: int) -> list[dict]:
    rows, skips = read_prompt_files([path])
    for s in skips:
        print(f"[evaluate] skipped {s.request_id}: {s.reason}")
    return [{"id": r.request_id, "prompt_ids": chat_prompt_ids(tokenizer, r.text)} for r in subsample(rows, limit)]


def load_heldout_suites(train_dir: Path, responses: Path | None, limit: int) -> list[tuple[str, list[dict]]]:
    """A training run's held-out prompts as evaluation suites, one per source prompt file (request ids are
    "<file tag>:<line>"), each subsampled like a benchmark file: [("heldout-<tag>", [{id, prompt_ids}])]."""
    by_tag: dict[str, list[dict]] = {}
    for rid, ids in heldout_rows(train_dir, responses):
        by_tag.setdefault(source_of(rid), []).append({"id": rid, "prompt_ids": ids})
    return [(f"heldout-{tag}", subsample(rows, limit)) for tag, rows in sorted(by_tag.items())]


def summarize(records: list[dict], cap: int) -> dict:
    """records: one per (prompt, system): stats dict, rounds (list of {L, m, conf}), tokens, seconds; cap: the
    system's num_speculative_tokens (0: no speculation)."""
    rounds = sum(r["stats"]["rounds"] for r in records)
    emitted = sum(r["stats"]["emitted"] for r in records)
    verified = sum(r["stats"]["verified"] for r in records)
    accepted = sum(r["stats"]["accepted"] for r in records)
    tokens = sum(r["tokens"] for r in records)
    secs = sum(r["seconds"] for r in records)
    out = dict(prompts=len(records), generated_tokens=tokens, wall_seconds=secs,
               tokens_per_s=tokens / secs if secs else 0.0, rounds=rounds)
    if cap:
        v_at = [sum(r["stats"]["verified_at"][k] for r in records) for k in range(cap)]
        a_at = [sum(r["stats"]["accepted_at"][k] for r in records) for k in range(cap)]
        cum = [a / v if v else None for a, v in zip(a_at, v_at)]
        cond = [cum[0]] + [(cum[k] / cum[k - 1]) if cum[k] is not None and cum[k - 1] else None
                           for k in range(1, cap)]
        out.update(tau=emitted / rounds if rounds else 0.0, mean_verified_depth=verified / rounds if rounds else 0.0,
                   verify_rate=(accepted + rounds) / (verified + rounds) if rounds else 0.0,
                   cumulative_acceptance=cum, conditional_acceptance=cond)
        out.update(confidence_metrics(records, cap))
    return out


def confidence_metrics(records: list[dict], cap: int) -> dict:
    z, y = full_length_rounds([rd for r in records for rd in r["rounds"]], cap)
    if len(z) < 2:
        return {}
    rep = calibration_report(torch.tensor(z), torch.tensor(y))
    return dict(confidence_rounds=len(z), confidence_ece=rep.ece, confidence_auc=rep.auroc,
                confidence_brier=rep.brier)


VLLM_BASELINE_DTYPES = ("float32", "bfloat16")


def vllm_baseline_dtypes(specs: list[str]) -> list[str]:
    """The --vllm-baselines precisions (evaluation and load test), de-duplicated; [] for 'none'."""
    dts = [d for d in specs if d != "none"]
    bad = [d for d in dts if d not in VLLM_BASELINE_DTYPES]
    if bad or (dts and len(dts) != len(specs)):
        raise ValueError(f"--vllm-baselines: {specs} - give precisions from "
                         f"{list(VLLM_BASELINE_DTYPES)}, or 'none' alone")
    return list(dict.fromkeys(dts))


def drafter_schedulers(cfg: EvalConfig, has_conf: bool) -> list[str]:
    """The schedulers a drafter runs under: --scheduler, then --also-schedulers; a drafter without a confidence head
    (DFlash) can only be verified at fixed depth."""
    scheds = [cfg.scheduler if has_conf or cfg.scheduler == "fixed" else "fixed"]
    return list(dict.fromkeys(scheds + [s for s in cfg.also_schedulers if has_conf]))


def resolve_drafter_dtype(choice: str, spec_dtype: str, device: str) -> torch.dtype:
    """--drafter-dtype -> the drafter's torch dtype ("auto": bf16 with a bf16 verification target on a device with
    native bf16, else fp32)."""
    if choice == "float32":
        return torch.float32
    if choice == "bfloat16":
        return torch.bfloat16
    if choice != "auto":
        raise ValueError(f"--drafter-dtype must be auto, float32 or bfloat16, got {choice!r}")
    if spec_dtype.endswith(":invariant"):  # bf16 weights, fp32 residual stream: an fp32 drafter
        return torch.float32
    native = device.startswith("cuda") or cpu_has_native_bf16()
    return torch.bfloat16 if spec_dtype.split(":")[0] in ("bfloat16", "bf16") and native else torch.float32


def drafter_bf16_linears(choice: str, spec_dtype: str, device: str) -> bool:
    """--drafter-dtype auto with a ``bfloat16:invariant`` target on a CPU: the fp32 drafter's linear layers run
    through the target's bf16-weight kernel (pipeline/ops/packed_linear.py ``use_bf16_kernel``), where it loads."""
    return choice == "auto" and spec_dtype.endswith(":invariant") and device == "cpu" and bf16_linear.available()


def in_drafter_precision(drafter, choice: str, spec_dtype: str, device: str = "cpu"):
    """``drafter`` cast to the precision --drafter-dtype ``choice`` gives it beside a ``spec_dtype`` target (its
    linears on the bf16 kernel where ``drafter_bf16_linears``)."""
    drafter = drafter.to(resolve_drafter_dtype(choice, spec_dtype, device))
    if drafter_bf16_linears(choice, spec_dtype, device):
        use_bf16_kernel(drafter)
    return drafter


def load_drafter_for(path, target: str, choice: str, spec_dtype: str, device: str = "cpu"):
    """The drafter at ``path`` in the precision --drafter-dtype ``choice`` gives it beside a ``spec_dtype`` target."""
    d = load_drafter(path, target, dtype=resolve_drafter_dtype(choice, spec_dtype, device), device=device)
    return in_drafter_precision(d, choice, spec_dtype, device)


def drafter_precision_name(choice: str, spec_dtype: str, device: str) -> str:
    """How the drafter computes, for reports: ``float32``, ``bfloat16`` or ``float32, bf16 linears``."""
    name = str(resolve_drafter_dtype(choice, spec_dtype, device)).removeprefix("torch.")
    return f"{name}, bf16 linears" if drafter_bf16_linears(choice, spec_dtype, device) else name


def planned_systems(cfg: EvalConfig, drafters: list[tuple[str, bool]]) -> list[str]:
    """The names of the systems `run_evaluation` will run for `drafters` ([(label, has a confidence head)]), in its
    order: this engine's baselines, vLLM's plain decoding, then each drafter under its schedulers."""
    names = [f"baseline-{dt}" for dt in dict.fromkeys(list(cfg.baseline_dtypes) + ([cfg.spec_dtype] if drafters
                                                                                    else []))]
    names += [f"vllm-{dt}" for dt in vllm_baseline_dtypes(cfg.vllm_baselines)]
    for label, has_conf in drafters:
        names += [label if i == 0 else f"{label}@{sch}" for i, sch in enumerate(drafter_schedulers(cfg, has_conf))]
    return names


def single_stream_tok_s(target, dtype: str, prompt_ids: list[int], tokens: int, device=None) -> float:
    """This engine's plain greedy decoding of `tokens` tokens (EOS ignored) after `prompt_ids`, one stream, in
    `dtype`: output tokens per second of the second of two runs (the first warms the caches up)."""
    eng = SpeculativeEngine(TargetRunner.from_pretrained(target, dtype, device=device), None, SpecConfig())
    rate = 0.0
    for _ in range(2):
        t0 = time.perf_counter()
        out = eng.generate([prompt_ids], SamplingParams(temperature=0.0), max_tokens=tokens, ignore_eos=True)[0]
        rate = len(out.output_ids) / (time.perf_counter() - t0)
    return rate


def run_evaluation(cfg: EvalConfig, plain_decoder=None) -> dict:
    """``plain_decoder(target, dtype, max_model_len)`` builds vLLM's plain decoding for --vllm-baselines
    (``actors.vllm_baseline.VLLMPlainDecoding``, passed in by jobs.evaluate: pipeline does not import actors)."""
    from tqdm import tqdm
    from transformers import AutoTokenizer

    if cfg.responses and not cfg.heldout_of:
        raise ValueError("--responses only applies with --heldout-of (whose held-out prompts it holds)")
    vllm_dtypes = vllm_baseline_dtypes(cfg.vllm_baselines)
    if vllm_dtypes and plain_decoder is None:
        raise ValueError("--vllm-baselines needs vLLM's plain decoding (jobs.evaluate passes it); give 'none'")
    torch_threads(cfg.threads)
    target = resolve_target(cfg.target)
    tok = AutoTokenizer.from_pretrained(str(target))
    drafters = parse_drafters(cfg.drafter)
    benches = cfg.benchmarks or ([] if cfg.heldout_of else [DEFAULT_PROMPTS])
    suites = [(Path(b).stem, load_benchmark(Path(b), tok, cfg.limit)) for b in benches]
    if cfg.heldout_of:
        suites += load_heldout_suites(cfg.heldout_of, cfg.responses, cfg.limit)
    if len({name for name, _ in suites}) != len(suites):
        raise ValueError(f"benchmark names must be unique, got {[name for name, _ in suites]}")
    device = resolve_device(cfg.device)
    runners = TargetRunner.several_from_pretrained(
        target, sorted(set(cfg.baseline_dtypes) | ({cfg.spec_dtype} if drafters else set())), device=device)
    for sch in cfg.also_schedulers:
        if sch not in SCHEDULERS:
            raise ValueError(f"--also-schedulers: unknown scheduler {sch!r}")
    cost = None
    if {cfg.scheduler, *cfg.also_schedulers} & {"hardware", "async"}:
        cost = CostTable.load(cfg.cost_table) if cfg.cost_table else CostTable.profile(runners[cfg.spec_dtype])
    base_dtypes = list(dict.fromkeys(list(cfg.baseline_dtypes) + ([cfg.spec_dtype] if drafters else [])))
    systems = [(f"baseline-{dt}", SpeculativeEngine(runners[dt], None, SpecConfig(), tokenizer=tok), 0)
               for dt in base_dtypes]
    longest = max((len(p["prompt_ids"]) for _, prompts in suites for p in prompts), default=0)
    systems += [(f"vllm-{dt}", plain_decoder(target, dt, longest + cfg.max_new_tokens), 0) for dt in vllm_dtypes]
    ref_name = f"baseline-{cfg.spec_dtype}"  # lossless = same tokens as the target in the SAME precision
    scheduler_of = {}
    loaded = {}
    labels = [label for label, _ in drafters]
    unknown = [x for x in cfg.no_bias_cache if x not in labels]
    if unknown:
        raise ValueError(f"--no-bias-cache: {', '.join(unknown)} is not a --drafter label ({', '.join(labels)})")
    for label, path in drafters:
        d = loaded[label] = load_drafter_for(path, str(target), cfg.drafter_dtype, cfg.spec_dtype, device)
        if label in cfg.no_bias_cache:
            d.markov_head.bias_cache = None
        for i, sch in enumerate(drafter_schedulers(cfg, bool(d.cfg.enable_confidence_head))):
            spec = SpecConfig(method=d.cfg.kind, num_speculative_tokens=cfg.num_speculative_tokens, scheduler=sch,
                              confidence_threshold=cfg.threshold, cost_table=cost, seed=cfg.seed,
                              draft_sample_method="greedy" if cfg.temperature == 0 else "probabilistic")
            eng = SpeculativeEngine(runners[cfg.spec_dtype], d, spec, tokenizer=tok)
            eng.record_rounds = True
            name = label if i == 0 else f"{label}@{sch}"
            scheduler_of[name] = sch
            systems.append((name, eng, eng.num_speculative_tokens))
    results = {"config": json.loads(json.dumps(cfg.__dict__, default=str)),
               "target": str(target), "systems": [s[0] for s in systems], "scheduler_of": scheduler_of,
               "drafter_dtype": drafter_precision_name(cfg.drafter_dtype, cfg.spec_dtype, device),
               "benchmarks": {}}
    all_records = {name: [] for name, _, _ in systems}
    mismatches = {name: 0 for name, _, _ in systems}
    for suite, prompts in suites:
        recs = {name: [] for name, _, _ in systems}
        for i, p in enumerate(tqdm(prompts, desc=f"evaluate {suite}", dynamic_ncols=True)):
            params = SamplingParams(temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
                                    seed=cfg.seed + i)
            outs = {}
            # alternate the order prompt by prompt (A B C, C B A, ...): no system always runs first or last
            for name, eng, cap in (systems if i % 2 == 0 else systems[::-1]):
                if cap:
                    eng.round_log = []
                t0 = time.perf_counter()
                out = eng.generate([p["prompt_ids"]], params, max_tokens=cfg.max_new_tokens)[0]
                dt = time.perf_counter() - t0
                rec = dict(id=p["id"], stats=out.stats.to_dict(), tokens=len(out.output_ids), seconds=dt,
                           rounds=list(eng.round_log) if cap else [])
                recs[name].append(rec)
                outs[name] = out.output_ids
            if cfg.temperature == 0 and ref_name in outs:
                for name, _, cap in systems:
                    if cap and outs[name] != outs[ref_name]:
                        mismatches[name] += 1
        results["benchmarks"][suite] = {name: summarize(recs[name], g) for name, _, g in systems}
        for name in recs:
            all_records[name] += recs[name]
    overall = {name: summarize(all_records[name], g) for name, _, g in systems}
    base = max((overall[n]["tokens_per_s"], n) for n, _, g in systems if not g)
    for name, _, g in systems:
        overall[name]["speedup_vs_fastest_baseline"] = overall[name]["tokens_per_s"] / base[0] if base[0] else None
        overall[name]["greedy_mismatches_vs_baseline"] = mismatches[name] if cfg.temperature == 0 and g else None
    results["overall"] = overall
    results["fastest_baseline"] = base[1]
    # the vanilla Markov head's step-bias cache over the whole run (pipeline.dspark.markov_head.BiasCache)
    results["bias_cache"] = {label: {"hits": c.hits, "misses": c.misses,
                                     "hit_rate": c.hits / max(1, c.hits + c.misses)}
                             for label, d in loaded.items()
                             if (c := getattr(d.markov_head, "bias_cache", None)) is not None}
    cfg.out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(cfg.out / "results.json", results)
    plot_acceptance(results, cfg.out / "acceptance_by_position.png")
    plot_reliability(all_records, [(n, g) for n, _, g in systems if g], cfg.out / "reliability.png")
    return results


def plot_acceptance(results: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    benches = list(results["benchmarks"])
    fig, axes = plt.subplots(1, len(benches) + 1, figsize=(4 * (len(benches) + 1), 3.3), squeeze=False)
    for ax, (title, block) in zip(axes[0], [(b, results["benchmarks"][b]) for b in benches]
                                  + [("overall", results["overall"])]):
        for name, s in block.items():
            cond = s.get("conditional_acceptance")
            if cond:
                ax.plot(range(1, len(cond) + 1), [c if c is not None else float("nan") for c in cond], marker="o",
                        label=f"{name} (τ={s['tau']:.2f})")
        ax.set_title(title)
        ax.set_xlabel("draft position k")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylabel("P(accept k | 1..k-1 accepted)")
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def plot_reliability(records: dict, systems: list[tuple[str, int]], png: Path, n_bins: int = 10) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(4.5, 4.2))
    ax.plot([0, 1], [0, 1], "k--", lw=0.8)
    for name, cap in systems:
        logits, labels = full_length_rounds([rd for r in records[name] for rd in r["rounds"]], cap)
        if not logits:
            continue
        z = torch.sigmoid(torch.tensor(logits)).cumprod(-1).flatten()  # prefix survival a_k
        y = torch.tensor(labels).flatten()
        bins = torch.clamp((z * n_bins).long(), max=n_bins - 1)
        xs, ys = [], []
        for b in range(n_bins):
            sel = bins == b
            if sel.sum() >= 5:
                xs.append(float(z[sel].mean()))
                ys.append(float(y[sel].mean()))
        ax.plot(xs, ys, marker="o", label=name)
    ax.set_xlabel("predicted prefix survival a_k")
    ax.set_ylabel("observed acceptance of prefix")
    ax.set_title("confidence reliability")
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)
    else:  # e.g. --scheduler hardware: rounds verified fewer than the cap's drafts, so no round shows every prefix
        ax.text(0.5, 0.5, "no full-depth rounds to score\n(run with --scheduler fixed)", ha="center", va="center",
                transform=ax.transAxes)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
