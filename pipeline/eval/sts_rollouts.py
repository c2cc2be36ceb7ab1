"""Sequential Temperature Scaling of the confidence head (docs/dspark.md §4), on rounds rolled out by the real engine.

1. Roll out speculative decoding on HELD-OUT prompts (the training plan's hold-out split) with the drafter's RAW
   confidences and fixed full-length verification (depth γ, no truncation): each round gives logits z_{n,1..γ} and
   the prefix labels y_{n,k} = 1 iff drafts 1..k were all accepted (the engine's lossless verification).
2. For k = 1..γ in order, grid-search T_k minimising the ECE of Π_{i<k}σ(z_i/T_i)·σ(z_k/T_k) against y_k.
3. Write the temperatures into the checkpoint (our own config field; vLLM ignores it), report ECE / AUC / Brier per
   position before and after, and draw a reliability diagram.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pipeline.core.config_fields import target_field, temperature_field
from pipeline.dspark.calibration import apply_sts, calibration_report, fit_sts
from pipeline.dspark.checkpoint import EXTRA_KEY, load_drafter
from pipeline.engine.engine import SpecConfig, SpeculativeEngine
from pipeline.data.prompts import chat_prompt_ids, read_prompt_files
from pipeline.core.runtime import resolve_device, torch_threads
from pipeline.ops.sampling import SamplingParams
from pipeline.data.shards import MANIFEST, ShardSet, atomic_write_json
from pipeline.data.subsets import subsample
from pipeline.data.target_model import resolve_target
from pipeline.engine.target_runner import TargetRunner


@dataclass
class CalibrateConfig:
    drafter: Path = field(default=Path("work/train/dspark/drafter"), metadata={
        "help": "drafter checkpoint folder; its config gets the fitted temperatures"})
    train_dir: Path | None = field(default=None, metadata={
        "help": "training run folder whose plan.json names the held-out samples (default: the drafter's parent)"})
    responses: Path | None = field(default=None, metadata={
        "help": "stage-1 output holding their prompts (default: the folder the run's hidden states were extracted "
                "from, as their manifest records it)"})
    prompts: list[Path] = field(default_factory=list, metadata={
        "help": "use these prompt JSONL files instead of the held-out responses"})
    target: str | None = target_field()
    limit: int = field(default=64, metadata={"help": "held-out prompts to roll out"})
    max_new_tokens: int = field(default=128, metadata={"help": "tokens generated per prompt"})
    temperature: float = temperature_field("of the rollouts - use the one you serve with")
    batch: int = field(default=8, metadata={"help": "requests decoded together"})
    objective: str = field(default="ece", metadata={"help": "STS objective (paper: ece; brier is a proper score)",
                                                    "choices": ["ece", "brier"]})
    out: Path | None = field(default=None, metadata={"help": "report folder (default: <drafter>/calibration)"})
    dtype: str = field(default="bfloat16", metadata={"help": "target precision", "choices": ["bfloat16", "float32"]})
    seed: int = field(default=0, metadata={"help": "sampling seed"})
    device: str = field(default="auto", metadata={"help": "auto (cuda if present), cpu, cuda"})


def heldout_prompts(cfg: CalibrateConfig) -> list[list[int]]:
    if cfg.prompts:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(resolve_target(cfg.target)))
        rows, _ = read_prompt_files(cfg.prompts, cfg.limit)
        return [chat_prompt_ids(tok, r.text) for r in rows]
    rows = heldout_rows(cfg.train_dir or Path(cfg.drafter).parent, cfg.responses)
    return [ids for _, ids in subsample(rows, cfg.limit)]  # seeded: not the store's first ones


def heldout_rows(train_dir: Path, responses: Path | None = None) -> list[tuple[str, list[int]]]:
    """(request_id, prompt_ids) of a training run's held-out samples (plan.json's hold-out split: prompts the
    drafter never trained on, from the training prompts' own distribution), in the responses store's order.
    ``responses`` defaults to the store that the run's hidden states were extracted from (their manifest says)."""
    train_dir = Path(train_dir)
    if not (train_dir / "plan.json").is_file():
        raise FileNotFoundError(f"{train_dir}: not a training run folder (plan.json missing)")
    plan = json.loads((train_dir / "plan.json").read_text())
    hold = set(plan.get("holdout_ids") or [])
    if not hold:
        raise ValueError(f"{train_dir}/plan.json has no held-out samples (train with --holdout-frac > 0)")
    if responses is None:
        data = (plan.get("config") or {}).get("data")
        manifest = Path(data) / MANIFEST if data else None
        found = json.loads(manifest.read_text()).get("responses") if manifest and manifest.is_file() else None
        if not found or not Path(found).is_dir():
            raise FileNotFoundError(f"{train_dir}: cannot tell which responses folder its data came from "
                                    f"(hidden-state manifest {manifest} names {found!r}); pass --responses")
        responses = Path(found)
    if not Path(responses).is_dir():
        raise FileNotFoundError(f"--responses {responses}: no such folder")
    store = ShardSet(responses, "request_id")
    if not store.shard_paths():
        raise FileNotFoundError(f"--responses {responses}: no response shards there")
    rows = [(r["request_id"], list(r["prompt_ids"]))
            for r in store.iter_rows(["request_id", "prompt_ids"]) if r["request_id"] in hold]
    if not rows:
        raise ValueError(f"none of the {len(hold)} held-out samples of {train_dir} is in {responses}; "
                         f"is that the responses folder the run was trained from?")
    return rows


