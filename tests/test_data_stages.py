"""Stages 1 and 2 on the real stack: real SmolLM2 target, real vLLM engine in Ray Data actors, real Ray cluster."""
import json
import os
import signal
import subprocess
import sys
import time

import pyarrow.parquet as pq
import pytest
import torch

from actors.extraction import ExtractConfig, run_extraction
from actors.generation import GenerateConfig, run_generation
from pipeline.launch.launch_plan import EngineLayout
from pipeline.stores.disk import DiskHiddenStore
from pipeline.data.shards import ShardSet

pytestmark = pytest.mark.slow

GOOD = ["What is 2 + 3?", "Write a haiku about rain.", "Name three colors.", "Write a Python function that adds two numbers."]


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory):
    d = tmp_path_factory.mktemp("prompts")
    f = d / "mixed.jsonl"
    lines = [json.dumps({"turns": [p]}) for p in GOOD[:2]]
    lines += ["{broken json", json.dumps({"turns": [""]}), json.dumps({"prompt": "word " * 600})]
    lines += [json.dumps({"prompt": p}) for p in GOOD[2:]]
    f.write_text("\n".join(lines) + "\n")
    return f


@pytest.fixture(scope="module")
def responses(ray_session, target_dir, prompt_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("resp")
    cfg = GenerateConfig(prompts=[prompt_file], out=out, target=str(target_dir), max_new_tokens=24,
                         max_model_len=512, batch_size=4, rows_per_shard=3)
    return cfg, run_generation(cfg)


def test_generate_real_target(responses, target_dir):
    from transformers import AutoTokenizer

    cfg, manifest = responses
    assert manifest["complete"] and manifest["num_rows"] == 4 and manifest["num_skipped"] == 3
    skipped = {r["line"]: r["reason"] for r in pq.read_table(cfg.out / "skipped.parquet").to_pylist()}
    assert "malformed JSON" in skipped[3] and skipped[4] == "empty prompt" and "longer than the context" in skipped[5]
    tok = AutoTokenizer.from_pretrained(target_dir)
    rows = list(ShardSet(cfg.out, "request_id").iter_rows())
    assert sorted(r["request_id"] for r in rows) == ["mixed:1", "mixed:2", "mixed:6", "mixed:7"]
    for r in rows:
        assert len(r["loss_mask"]) == len(r["prompt_ids"]) + len(r["response_ids"])
        assert sum(r["loss_mask"]) == len(r["response_ids"]) > 0
        assert r["loss_mask"][len(r["prompt_ids"]) - 1] == 0 and r["loss_mask"][-1] == 1
        if r["finish_reason"] == "stop":
            assert r["response_ids"][-1] == tok.eos_token_id  # the end-of-turn token is kept (and supervised)
        else:
            assert len(r["response_ids"]) == 24
        assert tok.decode(r["prompt_ids"]).endswith("<|im_start|>assistant\n")
    # greedy vLLM output equals transformers' greedy output for the same prompt
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.bfloat16)
    r = rows[0]
    ref = m.generate(torch.tensor([r["prompt_ids"]]), max_new_tokens=8, do_sample=False)[0, len(r["prompt_ids"]):]
    assert r["response_ids"][:8] == ref.tolist()


def test_sampled_generation_when_a_batch_exceeds_one_step(ray_session, target_dir, tmp_path):
    """Seeded sampling (temperature > 0, one seed per request) on vLLM's CPU build, with a batch whose prompts do not
    fit one engine step's token budget: with chunked prefill the engine would split a prompt, rewind that request's
    generator, and a CPU generator cannot rewind ("CPU Generator does not use offset")."""
    prompts = tmp_path / "long.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"{i} " + "word " * 560}) + "\n" for i in range(8)))
    cfg = GenerateConfig(prompts=[prompts], out=tmp_path / "out", target=str(target_dir), max_new_tokens=4,
                         max_model_len=1024, batch_size=8, temperature=0.7, seed=3)
    m = run_generation(cfg)
    assert m["complete"] and m["num_rows"] == 8 and m["num_skipped"] == 0
    rows = list(ShardSet(cfg.out, "request_id").iter_rows())
    assert sum(len(r["prompt_ids"]) for r in rows) > 4096  # more than one step of vLLM's default CPU budget
    assert all(1 <= len(r["response_ids"]) <= 4 for r in rows)
    assert all(len(r["response_ids"]) == 4 for r in rows if r["finish_reason"] == "length")


