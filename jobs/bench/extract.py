"""Hidden-state extraction throughput vs plain vLLM prefill of the same token sequences.

Two Ray actors hold warm engines - A: plain vLLM (prefill, 1 output token), B: the same engine with the
extract_hidden_states connector, returning the tensors - and the driver calls them INTERLEAVED (A B, B A, ...; one
at a time, never both engines at once) on the same batch, so machine noise hits both alike.  Prints per-repetition
rates, medians and the ratio extraction tok/s / prefill tok/s (goal >= 0.8).  Also reports bytes per token stored.

    python -m jobs.bench extract --responses work/miniature/responses --samples 32 --reps 5

Without --responses it uses synthetic token sequences of --seq-len tokens."""
from __future__ import annotations

import random
import time

import pyarrow as pa

from actors.extraction import _IN_SCHEMA, VLLMExtractor
from actors.vllm_engine import build_llm
from pipeline.core.runtime import init_ray
from pipeline.data.shards import ShardSet
from pipeline.stores.base import bytes_per_token
from pipeline.data.target_model import num_layers, resolve_target

NAME = "extract"
HELP = "hidden-state extraction tok/s vs plain vLLM prefill of the same sequences (two warm Ray actors)"


def add_arguments(ap) -> None:
    ap.add_argument("--responses", default=None, help="stage-1 output folder to take sequences from")
    ap.add_argument("--target", default=None, help="target HF folder (default: prepared SmolLM2-135M)")
    ap.add_argument("--samples", type=int, default=16, help="sequences per batch")
    ap.add_argument("--seq-len", type=int, default=384, help="synthetic sequence length (without --responses)")
    ap.add_argument("--reps", type=int, default=5, help="interleaved repetitions")
    ap.add_argument("--layer-ids", default="2,15,28")
    ap.add_argument("--no-target-lse", action="store_true",
                    help="skip the full-vocabulary logsumexp per token (the extractor's extra LM-head pass)")


def run(args, harness) -> dict:
    if args.samples < 2 or args.reps < 1:
        raise SystemExit(f"--samples must be >= 2 and --reps >= 1, got {args.samples}, {args.reps}")
    ray = init_ray(num_cpus=2)
    target = str(resolve_target(args.target))
    L = num_layers(target)
    ids = [int(x) for x in args.layer_ids.split(",")]
    if args.responses:
        seqs = [r["prompt_ids"] + r["response_ids"] for r in ShardSet(args.responses, "request_id").iter_rows()]
        seqs = seqs[: args.samples]
        if not seqs:
            raise SystemExit(f"--responses {args.responses}: no rows")
    else:
        rng = random.Random(0)
        seqs = [[rng.randrange(100, 40000) for _ in range(args.seq_len)] for _ in range(args.samples)]
    max_len = max(len(s) for s in seqs) + 8
    ntok = sum(len(s) for s in seqs)

    # each engine is bound to its own core (vLLM's CPU backend binds its OpenMP threads; two engines left on
    # "auto" would share one core while the other idles)
    @ray.remote(num_cpus=1, runtime_env={"env_vars": {"VLLM_CPU_OMP_THREADS_BIND": "0", "OMP_NUM_THREADS": "1"}})
    class Prefill:
        def __init__(self):
            self.llm = build_llm(target, max_model_len=max_len)

        def run(self, seqs):
            from vllm import SamplingParams

            t = time.perf_counter()
            self.llm.generate([{"prompt_token_ids": s} for s in seqs], SamplingParams(max_tokens=1, temperature=0),
                              use_tqdm=False)
            return time.perf_counter() - t

    @ray.remote(num_cpus=1, runtime_env={"env_vars": {"VLLM_CPU_OMP_THREADS_BIND": "1", "OMP_NUM_THREADS": "1"}})
    class Extract:
        def __init__(self):
            self.ex = VLLMExtractor(target, ids, L, max_len, target_lse=not args.no_target_lse)

        def run(self, seqs):
            t = time.perf_counter()
            out = self.ex(pa.Table.from_pylist([{"request_id": str(i), "input_ids": s, "loss_mask": [1] * len(s)}
                                                for i, s in enumerate(seqs)], schema=_IN_SCHEMA))
            assert out.num_rows == len(seqs)
            return time.perf_counter() - t

        def timers(self):
            return dict(self.ex.timers)

    a, b = Prefill.remote(), Extract.remote()
    ray.get([a.run.remote(seqs[:2]), b.run.remote(seqs[:2])])  # warm-up
    cases = {"prefill": lambda rep: ray.get(a.run.remote(seqs)),  # seconds measured inside the actor
             "extraction": lambda rep: ray.get(b.run.remote(seqs))}

    def show(case, rep, v):
        print(f"rep {rep}: {case:10s} {ntok / v['value']:8.0f} tok/s", flush=True)

    s = harness.interleave(cases, args.reps, label="prefill vs extraction", on_call=show)
    ma, mb = s.median("prefill", "value"), s.median("extraction", "value")
    print(f"\n{len(seqs)} sequences, {ntok} tokens, layers {ids} + final hidden")
    print(f"median prefill    {ntok / ma:8.0f} tok/s")
    print(f"median extraction {ntok / mb:8.0f} tok/s")
    print(f"extraction / prefill = {ma / mb:.2f}x  (goal >= 0.8)")
    tm = ray.get(b.timers.remote())
    total = sum(tm.values())
    print("extraction time by part (all calls incl. warm-up): "
          + ", ".join(f"{k} {v:.2f}s ({100 * v / max(total, 1e-9):.0f}%)" for k, v in tm.items()))
    per_token = bytes_per_token(len(ids), 576)
    print(f"stored bytes per token: {per_token}")
    harness.compare(s, "value", baseline="prefill", unit="s per batch", title=f"seconds per batch of {ntok} tokens")
    return {"sequences": len(seqs), "tokens": ntok, "layer_ids": ids, "prefill_tok_s": ntok / ma,
            "extraction_tok_s": ntok / mb, "extraction_over_prefill": ma / mb, "extraction_parts_s": tm,
            "stored_bytes_per_token": per_token}
