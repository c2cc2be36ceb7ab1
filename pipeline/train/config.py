"""The training configuration (``jobs.train``'s flags, one dataclass) and what follows from it alone: the drafter's
configuration, the learning-rate schedule, whether to autocast.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from pipeline.dspark.config import DrafterConfig
from pipeline.data.subsets import parse_mix


STATE_FILE = "train_state.pt"


LOCAL_CHECKPOINTS = "checkpoints"  # <out>/checkpoints/step_<n>/ of --backend local (Ray Train's live in <out>/ray)


BACKENDS = ("ray", "local")


@dataclass
class TrainConfig:
    data: Path = field(default=Path("work/hidden"), metadata={"help": "stage-2 disk store folder (--store disk)"})
    store: str = field(default="disk", metadata={"help": "hidden-state backend", "choices": ["disk", "mooncake"]})
    mooncake_master: str | None = field(default=None, metadata={"help": "Mooncake master host:port (--store mooncake)"})
    mooncake_metadata: str | None = field(default=None, metadata={"help": "Mooncake metadata server URL"})
    mooncake_prefix: str = field(default="dspark/hidden", metadata={"help": "key prefix of the data set in Mooncake"})
    out: Path = field(default=Path("work/train/dspark"), metadata={"help": "run folder (checkpoints, metrics, drafter)"})
    target: str | None = field(default=None, metadata={"help": "target HF folder (default: prepared SmolLM2-135M)"})
    drafter: str = field(default="dspark", metadata={"help": "dspark (Markov + confidence heads, 0.1CE+0.9L1+BCE) or "
                                                             "dflash (no heads, CE only)", "choices": ["dspark", "dflash"]})
    num_layers: int = field(default=1, metadata={
        "help": "draft layers (1-5; the paper uses 5 for 8B targets). For SmolLM2-135M on CPU one layer that sees "
                "more data beat 2 and 3 at equal training time, at 0.5 M and at 1.5 M supervised positions "
                "(docs/results/levers.md)"})
    block_size: int = field(default=7, metadata={"help": "draft tokens per block (γ)"})
    markov_rank: int = field(default=256, metadata={"help": "Markov head rank r (dspark)"})
    markov_head: str = field(default="vanilla", metadata={"help": "sequential head", "choices": ["vanilla", "gated", "rnn"]})
    markov_w1: str = field(default="table", metadata={
        "help": "(dspark) how the Markov head's W1 [V, r] is parameterised while training: 'table' (free per-token rows, the "
                "paper's) or 'embedding' (the target's frozen input embedding, RMS-normalised, times a shared [r, d] "
                "projection, plus a zero-initialised per-token table: tokens rare in the training data still get "
                "a latent). The exported checkpoint holds the folded table either way", "choices": ["table", "embedding"]})
    init_layers: str = field(default="random", metadata={
        "help": "how the drafter's decoder layers start: 'random' (normal, std 0.02) or 'target' (copies of the "
                "target's last --num-layers layers and its final norm; q/k norms at 1)",
        "choices": ["random", "target"]})
    draft_vocab_coverage: float = field(default=0.99, metadata={
        "help": "reduced draft vocabulary: the most frequent response tokens covering this fraction"})
    draft_vocab_size: int | None = field(default=None, metadata={
        "help": "explicit draft vocabulary size (overrides coverage); 0 = the full target vocabulary"})
    mix: list[str] = field(default_factory=list, metadata={
        "help": "train on part of the store: SOURCE[:COUNT] entries (SOURCE = a prompt file's stem, as in the sample "
                "ids), only those sources, at most COUNT training samples from each (a fixed seeded subset; a larger "
                "COUNT keeps the smaller one's samples); held-out samples come from the same sources. For data-mix "
                "studies on one store; default: every sample"})
    num_anchors: int = field(default=32, metadata={
        "help": "anchors (blocks) drawn per sequence per visit (the reference code: 512 on GPU). On CPU more visits "
                "with 32 beat 64 and 128 at equal training time (docs/results/levers.md)"})
    seqs_per_step: int = field(default=8, metadata={"help": "sequences per optimizer step per worker"})
    micro_batch: int = field(default=2, metadata={
        "help": "sequences per forward/backward (right-padded; 1 = no padding). Same loss and gradient either way"})
    epochs: float = field(default=1.0, metadata={"help": "passes over the training sequences"})
    max_steps: int | None = field(default=None, metadata={"help": "stop after this many steps (overrides epochs)"})
    lr: float = field(default=6e-4, metadata={"help": "peak learning rate (AdamW)"})
    warmup_frac: float = field(default=0.04, metadata={"help": "linear warmup fraction, then cosine to 0"})
    weight_decay: float = field(default=0.0, metadata={"help": "AdamW weight decay"})
    feature_noise: float = field(default=0.0, metadata={
        "help": "regularisation: add Gaussian noise to the injected target features while training, std = this "
                "times each layer's per-token RMS (0 = off; inference always sees exact features)"})
    grad_clip: float = field(default=1.0, metadata={"help": "gradient norm clip"})
    loss_decay: str = field(default="4.0", metadata={
        "help": "position-weight decay: a number (reference code: 4.0) or 'gamma' (the paper: block size)"})
    distance: str = field(default="l1", metadata={"help": "distribution loss: l1 (reference) or tv (= l1/2)",
                                                  "choices": ["l1", "tv"]})
    bf16: bool | None = field(default=None, metadata={
        "help": "bf16 autocast for the drafter forward/backward (fp32 master weights and optimizer state). Default: "
                "on for CUDA devices, off on CPU: a CPU with avx512_bf16 but no AMX trains several times SLOWER in "
                "bf16, and even one with AMX, whose bf16 GEMMs are much faster than fp32 ones, trains no faster (the "
                "fp32 teacher, the loss and attention dominate a drafter step; python -m jobs.bench train_step "
                "--bf16; measurements: docs/results/training.md)"})
    holdout_frac: float = field(default=0.05, metadata={"help": "fraction of samples held out (for calibration)"})
    checkpoint_every: int = field(default=100, metadata={"help": "checkpoint every N steps (and at the end)"})
    eval_every: int = field(default=50, metadata={
        "help": "every N steps (and at the end) rank 0 measures teacher-forced greedy acceptance length tau on the "
                "held-out samples and logs it with the supervised positions seen (learning_curve.png); 0 = never"})
    eval_samples: int = field(default=32, metadata={
        "help": "held-out samples used for that tau (at most; a fixed seeded subset)"})
    eval_blocks: int = field(default=64, metadata={"help": "blocks per held-out sample (evenly spaced anchors)"})
    eval_walk_tokens: int = field(default=128, metadata={
        "help": "also replay greedy speculative rounds along the first N response tokens of those samples and log "
                "that tau (tokens per round, as an engine rollout counts it; the teacher-forced tau averages over "
                "positions and flatters a drafter that is good only where drafting is easy); 0 = off"})
    eval_data: Path | None = field(default=None, metadata={
        "help": "a finished disk store of the target's greedy responses to OTHER prompts (e.g. the benchmarks: "
                "jobs.generate + jobs.extract on them), same layers as --data: every held-out evaluation also "
                "measures tau on up to --eval-samples of its samples per source file (metrics eval_tau_<file> and "
                "eval_walk_tau_<file>), so the learning curve shows the domain the drafter is meant for"})
    log_every: int = field(default=5, metadata={"help": "log metrics every N steps"})
    backend: str = field(default="ray", metadata={
        "help": "ray: Ray Train TorchTrainer over --workers workers (an existing cluster or a local ray.init()); "
                "local: one process without Ray (one GPU or a laptop, --device); same checkpoints and resume",
        "choices": list(BACKENDS)})
    workers: int = field(default=1, metadata={"help": "Ray Train workers (DDP: gloo on CPU, NCCL on GPUs)"})
    fsdp: bool = field(default=False, metadata={
        "help": "shard parameters, gradients and optimizer state over the workers (FSDP2 fully_shard) instead of "
                "replicating them; for drafters too large for one device (--backend ray; checkpoints as without it)"})
    cpus_per_worker: int = field(default=2, metadata={"help": "CPUs (torch threads) per worker"})
    gpus_per_worker: float = field(default=0.0, metadata={
        "help": "GPUs per Ray Train worker: 0 = CPU workers (gloo); > 0 = GPU workers (use_gpu, NCCL, each on "
                "ray.train.torch.get_device(), bf16 autocast unless --bf16 false)"})
    device: str = field(default="auto", metadata={
        "help": "(--backend local) torch device: auto = cuda when PyTorch sees a GPU, else cpu; or cpu, cuda, cuda:1"})
    worker_resources: str | None = field(default=None, metadata={
        "help": "extra Ray resources per worker as JSON, or auto: {\"training\": 1} when the cluster declares "
                "training nodes, else none (see pipeline/launch/placement.py); {} = no constraint"})
    seed: int = field(default=42, metadata={"help": "seed (init, data order, anchors)"})
    resume: bool = field(default=False, metadata={
        "help": "continue from the latest checkpoint in --out (none yet: start at step 0, so the same command starts "
                "a run and finishes it after a stop)"})
    stop_after: int | None = field(default=None, metadata={
        "help": "end this run after N total steps (checkpointed), as a preemption would; --resume finishes it"})
    max_seconds: float | None = field(default=None, metadata={
        "help": "wall-clock budget of this run's training: end it after the first step past it (checkpointed, as "
                "--stop-after; --resume finishes it)"})
    prompts: list[Path] = field(default_factory=list, metadata={
        "help": "(--backend local) prompt JSONL files: while --data holds no finished store, first run stages 1-2 "
                "in this process with transformers - greedy responses into <out>/responses, their hidden states "
                "into the disk store --data (pipeline/train/local_stages.py); with Ray: jobs.generate + jobs.extract"})
    limit_per_file: int | None = field(default=None, metadata={"help": "(--prompts) prompts per file (default: all)"})
    max_new_tokens: int = field(default=256, metadata={"help": "(--prompts) response length cap"})
    max_prompt_tokens: int = field(default=1536, metadata={"help": "(--prompts) longer prompts are skipped"})
    gen_batch: int = field(default=64, metadata={"help": "(--prompts) prompts per generate call"})
    gen_seconds: float | None = field(default=None, metadata={
        "help": "(--prompts) wall-clock cap of generation: no generate call starts after it, and the prompts not "
                "yet answered are left out (the batches run in a seeded random order, so the cut is not by length)"})
    target_dtype: str = field(default="float32", metadata={
        "help": "(--prompts) target precision for generation and hidden states", "choices": ["float32", "bfloat16"]})
    dry_run: bool = field(default=False, metadata={
        "help": "print what would be launched as JSON (Ray ScalingConfig and resources, placement, torch back end, "
                "dtype, trainer configuration, step count from the store's manifest) and exit: no Ray, no training"})
    address: str | None = field(default=None, metadata={"help": "Ray address (default: a local ray.init())"})

    def __post_init__(self):  # a clear error naming the flag (parse_config turns it into a usage error)
        positive = ("lr", "epochs", "seqs_per_step", "micro_batch", "num_anchors", "workers", "cpus_per_worker",
                    "block_size", "num_layers", "max_new_tokens", "max_prompt_tokens", "gen_batch")
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {getattr(self, name)}")
        for name in ("feature_noise", "weight_decay", "grad_clip", "eval_walk_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(self, name)}")
        if not 0 <= self.holdout_frac < 1:
            raise ValueError(f"--holdout-frac must be in [0, 1), got {self.holdout_frac}")
        if self.gpus_per_worker < 0:
            raise ValueError(f"--gpus-per-worker must be >= 0, got {self.gpus_per_worker}")
        for name in ("max_steps", "stop_after", "max_seconds", "gen_seconds"):  # optional caps: None = no cap
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {getattr(self, name)}")
        if self.backend == "local" and self.workers != 1:
            raise ValueError(f"--backend local trains in one process: --workers must be 1, got {self.workers}")
        if self.backend == "local" and self.fsdp:
            raise ValueError("--fsdp shards the drafter over Ray Train workers' process group; --backend local trains "
                             "in one process without one: drop --fsdp or use --backend ray")
        if self.backend == "local" and self.gpus_per_worker:
            raise ValueError("--gpus-per-worker places Ray Train workers; --backend local takes --device instead")
        if self.prompts and (self.backend != "local" or self.store != "disk"):
            raise ValueError("--prompts runs stages 1-2 in this process into a disk store: it needs --backend local "
                             "and --store disk (with Ray: jobs.generate, then jobs.extract)")
        parse_mix(self.mix)  # a malformed entry is a usage error before anything starts
        if self.eval_data is not None and not (Path(self.eval_data) / "manifest.json").is_file():
            raise ValueError(f"--eval-data {self.eval_data}: not a finished disk store (no manifest.json; build it "
                             "with jobs.generate + jobs.extract on the evaluation prompts)")
        if self.backend == "ray" and self.device != "auto":
            raise ValueError("--device is for --backend local; Ray Train workers get their device from "
                             "--gpus-per-worker")

    def decay_value(self):
        return "gamma" if self.loss_decay == "gamma" else float(self.loss_decay)

    def to_plan(self) -> dict:
        """The config as plain JSON values (what plan() hands the workers; `from_plan` reverses it)."""
        paths = {"data": str(self.data), "out": str(self.out), "prompts": [str(p) for p in self.prompts],
                 "eval_data": None if self.eval_data is None else str(self.eval_data)}
        return asdict(self) | paths

    @classmethod
    def from_plan(cls, values: dict) -> "TrainConfig":
        paths = {"data": Path, "out": Path, "prompts": lambda v: [Path(p) for p in v],
                 "eval_data": lambda v: None if v is None else Path(v)}
        return cls(**{k: paths.get(k, lambda x: x)(v) for k, v in values.items()})

    @property
    def process_group_backend(self) -> str:
        """torch.distributed back end of the Ray Train workers: NCCL between GPU workers, gloo between CPU ones."""
        return "nccl" if self.gpus_per_worker > 0 else "gloo"


def use_bf16_autocast(cfg: TrainConfig, device: torch.device) -> bool:
    """--bf16 if given, else on for CUDA devices and off on CPU (the flag's help says why)."""
    return cfg.bf16 if cfg.bf16 is not None else torch.device(device).type == "cuda"


def build_drafter_config(cfg: TrainConfig, target: Path, layer_ids: list[int], draft_vocab_size: int):
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(str(target))
    extra = (dict(markov_rank=cfg.markov_rank, markov_head_type=cfg.markov_head, markov_w1_source=cfg.markov_w1)
             if cfg.drafter == "dspark" else {})
    return DrafterConfig.from_target_config(hf, num_hidden_layers=cfg.num_layers, aux_layer_ids=layer_ids,
                                            draft_vocab_size=draft_vocab_size, kind=cfg.drafter,
                                            block_size=cfg.block_size, **extra)


def lr_lambda(total_steps: int, warmup_frac: float):
    warm = max(1, round(warmup_frac * total_steps))

    def f(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        prog = (step - warm) / max(1, total_steps - warm)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, prog)))

    return f