def test_actor_memory_request(ray_session, target_dir):
    """--actor-memory: auto = 1.25 x (weights at the compute precision + vLLM's CPU KV cache + runtime), capped so
    the pool fits the cluster; explicit GiB; bad values name the option.  (The fixtures above ran with auto.)"""
    import ray

    from actors.vllm_engine import ACTOR_RUNTIME_BYTES, MEMORY_HEADROOM, actor_memory_estimate, actor_memory_request

    stored = sum(f.stat().st_size for f in target_dir.glob("*.safetensors"))  # bf16 on disk
    fp32 = actor_memory_estimate(str(target_dir), "float32")  # sets the project's environment first
    kv = float(os.environ["VLLM_CPU_KVCACHE_SPACE"]) * 2**30
    assert fp32 == int(MEMORY_HEADROOM * (2 * stored + kv + ACTOR_RUNTIME_BYTES))
    bf16 = actor_memory_estimate(str(target_dir), "bfloat16")
    assert bf16 == int(MEMORY_HEADROOM * (stored + kv + ACTOR_RUNTIME_BYTES))
    assert actor_memory_estimate(str(target_dir), "float32", kv_cache=False) == int(
        MEMORY_HEADROOM * (2 * stored + ACTOR_RUNTIME_BYTES))
    # a CUDA engine keeps its KV cache in GPU memory: the host reserve is weights + runtime
    gpu = EngineLayout(gpus=1.0)
    assert actor_memory_estimate(str(target_dir), "bfloat16", layout=gpu) == int(
        MEMORY_HEADROOM * (stored + ACTOR_RUNTIME_BYTES))
    assert actor_memory_estimate(str(target_dir), "auto", layout=gpu) == actor_memory_estimate(
        str(target_dir), "bfloat16", layout=gpu)  # auto = bf16 on CUDA
    have = ray.available_resources()["memory"]
    assert actor_memory_request("auto", str(target_dir), "float32", 1) == min(fp32, int(have))
    # 64 actors: capped to a 64th of what the cluster has free at the call (fixture actors may still be handing
    # their reservations back, so bound it by the cluster's total rather than by `have` read a moment earlier)
    pooled = actor_memory_request("auto", str(target_dir), "float32", 64)
    assert pooled <= ray.cluster_resources()["memory"] / 64 and pooled < fp32
    assert actor_memory_request("2.5", str(target_dir), "float32", 1) == int(2.5 * 2**30)
    assert actor_memory_request("0", str(target_dir), "float32", 1) == 0
    for bad, msg in (("lots", "number of GiB or 'auto'"), ("-1", ">= 0 GiB")):
        with pytest.raises(ValueError, match="--actor-memory") as e:
            actor_memory_request(bad, str(target_dir), "float32", 1)
        assert msg in str(e.value)


def test_extract_real_target_vllm_matches_transformers(responses, target_dir, tmp_path):
    from pipeline.data.hf_extractor import HFExtractor

    cfg, _ = responses
    ecfg = ExtractConfig(responses=cfg.out, out=tmp_path / "hidden", target=str(target_dir), max_model_len=512,
                         batch_size=4)
    manifest = run_extraction(ecfg)
    assert len(manifest["sample_ids"]) == 4 and manifest["layer_ids"] == [2, 15, 28]
    assert manifest["bytes_per_token"] == 5 + 2 * 3 * 576 + 2 * 576 + 4 and manifest["target_lse"]
    store = DiskHiddenStore(tmp_path / "hidden")
    resp = {r["request_id"]: r for r in ShardSet(cfg.out, "request_id").iter_rows()}
    hf = HFExtractor(target_dir, manifest["layer_ids"], dtype=torch.bfloat16)
    lm_head = hf.model.lm_head.weight.float()
    for sid in manifest["sample_ids"]:
        s = store.get(sid)
        r = resp[sid]
        assert s["input_ids"].tolist() == r["prompt_ids"] + r["response_ids"]
        assert s["loss_mask"].tolist() == r["loss_mask"]
        T = len(s["input_ids"])
        assert s["aux_hidden"].shape == (T, 3 * 576) and s["last_hidden"].shape == (T, 576)
        aux, last = hf.extract(s["input_ids"].tolist())
        for j in range(3):
            a, b = s["aux_hidden"][:, j * 576:(j + 1) * 576].float(), aux[:, j * 576:(j + 1) * 576].float()
            rel = ((a - b).norm() / b.norm()).item()
            assert rel < 0.05, f"layer {manifest['layer_ids'][j]}: relative error {rel:.4f}"
        rel = ((s["last_hidden"].float() - last.float()).norm() / last.float().norm()).item()
        assert rel < 0.06, f"final hidden: relative error {rel:.4f}"
        agree = ((s["last_hidden"].float() @ lm_head.T).argmax(-1) == (last.float() @ lm_head.T).argmax(-1))
        assert agree.float().mean() > 0.9
        # the cached full-vocabulary lse belongs to the STORED last hidden state
        lse = torch.logsumexp(s["last_hidden"].float() @ lm_head.T, dim=-1)
        assert s["target_lse"].dtype == torch.float32 and torch.allclose(s["target_lse"], lse, atol=1e-3)
    # rerun: nothing left to do, same manifest ids
    again = run_extraction(ecfg)
    assert again["sample_ids"] == manifest["sample_ids"]


def test_generation_resumes_after_kill(ray_session, target_dir, tmp_path):
    """SIGKILL a real `python -m jobs.generate` after its first shard; the rerun completes exactly once."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"Count from {i} to {i + 5}."}) + "\n" for i in range(8)))
    out = tmp_path / "resp"
    args = ["--prompts", str(prompts), "--out", str(out), "--target", str(target_dir), "--max-new-tokens", "16",
            "--max-model-len", "256", "--batch-size", "2", "--rows-per-shard", "2"]
    env = dict(os.environ, RAY_ADDRESS=ray_session.get_runtime_context().gcs_address)
    proc = subprocess.Popen([sys.executable, "-m", "jobs.generate", *args], env=env, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 240
    try:
        while time.time() < deadline and not list(out.glob("part-*.parquet")):
            assert proc.poll() is None, "generate exited before writing a shard"
            time.sleep(0.5)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    first = ShardSet(out, "request_id").done_ids()
    assert 0 < len(first) < 8 and not (out / "manifest.json").exists()
    m = run_generation(GenerateConfig(prompts=[prompts], out=out, target=str(target_dir), max_new_tokens=16,
                                      max_model_len=256, batch_size=2, rows_per_shard=2))
    ids = [r["request_id"] for r in ShardSet(out, "request_id").iter_rows(["request_id"])]
    assert m["complete"] and len(ids) == 8 and sorted(set(ids)) == sorted(ids) == sorted(f"p:{i}" for i in range(1, 9))
    assert first <= set(ids)
