"""Training the DSpark / DFlash drafter: the configuration, the data order, one optimizer step's forward/backward,
the held-out measurements, the metrics and the driver-side plan.  The loop that runs them is ONE class,
pipeline.trainer.Trainer, whichever way jobs.train launches it (Ray Train workers or one local process).

Determinism: the data order of an epoch comes from (seed, epoch) and a step's anchors from (seed, rank, step), so a
run resumed from a checkpoint (model + optimizer + scheduler + step) continues with exactly the losses it would
have had.
"""
from __future__ import annotations

import json
import math
import time
import zlib
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import pyarrow.parquet as pq
import torch

from pipeline.dspark.anchors import Blocks, anchor_candidates, block_labels, make_blocks
from pipeline.dspark.config import DrafterConfig
from pipeline.dspark.draft_vocab import build_draft_vocab, count_tokens
from pipeline.dspark.losses import drafter_loss, weight_sum
from pipeline.packed_linear import forget_packed
from pipeline.stores import DiskHiddenStore, open_hidden_store
from pipeline.stores.base import tensor_from_bytes
from pipeline.subsets import by_source_file, cut_to_mix, parse_mix, source_of, subsample
from pipeline.target_model import resolve_target

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
    block_size: int = field(default=7, metadata={"help": "gamma: draft tokens per block"})
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
                "on for CUDA devices, off on CPU: an AMD EPYC with avx512_bf16 but no AMX trained 3.5x SLOWER in bf16 (21-25 "
                "vs 72-80 positions/s), and even an Intel Xeon with AMX, whose bf16 GEMMs run at 0.16-0.3x the fp32 "
                "time, trained at 0.93x the fp32 speed (1,399 vs 1,501 positions/s, 16k draft vocabulary: the fp32 "
                "teacher, the loss and attention dominate a drafter step; python -m jobs.bench train_step --bf16)"})
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
                "training nodes, else none (see pipeline/placement.py); {} = no constraint"})
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
                "into the disk store --data (pipeline/local_stages.py); with Ray: jobs.generate + jobs.extract"})
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



# ---- data -------------------------------------------------------------------------------------------------------
def open_store(cfg: TrainConfig):
    return open_hidden_store(cfg.store, cfg.data, cfg.mooncake_prefix, master_addr=cfg.mooncake_master,
                             metadata_url=cfg.mooncake_metadata)


def is_holdout(sample_id: str, frac: float) -> bool:
    """Deterministic split by id (stable across runs, stores and worker counts)."""
    return (zlib.crc32(sample_id.encode()) % 10_000) < frac * 10_000


def split_ids(ids: list[str], frac: float) -> tuple[list[str], list[str]]:
    """(train, held out) by `is_holdout`; with frac > 0 at least one sample is held out (the one with the smallest
    hash) so that small data sets still get a learning curve and a calibration set."""
    train = [i for i in ids if not is_holdout(i, frac)]
    hold = [i for i in ids if is_holdout(i, frac)]
    if frac > 0 and not hold and len(ids) > 1:
        first = min(ids, key=lambda i: (zlib.crc32(i.encode()), i))
        train, hold = [i for i in ids if i != first], [first]
    if not train:
        raise ValueError(f"no training samples left after holding out {frac:.0%} of {len(ids)}")
    return train, hold


def training_split(ids: list[str], cfg: TrainConfig) -> tuple[list[str], list[str]]:
    """(train, held out) of a store's sample ids: `split_ids` by --holdout-frac, then --mix (only its sources; each
    source's training ids cut to its COUNT)."""
    train, hold = split_ids(ids, cfg.holdout_frac)
    if not cfg.mix:
        return train, hold
    mix = parse_mix(cfg.mix)
    train = cut_to_mix(train, mix)
    hold = [i for i in hold if source_of(i) in mix]
    return train, hold


def epoch_order(ids: list[str], seed: int, epoch: int) -> list[str]:
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return [ids[i] for i in torch.randperm(len(ids), generator=g).tolist()]


def step_sample_ids(ids: list[str], step: int, seqs_per_step: int, world: int, rank: int, seed: int) -> list[str]:
    """The sequences rank `rank` trains on at `step`: a contiguous slice of the concatenated epoch orders."""
    per_step = seqs_per_step * world
    start = step * per_step + rank * seqs_per_step
    out = []
    for j in range(start, start + seqs_per_step):
        epoch, k = divmod(j, len(ids))
        out.append(epoch_order(ids, seed, epoch)[k])
    return out


