"""Benchmark: hidden-state extraction throughput vs plain vLLM prefill of the same token sequences.

Two Ray actors hold warm engines - A: plain vLLM (prefill, 1 output token), B: the same engine with our
extract_hidden_states connector, returning the tensors - and the driver calls them INTERLEAVED (A, B, A, B, ...)
on the same batch, so machine noise hits both alike.  Prints per-repetition times, medians and the ratio
extraction tok/s / prefill tok/s (goal >= 0.8).  Also reports bytes per token stored.

    .venv/bin/python scripts/bench_extract.py --responses work/miniature/responses --samples 32 --reps 5
Without --responses it uses synthetic token sequences of --seq-len tokens."""
from __future__ import annotations

import argparse
import statistics
import time

from pipeline.runtime import apply_env, init_ray


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--responses", default=None, help="stage-1 output folder to take sequences from")
    ap.add_argument("--target", default=None, help="target HF folder (default: prepared SmolLM2-135M)")
    ap.add_argument("--samples", type=int, default=16, help="sequences per batch")
    ap.add_argument("--seq-len", type=int, default=384, help="synthetic sequence length (without --responses)")
    ap.add_argument("--reps", type=int, default=5, help="interleaved repetitions")
    ap.add_argument("--layer-ids", default="2,15,28")
    ap.add_argument("--no-target-lse", action="store_true",
                    help="skip the full-vocabulary logsumexp per token (the extractor's extra LM-head pass)")
    args = ap.parse_args()
    apply_env()
    ray = init_ray(num_cpus=2)
    import random

    import pyarrow as pa

    from actors.extraction import _IN_SCHEMA, VLLMExtractor
    from pipeline.stores.base import bytes_per_token
    from pipeline.target_model import num_layers, resolve_target

    target = str(resolve_target(args.target))
    L = num_layers(target)
    ids = [int(x) for x in args.layer_ids.split(",")]
    if args.responses:
        from pipeline.shards import ShardSet

        seqs = [r["prompt_ids"] + r["response_ids"] for r in ShardSet(args.responses, "request_id").iter_rows()]
        seqs = seqs[: args.samples]
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
            from actors.vllm_engine import build_llm

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
    ta, tb = [], []
    for r in range(args.reps):
        ta.append(ray.get(a.run.remote(seqs)))  # one at a time: never both engines at once
        tb.append(ray.get(b.run.remote(seqs)))
        print(f"rep {r}: prefill {ntok / ta[-1]:8.0f} tok/s   extraction {ntok / tb[-1]:8.0f} tok/s")
    ma, mb = statistics.median(ta), statistics.median(tb)
    print(f"\n{len(seqs)} sequences, {ntok} tokens, layers {ids} + final hidden")
    print(f"median prefill    {ntok / ma:8.0f} tok/s")
    print(f"median extraction {ntok / mb:8.0f} tok/s")
    print(f"extraction / prefill = {ma / mb:.2f}x  (goal >= 0.8)")
    tm = ray.get(b.timers.remote())
    total = sum(tm.values())
    print("extraction time by part (all calls incl. warm-up): "
          + ", ".join(f"{k} {v:.2f}s ({100 * v / max(total, 1e-9):.0f}%)" for k, v in tm.items()))
    print(f"stored bytes per token: {bytes_per_token(len(ids), 576)}")


if __name__ == "__main__":
    from pipeline.runtime import reexec_for_process_env

    reexec_for_process_env()
    main()