def full_length_rounds(rounds, num_speculative_tokens: int) -> tuple[list, list]:
    """Engine round records -> (confidence logits, prefix labels) of the rounds verified at full depth γ only
    (truncated rounds would bias the labels; docs/dspark.md §4).  Label k is 1 iff drafts 1..k were all accepted."""
    z, y = [], []
    for rd in rounds:
        if rd["conf"] is not None and rd["L"] == num_speculative_tokens:
            z.append(rd["conf"][:num_speculative_tokens])
            y.append([1.0 if k < rd["m"] else 0.0 for k in range(num_speculative_tokens)])
    return z, y


def rollout(engine, prompts: list[list[int]], params: SamplingParams, max_new_tokens: int, batch: int):
    """Full-length rounds -> (logits [N, γ], prefix labels [N, γ])."""
    cap = engine.num_speculative_tokens
    engine.record_rounds, engine.round_log = True, []
    for i in range(0, len(prompts), batch):
        engine.generate(prompts[i:i + batch], params, max_tokens=max_new_tokens)
    z, y = full_length_rounds(engine.round_log, cap)
    if len(z) < 10:
        raise RuntimeError(f"only {len(z)} full-length rounds collected; use more prompts or tokens")
    return torch.tensor(z, dtype=torch.float64), torch.tensor(y, dtype=torch.float64)


def set_sts_temperatures(drafter_dir: Path, temps: list[float] | None) -> None:
    """Rewrite the checkpoint's config.json atomically with the temperatures (our own field)."""
    p = Path(drafter_dir) / "config.json"
    conf = json.loads(p.read_text())
    conf.setdefault(EXTRA_KEY, {})["sts_temperatures"] = temps
    atomic_write_json(p, conf)


def run_calibration(cfg: CalibrateConfig) -> dict:
    from transformers import AutoTokenizer

    torch_threads()
    target = resolve_target(cfg.target)
    device = resolve_device(cfg.device)
    drafter = load_drafter(cfg.drafter, str(target), device=device)
    if not drafter.cfg.enable_confidence_head:
        raise ValueError(f"{cfg.drafter}: this drafter has no confidence head (a DFlash baseline?)")
    drafter.cfg.sts_temperatures = None  # roll out with RAW confidences
    runner = TargetRunner.from_pretrained(str(target), dtype=cfg.dtype, device=device)
    engine = SpeculativeEngine(runner, drafter, SpecConfig(method=drafter.cfg.kind, scheduler="fixed",
                                                           seed=cfg.seed),
                               tokenizer=AutoTokenizer.from_pretrained(str(target)))
    prompts = heldout_prompts(cfg)
    z, y = rollout(engine, prompts, SamplingParams(temperature=cfg.temperature, seed=cfg.seed),
                   cfg.max_new_tokens, cfg.batch)
    temps = fit_sts(z, y, objective=cfg.objective)
    before, after = calibration_report(z, y), calibration_report(z, y, temps)
    set_sts_temperatures(cfg.drafter, temps)
    out = Path(cfg.out or Path(cfg.drafter) / "calibration")
    out.mkdir(parents=True, exist_ok=True)
    report = dict(rounds=int(z.shape[0]), prompts=len(prompts), temperature=cfg.temperature, objective=cfg.objective,
                  sts_temperatures=temps, before=before.__dict__, after=after.__dict__,
                  prefix_acceptance=y.mean(0).tolist())
    atomic_write_json(out / "calibration.json", report)
    plot_reliability_before_after(z, y, temps, out / "reliability.png")
    return report


def plot_reliability_before_after(z, y, temps, png: Path, n_bins: int = 10) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    G = z.shape[1]
    fig, axes = plt.subplots(1, 2, figsize=(9, 4.2))
    for ax, (title, t) in zip(axes, [("raw", None), ("after STS", temps)]):
        a = torch.sigmoid(apply_sts(z, t)).cumprod(-1)
        ax.plot([0, 1], [0, 1], "k--", lw=0.8)
        for k in range(G):
            bins = torch.clamp((a[:, k] * n_bins).long(), max=n_bins - 1)
            xs, ys = [], []
            for b in range(n_bins):
                sel = bins == b
                if sel.sum() >= 5:
                    xs.append(float(a[sel, k].mean()))
                    ys.append(float(y[sel, k].mean()))
            ax.plot(xs, ys, marker=".", label=f"k={k + 1}")
        ax.set_title(f"prefix survival reliability ({title})")
        ax.set_xlabel("predicted a_k")
        ax.set_ylabel("observed")
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
