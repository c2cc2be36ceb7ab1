"""The long-context suite (pipeline/data/long_context.py) and the pieces of ``jobs.bench long_context`` that need no
model: the suite is the same for a seed, its prompts are as long as asked (chat template included) and fit the
target's context, every question's evidence is in its document, the JSONL files read back through the evaluation's
prompt loader; a drafter honours a context window set after loading, and runs without its Markov head."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from jobs.bench.long_context import DraftTimer, parse_windows, without_markov_head
from pipeline.data.long_context import (DEFAULT_CONTEXT, DEFAULT_HEADROOM, KINDS, build_suite, slack, suite_file,
                                        target_tokens, write_suite)
from pipeline.data.prompts import chat_prompt_ids, read_prompt_files
from pipeline.dspark.config import DrafterConfig
from pipeline.dspark.drafter import DSparkDrafter
from pipeline.eval.evaluation import load_benchmark
from pipeline.ops.sampling import SamplingParams

ROOT = Path(__file__).resolve().parent.parent
LENGTHS = [512, 2048, 8192]


@pytest.fixture(scope="module")
def tokenizer(target_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(target_dir))


@pytest.fixture(scope="module")
def suite(tokenizer):
    return build_suite(tokenizer, LENGTHS, 3, seed=11)


def test_same_seed_same_suite_other_seed_other_prompts(tokenizer, suite):
    assert build_suite(tokenizer, LENGTHS, 3, seed=11) == suite
    other = build_suite(tokenizer, [512], 3, seed=12)
    assert [r["turns"] for r in other[512]] != [r["turns"] for r in suite[512]]


def test_lengths_fit_the_request_and_the_context(tokenizer, suite):
    assert list(suite) == LENGTHS
    for length, rows in suite.items():
        target = target_tokens(length)
        assert target == min(length, DEFAULT_CONTEXT - DEFAULT_HEADROOM)
        assert len(rows) == 3 and {r["kind"] for r in rows} == set(KINDS)  # the kinds take turns
        assert len({r["id"] for r in rows}) == 3
        for r in rows:
            n = len(chat_prompt_ids(tokenizer, r["turns"][0]))
            assert r["prompt_tokens"] == n and r["target_tokens"] == target
            assert target - slack(target) <= n <= target, (r["id"], n, target)
            assert n + DEFAULT_HEADROOM <= DEFAULT_CONTEXT
    assert min(r["prompt_tokens"] for r in suite[8192]) >= 7400  # an "8K" prompt nearly fills the context


def test_every_question_is_answerable_from_its_document(suite):
    for rows in suite.values():
        for r in rows:
            text = r["turns"][0]
            document, _, question = text.rpartition("\n---\n")
            assert document and question.strip()
            assert r["evidence"] and all(e in document for e in r["evidence"]), r["id"]
            if r["question_type"] == "total":  # the sum of the quantities of the listed "in" rows of one SKU
                cells = [[c.strip() for c in e.strip("|").split("|")] for e in r["evidence"]]
                assert len({c[3] for c in cells}) == 1 and all(c[5] == "in" for c in cells)
                assert f"{cells[0][3]} " in question
                assert int(r["answer"]) == sum(int(c[6]) for c in cells)
                # ... and no "in" row of that SKU is missing from the evidence
                rows_in = [ln for ln in document.splitlines() if f"| {cells[0][3]} |" in ln and "| in |" in ln]
                assert sorted(rows_in) == sorted(r["evidence"])
            else:
                assert r["answer"] in document and (r["answer"] in question or r["question_type"] == "lookup"
                                                     and r["kind"] == "ledger")
            if r["kind"] == "ledger" and r["question_type"] == "lookup":
                tx = re.search(r"TX-\d{5}", question).group(0)
                assert r["evidence"] == [ln for ln in document.splitlines() if f"| {tx} |" in ln]
            if r["kind"] == "meetings":
                who = r["answer"]
                assert who in question and all(e.startswith(f"- {who}: ") for e in r["evidence"])


def test_jsonl_reads_back_through_the_evaluation_loader(tokenizer, suite, tmp_path):
    files = write_suite(suite, tmp_path)
    assert files == {L: suite_file(tmp_path, L) for L in LENGTHS}
    for length, rows in suite.items():
        lines = files[length].read_text().splitlines()
        assert [json.loads(x) for x in lines] == rows
        prompt_rows, skips = read_prompt_files([files[length]])
        assert not skips and [p.text for p in prompt_rows] == [r["turns"][0] for r in rows]
        loaded = load_benchmark(files[length], tokenizer, limit=len(rows))
        assert [len(p["prompt_ids"]) for p in loaded] == [r["prompt_tokens"] for r in rows]


def test_bench_build_only_writes_the_suite(tmp_path):
    env = dict(os.environ, DSPARK_NO_REEXEC="1")
    p = subprocess.run([sys.executable, "-m", "jobs.bench", "long_context", "--drafter", "unused", "--lengths", "600",
                        "--per-length", "2", "--build-only", "--out", str(tmp_path)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    doc = json.loads((tmp_path / "results.json").read_text())
    info = doc["results"]["suite"]["600"]
    assert [x["kind"] for x in info["prompts"]] == ["ledger", "code"]
    assert len((tmp_path / "suite" / "long_context_600.jsonl").read_text().splitlines()) == 2
    assert parse_windows(["full", "256", "256"]) == [None, 256]


def tiny_drafter(markov_rank: int = 8) -> DSparkDrafter:
    torch.manual_seed(0)
    cfg = DrafterConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=64,
                        vocab_size=64, mask_token_id=0, aux_layer_ids=[1, 2], num_hidden_layers=1, block_size=4,
                        markov_rank=markov_rank, confidence_head_with_markov=markov_rank > 0)
    d = DSparkDrafter(cfg).eval()
    with torch.no_grad():
        for p in d.parameters():
            p.normal_(0, 0.5)
    return d


def test_a_context_window_set_after_loading_is_honoured():
    d = tiny_drafter()
    st = d.new_state()
    d.extend_contexts([st], [torch.randn(50, 64)])
    kv, mask = d._gather_context([st])
    assert kv.shape[-2] == 50 and mask.shape == (1, 50)
    anchors = torch.tensor([3])
    full = d.propose([st], anchors, SamplingParams())
    d.cfg.context_window = 8  # what the window study does to the loaded drafter
    kv, mask = d._gather_context([st])
    assert kv.shape[-2] == 8 and mask.shape == (1, 8)
    windowed = d.propose([st], anchors, SamplingParams())
    assert not torch.equal(full.logits, windowed.logits)
    d.cfg.context_window = None
    assert torch.equal(d.propose([st], anchors, SamplingParams()).logits, full.logits)


def test_without_markov_head_proposes_from_the_backbone_alone_and_is_timed():
    d = tiny_drafter()
    st = d.new_state()
    d.extend_contexts([st], [torch.randn(20, 64)])
    anchors = torch.tensor([5])
    with_markov = d.propose([st], anchors, SamplingParams())
    kv, mask = d._gather_context([st])
    _, U = d._block_forward(anchors, torch.tensor([st.length]), kv, mask)
    without_markov_head(d)
    timer = DraftTimer(d)
    p = d.propose([st], anchors, SamplingParams())
    assert p.conf_logits is None and with_markov.conf_logits is not None
    # g_k = U_k: no Markov bias (the same block forward, though propose may take another kernel path: to rounding)
    assert torch.allclose(p.logits, U, atol=1e-4) and (with_markov.logits - U).abs().max() > 1e-2
    assert torch.equal(p.tokens, d.draft_ids[p.logits.argmax(-1)])
    d.extend_contexts([st], [torch.randn(2, 64)])
    assert timer.rounds == 1 and timer.propose_s > 0 and timer.extend_s > 0