def count_tokens_in_store(store, ids: list[str], vocab_size: int) -> torch.Tensor:
    """Counts of target ids over the supervised (loss-mask) tokens of the given samples."""

    def pairs():  # (input_ids [T], loss_mask [T]) of each wanted sample
        if isinstance(store, DiskHiddenStore):  # column read: no hidden states loaded
            want = set(ids)
            for p in store.shards.shard_paths():
                for r in pq.read_table(p, columns=["sample_id", "n_tokens", "input_ids", "loss_mask"]).to_pylist():
                    if r["sample_id"] in want:
                        yield (tensor_from_bytes(r["input_ids"], torch.int32, (r["n_tokens"],)),
                               tensor_from_bytes(r["loss_mask"], torch.uint8, (r["n_tokens"],)))
        else:
            for sid in ids:
                s = store.get(sid)
                yield s["input_ids"], s["loss_mask"]

    return count_tokens(pairs(), vocab_size)


# ---- model ------------------------------------------------------------------------------------------------------
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


# ---- one step's forward/backward ------------------------------------------------------------------------------
def collate(samples: list[dict], blocks: list, need_target: bool, device=None) -> dict:
    """Right-pad store samples (and their per-sample Blocks) into one batch.  Padding is never read: a block at
    anchor p attends to context positions < p only, and labels / target statistics are gathered at supervised
    positions only.  -> dict(aux [B,T,n·d], ids [B,T], last [B,T,d] | None, lse [B,T] | None, blocks [B,S,γ])."""
    T = max(int(s["input_ids"].shape[0]) for s in samples)

    def pad(t):  # [T_i, ...] -> [T, ...]
        n = t.shape[0]
        return t if n == T else torch.cat([t, t.new_zeros((T - n,) + tuple(t.shape[1:]))])

    def stack(key, conv=lambda t: t):
        return torch.stack([pad(conv(s[key])) for s in samples]).to(device)

    has_lse = need_target and all(s.get("target_lse") is not None for s in samples)
    blk = Blocks(**{f: torch.cat([getattr(b, f) for b in blocks]).to(device)
                    for f in ("anchors", "valid", "labels", "prev", "label_mask")})
    return dict(aux=stack("aux_hidden"), ids=stack("input_ids", lambda t: t.long()),
                last=stack("last_hidden") if need_target else None,
                lse=stack("target_lse") if has_lse else None, blocks=blk)


def step_seed(seed: int, rank: int, step: int, purpose: str = "") -> int:
    """The seed of one rank's random draws at `step` (anchors: purpose ""; feature noise: "noise:"), so a resumed
    run draws what the uninterrupted one would have."""
    return zlib.crc32(f"{purpose}{seed}:{rank}:{step}".encode())


def step_blocks(samples: list[dict], num_anchors: int, block_size: int, decay, seed: int, rank: int, step: int):
    """This rank's anchors and block labels for `step`, drawn from (seed, rank, step) so a resumed run draws the same,
    and their local weight sum Σw (all-reduce it across ranks for the step's global denominator)."""
    gen = torch.Generator().manual_seed(step_seed(seed, rank, step))
    blocks = [make_blocks(s["input_ids"].long(), s["loss_mask"], num_anchors, block_size, gen) for s in samples]
    return blocks, sum(float(weight_sum(b.label_mask, decay)) for b in blocks)


