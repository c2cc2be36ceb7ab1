"""``jobs.serve`` stopped while it starts comes back: a real driver (its own local Ray cluster) is killed while its
engine replica loads, nothing of it outlives the kill, and the same command started again is ready within a bound
and serves the target's greedy output.  The whole matrix (every moment, SIGTERM / SIGKILL, a replica killed while
serving) is ``python -m jobs.bench faults`` (docs/results/reliability.md)."""
from __future__ import annotations

import socket

import pytest

pytestmark = pytest.mark.slow

PROMPT = "Name three colours."
MAX_TOKENS = 12


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def expected(target_dir):
    """The target's own greedy continuation of the chat prompt (fp32, no drafter)."""
    from transformers import AutoTokenizer

    from pipeline.engine.engine import SpeculativeEngine
    from pipeline.data.prompts import chat_prompt_ids, end_of_turn_ids
    from pipeline.ops.sampling import SamplingParams
    from pipeline.engine.target_runner import TargetRunner

    tok = AutoTokenizer.from_pretrained(str(target_dir))
    runner = TargetRunner.from_pretrained(str(target_dir), dtype="float32")
    eos = set(runner.config.eos_token_ids) | set(end_of_turn_ids(tok))
    eng = SpeculativeEngine(runner, None, None, tokenizer=tok, eos_token_ids=eos)
    out = eng.generate([chat_prompt_ids(tok, PROMPT)], SamplingParams(temperature=0.0), max_tokens=MAX_TOKENS)
    return out[0].output_ids


def test_serve_killed_while_its_replica_loads_comes_back(target_dir, expected, tmp_path):
    from jobs.bench.serve_faults import run_serve_fault
    from toy_drafter import export_random_drafter

    drafter = export_random_drafter(target_dir, tmp_path / "drafter")
    args = ["--drafter", str(drafter), "--target", str(target_dir), "--replicas", "1", "--threads", "1",
            "--profile-batch-sizes", "1", "2", "--cache-dir", str(tmp_path / "cache"), "--ready-wait-s", "5"]
    r = run_serve_fault("deploying", "SIGKILL", args, _free_port(), tmp_path / "logs", "SmolLM2-135M-Instruct",
                        PROMPT, expected, ready_timeout=300)
    # Ray's per-node agents of a SIGKILLed cluster linger while they wait on its dead GCS (about a minute): they
    # neither block the restart nor outlive it; nothing else of the killed run is left 30 s after the kill
    assert all("Agent" in x for x in r.leftovers), f"processes of the killed run still alive: {r.leftovers}"
    assert r.leftovers_at_end == [], f"processes of the killed run alive after the restart: {r.leftovers_at_end}"
    assert r.restart_ready_s is not None and r.restart_ready_s < 300, r.notes
    assert r.output_equal, "the restarted server's greedy output differs from the target's"
