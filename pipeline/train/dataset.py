"""What a training run reads: the store, the held-out split by sample id, the data order of an epoch and of a step,
the draft vocabulary's token counts, and the driver-side plan (ids, split, draft vocabulary, step count) every
worker receives.

Determinism: the data order of an epoch comes from (seed, epoch), so a run resumed from a checkpoint continues with
exactly the samples it would have had.
"""
from __future__ import annotations

import json
import math
import zlib
from pathlib import Path

import pyarrow.parquet as pq
import torch

from pipeline.dspark.draft_vocab import build_draft_vocab, count_tokens
from pipeline.stores import DiskHiddenStore, open_hidden_store
from pipeline.stores.base import tensor_from_bytes
from pipeline.data.subsets import by_source_file, cut_to_mix, parse_mix, source_of, subsample
from pipeline.data.target_model import resolve_target
from pipeline.train.config import TrainConfig


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