def noisy_features(aux: torch.Tensor, hidden_size: int, rel_std: float, gen: torch.Generator) -> torch.Tensor:
    """One sequence's injected features aux [T, n·d] plus Gaussian noise of std rel_std · the RMS of each token's
    d-slice per layer (the n injected layers have different scales).  Drawn on the CPU from `gen`."""
    T, nd = aux.shape
    x = aux.float().view(T, nd // hidden_size, hidden_size)
    rms = x.pow(2).mean(-1, keepdim=True).sqrt()  # [T,n,1]
    noise = torch.randn(x.shape, generator=gen).to(x.device)
    return (x + rel_std * rms * noise).view(T, nd).to(aux.dtype)


def micro_batch_count(blocks: list, micro_batch: int) -> int:
    """How many forward/backward passes accumulate_gradients runs for these blocks: one per `micro_batch`
    sequences that have a supervised block."""
    return -(-sum(b.num_supervised > 0 for b in blocks) // max(1, micro_batch))


def accumulate_gradients(model, target_head, samples: list[dict], blocks: list, loss_cfg, denom: float,
                         micro_batch: int = 1, bf16: bool = False, device=None, feature_noise: float = 0.0,
                         noise_seed: int = 0, min_chunks: int = 0):
    """Forward + backward of one optimizer step's sequences, `micro_batch` at a time (longest first, so padding
    stays small), every loss divided by the step's GLOBAL weight sum `denom`: the accumulated gradient is the
    same for any micro_batch.  feature_noise > 0: the injected features get noise (`noisy_features`) drawn from
    `noise_seed`, so a resumed run draws the same.  min_chunks: run at least that many forward/backward passes,
    the extra ones repeating the last micro-batch with weight 0 (a sharded model's passes are collectives: every
    rank runs as many).  -> (loss parts summed, supervised positions, per-position accuracy · count)."""
    need_target = target_head is not None
    todo = [(s, b) for s, b in zip(samples, blocks) if b.num_supervised > 0]
    todo.sort(key=lambda sb: -int(sb[0]["input_ids"].shape[0]))
    dev = torch.device(device) if device is not None else model.fc.weight.device
    parts, n_sup = {"loss": 0.0}, 0
    acc = torch.zeros(model.cfg.block_size)
    if feature_noise > 0:  # per sequence, in the sorted order: the same noise for any micro_batch
        gen = torch.Generator().manual_seed(noise_seed)
        todo = [(s | {"aux_hidden": noisy_features(s["aux_hidden"], model.cfg.hidden_size, feature_noise, gen)}, b)
                for s, b in todo]
    starts = list(range(0, len(todo), max(1, micro_batch)))
    real = len(starts)  # == micro_batch_count(blocks, micro_batch)
    if real < min_chunks:
        if not starts:
            raise RuntimeError("accumulate_gradients: no sequence of this rank has a supervised block, so it cannot "
                               f"take part in the {min_chunks} sharded forward/backward passes of this step")
        starts += [starts[-1]] * (min_chunks - real)
    for j, i in enumerate(starts):
        chunk = todo[i:i + max(1, micro_batch)]
        x = collate([s for s, _ in chunk], [b for _, b in chunk], need_target, dev)
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=bf16):
            out = drafter_loss(model, target_head, x["aux"], x["ids"], x["last"], x["blocks"], loss_cfg,
                               denom=denom, target_stats=None if x["lse"] is None else (x["lse"], None))
        if j >= real:  # a padding pass: gradients += 0
            (out.loss * 0.0).backward()
            continue
        out.loss.backward()
        parts["loss"] += float(out.loss.detach())
        for k, v in out.parts.items():
            parts[k] = parts.get(k, 0.0) + float(v)
        n_sup += out.num_supervised
        acc += torch.tensor(out.metrics["acc_per_pos"]) * out.num_supervised
    return parts, n_sup, acc


def heldout_eval_ids(holdout_ids: list[str], n: int) -> list[str]:
    """The held-out samples the learning curve's tau is measured on: a fixed seeded subset of at most n (the same
    for every run over the same split), drawn from all source files, not the first n sorted ids (one file)."""
    return subsample(sorted(holdout_ids), n)


def eval_store_samples(cfg: TrainConfig, layer_ids: list[int]) -> dict[str, list[dict]]:
    """--eval-data's samples by source file ({tag: [sample]}, ids "<tag>:<line>"), at most --eval-samples per file
    (a fixed seeded subset).  A store extracted at other layers than the training data is an error naming both."""
    store = DiskHiddenStore(cfg.eval_data)
    try:
        manifest = store.manifest()
        if list(manifest.get("layer_ids") or []) != list(layer_ids):
            raise ValueError(f"--eval-data {cfg.eval_data} holds layers {manifest.get('layer_ids')}, the training "
                             f"data {list(layer_ids)}: extract it with --layer-ids {','.join(map(str, layer_ids))}")
        return {tag: [store.get(i) for i in ids]
                for tag, ids in by_source_file(manifest["sample_ids"], cfg.eval_samples).items()}
    finally:
        store.close()


@contextmanager
def evaluating(model):
    """Measure a drafter in the middle of training: eval mode, its packed weight copies dropped (the fused AdamW steps
    since the last measurement did not bump the weights' version counters), its training mode restored after."""
    was_training = model.training
    model.eval()
    forget_packed(model)
    try:
        yield model
    finally:
        model.train(was_training)


def on_model_device(model):
    """sample -> the same sample with its tensors on the model's device (held-out samples come from a store on the
    CPU; a no-op there)."""
    device = model.fc.weight.device

    def move(sample: dict) -> dict:
        return {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in sample.items()}

    return move


@torch.no_grad()
def teacher_forced_tau(model, samples: list[dict], blocks_per_sample: int = 64) -> dict:
    """Greedy acceptance length of the drafter on held-out sequences, teacher-forced and full depth.

    For evenly spaced anchors p whose γ labels are all supervised, the drafter's block is computed with the TRUE
    predecessors (training path); a draft token counts while argmax g_k == token[p+k] for every slot so far.  While
    that prefix holds, the true predecessors ARE the drafted ones, so the count equals what greedy drafting would get
    verified against this sequence; tau = 1 + mean accepted (the +1 is the target's bonus token).  On responses the
    target generated greedily (jobs.generate's default) that is the greedy verification tau at depth γ.
    -> dict(tau, blocks, accept_hist [γ+1]: fraction of blocks accepting exactly j drafts)."""
    G = model.cfg.block_size
    hist = torch.zeros(G + 1)
    with evaluating(model):
        for s in map(on_model_device(model), samples):
            ids, mask = s["input_ids"].long()[None], s["loss_mask"][None]
            cand = anchor_candidates(mask)[0].nonzero().squeeze(1)  # [C]
            blk = block_labels(ids, mask, cand[None], torch.ones(1, len(cand), dtype=torch.bool, device=ids.device), G)
            keep = blk.label_mask[0].all(-1).nonzero().squeeze(1)  # blocks with γ supervised labels
            if len(keep) == 0:
                continue
            if len(keep) > blocks_per_sample:
                keep = keep[torch.linspace(0, len(keep) - 1, blocks_per_sample, device=keep.device).round().long()]
            h = model.forward_train(s["aux_hidden"][None], ids, cand[keep][None])  # [1,S,γ,d]
            logits = model.block_logits(h, blk.prev[:, keep]).logits  # [S·γ, V_d]
            pred = model.draft_ids[logits.argmax(-1)].view(-1, G)  # target ids
            accepted = (pred == blk.labels[0, keep]).long().cumprod(-1).sum(-1)  # [S]
            hist += torch.bincount(accepted, minlength=G + 1).float().cpu()
    n = float(hist.sum())
    tau = float(1.0 + (hist * torch.arange(G + 1)).sum() / n) if n else float("nan")
    return dict(tau=tau, blocks=int(n), accept_hist=(hist / max(n, 1.0)).tolist())


@torch.no_grad()
def greedy_walk_tau(model, samples: list[dict], max_tokens: int) -> dict:
    """tau of greedy speculative decoding replayed along the stored responses (they ARE the target's greedy output),
    counted the way the engine counts it: the first response token comes from the prefill; each round drafts γ
    tokens from the last emitted one, keeps the matching prefix (a) plus the target's bonus token and moves a + 1
    tokens on, until max_tokens are emitted.  tau = tokens emitted by rounds / rounds, so (unlike the
    position-averaged teacher-forced tau) easy stretches count once per round, as in a rollout."""
    G = model.cfg.block_size
    emitted = rounds = 0
    with evaluating(model):
        for s in map(on_model_device(model), samples):
            ids, mask = s["input_ids"].long()[None], s["loss_mask"][None]
            resp = mask[0].nonzero().squeeze(1)
            if len(resp) < 2:
                continue
            start, end = int(resp[0]), min(int(resp[-1]) + 1, int(resp[0]) + max_tokens)  # response span to replay
            anchors = torch.arange(start, end - 1, device=ids.device)[None]  # a round can start at any of them
            blk = block_labels(ids, mask, anchors, torch.ones_like(anchors, dtype=torch.bool), G)
            h = model.forward_train(s["aux_hidden"][None], ids, anchors)
            pred = model.draft_ids[model.block_logits(h, blk.prev).logits.argmax(-1)].view(-1, G)
            ok = (pred == blk.labels[0]) & blk.label_mask[0].bool()
            accepted = ok.long().cumprod(-1).sum(-1).tolist()  # [S] drafts accepted from anchor start + i
            q = start  # last emitted token (the prefill emitted `start`)
            while q < end - 1:
                step = min(accepted[q - start] + 1, end - 1 - q)  # accepted drafts + bonus, cut at max_tokens
                emitted += step
                rounds += 1
                q += step
    return dict(tau=emitted / rounds if rounds else float("nan"), rounds=rounds, tokens=emitted)


def metrics_row(step: int, lr: float, grad_norm: float, positions: int, seconds: float, n_sup: int, parts: dict,
                acc: torch.Tensor, positions_seen: int | None = None) -> dict:
    """One metrics.jsonl row (pipeline.trainer.Trainer logs it on every back end; plot_metrics reads them).
    positions / seconds: supervised positions since the last row and the wall time they took; positions_seen: all
    supervised positions trained on so far (all ranks, kept across --resume)."""
    row = dict(step=step, lr=lr, grad_norm=grad_norm, positions_per_s=positions / max(seconds, 1e-9),
               supervised_positions=n_sup, **parts, acc_top1_first=float(acc[0] / max(1, n_sup)), time=time.time())
    if positions_seen is not None:
        row["positions_seen"] = positions_seen
    return row


def append_metrics(path: Path, row: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")


def plot_metrics(metrics_path: Path, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = {}
    for line in Path(metrics_path).read_text().splitlines():
        r = json.loads(line)
        if "positions_per_s" in r:
            rows[r["step"]] = r
    if not rows:
        return
    steps = sorted(rows)
    keys = [k for k in ("loss", "ce", "dist", "conf") if k in rows[steps[0]]]
    fig, axes = plt.subplots(1, len(keys), figsize=(4 * len(keys), 3.2))
    for ax, k in zip(axes if len(keys) > 1 else [axes], keys):
        ax.plot(steps, [rows[s][k] for s in steps])
        ax.set_title(k)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def read_learning_curve(metrics_path: Path, key: str = "heldout_tau", x: str = "positions") -> list[tuple]:
    """[(supervised positions seen, held-out tau)] of a run's metrics.jsonl, by step (a resumed run's rows for the
    same step replace the earlier ones).  key: heldout_tau (teacher-forced, averaged over positions) or
    heldout_walk_tau (greedy rounds replayed along the responses, tokens per round as the engine counts).
    x="seconds": the first element is the run's training seconds up to that step instead (`training_seconds`)."""
    rows, seconds = {}, training_seconds(metrics_path) if x == "seconds" else None
    for line in Path(metrics_path).read_text().splitlines():
        r = json.loads(line)
        if key in r and "positions_seen" in r and not math.isnan(r[key]):
            rows[r["step"]] = (int(r["positions_seen"]) if seconds is None else seconds[r["step"]], float(r[key]))
    return [rows[k] for k in sorted(rows)]


def training_seconds(metrics_path: Path) -> dict[int, float]:
    """{step: seconds spent training up to that step} of a run's metrics.jsonl: each row's positions since the row
    before divided by its positions_per_s (which leaves the held-out evaluations out), summed; comparable across
    runs of different drafter sizes as tau at equal training wall time."""
    rows = {}
    for line in Path(metrics_path).read_text().splitlines():
        r = json.loads(line)
        if "positions_seen" in r and "positions_per_s" in r:
            rows[r["step"]] = (int(r["positions_seen"]), float(r["positions_per_s"]))
    out, seen, total = {}, 0, 0.0
    for step in sorted(rows):
        pos, rate = rows[step]
        total += max(0, pos - seen) / max(rate, 1e-9)
        seen, out[step] = pos, total
    return out


def walk_key(key: str) -> str:
    """The replayed-rounds metric beside a teacher-forced one: heldout_tau -> heldout_walk_tau, eval_tau_<file> ->
    eval_walk_tau_<file>."""
    return key.replace("_tau", "_walk_tau", 1)


def plot_learning_curves(runs: dict[str, Path], png: Path, title: str | None = None, x: str = "positions",
                         key: str = "heldout_tau") -> bool:
    """Held-out greedy tau against supervised positions seen (x="seconds": training seconds), one colour per run
    {label: metrics.jsonl}: the teacher-forced tau solid, the replayed rounds' tau (where logged) dashed.  key:
    heldout_tau, or eval_tau_<file> for --eval-data's.  Returns False (no file written) when no run has that
    metric."""
    curves = {k: read_learning_curve(v, key, x=x) for k, v in runs.items()}
    walks = {k: read_learning_curve(v, walk_key(key), x=x) for k, v in runs.items()}
    curves = {k: c for k, c in curves.items() if c}
    if not curves:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.8))
    for label, c in curves.items():
        line, = ax.plot([x for x, _ in c], [y for _, y in c], marker="o", ms=3, label=f"{label} (teacher-forced)")
        if walks[label]:
            ax.plot([x for x, _ in walks[label]], [y for _, y in walks[label]], marker="o", ms=3, ls="--",
                    color=line.get_color(), label=f"{label} (replayed rounds)")
    ax.set_xlabel("supervised positions seen" if x == "positions" else "training seconds (evaluations left out)")
    ax.set_ylabel("held-out greedy tau (depth gamma)" if key == "heldout_tau"
                  else f"greedy tau on {key.removeprefix('eval_tau_')} (depth gamma)")
    ax.set_title(title or "learning curve")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return True


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest checkpoint folder of a run (by the step stored inside): Ray Train's under run_dir/ray or the local
    back end's under run_dir/checkpoints (the same STATE_FILE, so either back end resumes either's checkpoint)."""
    best, best_step = None, -1
    found = [f for sub in ("ray", LOCAL_CHECKPOINTS) for f in Path(run_dir, sub).rglob(STATE_FILE)]
    for f in found:
        if f.parent.name.endswith(".partial"):  # a local checkpoint whose copy did not finish
            continue
        try:
            step = torch.load(f, weights_only=False, map_location="cpu")["step"]
        except Exception:  # a checkpoint being written when the run died
            continue
        if step > best_step:
            best, best_step = f.parent, step
    return best


def special_token_ids(target: Path, V: int) -> list[int]:
    """Special ids of the target (tokenizer if present, else config): always kept in the draft vocabulary."""
    ids = set()
    conf = json.loads((Path(target) / "config.json").read_text())
    for k in ("eos_token_id", "pad_token_id", "bos_token_id"):
        v = conf.get(k)
        ids.update(v if isinstance(v, list) else [v] if v is not None else [])
    if (Path(target) / "tokenizer.json").is_file() or (Path(target) / "tokenizer_config.json").is_file():
        from transformers import AutoTokenizer

        ids.update(t for t in AutoTokenizer.from_pretrained(str(target)).all_special_ids if t is not None)
    return sorted(i for i in ids if 0 <= i < V)


def planned_steps(cfg: TrainConfig, num_train: int) -> int:
    """--max-steps, else --epochs passes over num_train sequences at seqs_per_step · workers per step."""
    return cfg.max_steps or max(1, math.ceil(cfg.epochs * num_train / (cfg.seqs_per_step * cfg.workers)))


def plan(cfg: TrainConfig) -> dict:
    """Driver side: ids, split, draft vocabulary, step count -> the per-worker config dict."""
    target = resolve_target(cfg.target)
    store = open_store(cfg)
    manifest = store.manifest()
    ids = list(manifest["sample_ids"])
    train_ids, hold_ids = training_split(ids, cfg)
    V = json.loads((target / "config.json").read_text())["vocab_size"]
    if cfg.draft_vocab_size == 0:
        draft_ids, report = None, f"draft vocab: full ({V} tokens)"
    else:
        special = special_token_ids(target, V)
        counts = count_tokens_in_store(store, train_ids, V)
        dv = build_draft_vocab(counts, coverage=cfg.draft_vocab_coverage, size=cfg.draft_vocab_size,
                               always_include=special, multiple_of=64)
        draft_ids, report = dv.draft_ids.tolist(), dv.report()
    store.close()
    return dict(train=cfg.to_plan(), target=str(target), layer_ids=manifest["layer_ids"], train_ids=train_ids,
                holdout_ids=hold_ids, draft_ids=draft_ids, draft_vocab_report=report,
                total_steps=planned_steps(cfg, len(train_ids)),
                store_manifest={k: manifest.get(k) for k in ("target", "layer_ids", "num_tokens")})
