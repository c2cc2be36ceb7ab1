"""The tiny training data set of the training tests: a random 4-layer Llama target (saved as an HF folder) and the
hidden states of 12 random sequences extracted from it with the transformers extractor into a disk store; half
the samples carry the cached full-vocabulary lse, so both target-statistics paths of the loss run."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from pipeline.data.hf_extractor import HFExtractor
from pipeline.ops.layers import full_vocab_lse
from pipeline.stores.disk import DiskHiddenStore


def build_tiny_training_set(root: Path) -> Path:
    """root/target (HF folder) and root/hidden (disk store, layers [1, 2, 4]); returns root."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=256, max_position_embeddings=512, pad_token_id=0,
                      eos_token_id=1, bos_token_id=2, tie_word_embeddings=True)
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(root / "target")
    ex = HFExtractor(root / "target", [1, 2, 4])
    store = DiskHiddenStore(root / "hidden", samples_per_shard=4)
    g = torch.Generator().manual_seed(1)
    for i in range(12):
        T = 40 + 3 * i
        ids = torch.randint(3, 256, (T,), generator=g).tolist()
        aux, last = ex.extract(ids)
        mask = torch.tensor([0] * 10 + [1] * (T - 10), dtype=torch.uint8)
        sample = {"input_ids": torch.tensor(ids, dtype=torch.int32), "loss_mask": mask, "aux_hidden": aux,
                  "last_hidden": last}
        if i % 2:
            sample["target_lse"] = full_vocab_lse(last, model.lm_head.weight)
        store.put(f"s{i}", sample)
    store.commit({"layer_ids": [1, 2, 4], "target": str(root / "target")})
    return root


def train_args(root: Path, out: Path, *extra: str) -> list[str]:
    """jobs.train flags of a 6-step run on the tiny set (checkpoints at 3 and 6, held-out tau every 2 steps)."""
    return ["--data", str(root / "hidden"), "--out", str(out), "--target", str(root / "target"),
            "--max-steps", "6", "--seqs-per-step", "2", "--num-anchors", "8", "--checkpoint-every", "3",
            "--log-every", "1", "--holdout-frac", "0.1", "--cpus-per-worker", "1", "--bf16", "false",
            "--markov-rank", "16", "--eval-every", "2", *extra]


def losses_by_step(out: Path) -> dict[int, float]:
    """{step: loss} of a run's metrics.jsonl (a resumed run's rows for a step replace the earlier ones)."""
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows}


def preempt_and_resume(main, root: Path, out: Path, full: dict[int, float], *opts: str, between=None) -> dict:
    """A run stopped after step 3 (--stop-after), then ``between(out)`` if given, then --resume: its losses equal
    the uninterrupted run's ``full`` step by step.  -> the resumed run's {step: loss}."""
    import pytest

    main(train_args(root, out, "--stop-after", "3", *opts))
    assert sorted(losses_by_step(out)) == [1, 2, 3] and not (out / "drafter").exists()
    if between is not None:
        between(out)
    main(train_args(root, out, "--resume", *opts))
    resumed = losses_by_step(out)
    assert sorted(resumed) == [1, 2, 3, 4, 5, 6]
    for step in range(1, 7):
        assert resumed[step] == pytest.approx(full[step], rel=1e-6, abs=1e-7), step
    return resumed

