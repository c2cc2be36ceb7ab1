"""What a long prompt does to the requests decoding beside it: N short streams decode (plain decoding, one engine, no
Serve) while, in half of the runs, a long prompt (default 1,500 tokens) arrives a few rounds in and is prefilled in
chunks.  For each chunking policy it reports the streams' inter-token latency (p50 / p95 over every token of every
stream), the long prompt's time to first token, and the ratio of the p95 with the long prompt to the p95 without it.

Policies (``SpeculativeEngine``): ``budget`` = chunks up to what --max-num-batched-tokens leaves beside the decode
rows (vLLM's chunked prefill); ``priced x`` = chunks the replica's SPS cost table prices within x times the decode
rows' own round (``prefill_slowdown``, the server's default 2).  Runs of every (policy, with / without) are
interleaved, order alternating, --reps times.

    python -m jobs.bench prefill_interference --streams 15 --long-prompt-tokens 1500 --reps 3
"""
from __future__ import annotations

import statistics
import time

from jobs.bench.load import add_prompt_arguments, load_prompts
from pipeline.core.runtime import torch_threads
from pipeline.data.prompts import chat_prompt_ids
from pipeline.data.target_model import resolve_target
from pipeline.engine.cost_table import ProfileSpec, load_or_profile_cost_table
from pipeline.engine.engine import SpecConfig, SpeculativeEngine
from pipeline.engine.target_runner import TargetRunner, auto_precision
from pipeline.ops.sampling import SamplingParams

NAME = "prefill_interference"
HELP = "inter-token latency of N decoding streams with and without a long prompt prefilled beside them, per chunking"


def add_arguments(ap) -> None:
    ap.add_argument("--target", default=None, help="target HF folder (default: the prepared SmolLM2)")
    ap.add_argument("--dtype", default="auto", help="target precision (auto: as jobs.serve picks it)")
    ap.add_argument("--streams", type=int, default=15, help="short requests decoding at once")
    ap.add_argument("--max-tokens", type=int, default=64, help="tokens each short stream generates")
    ap.add_argument("--long-prompt-tokens", type=int, default=1500)
    ap.add_argument("--arrive-after", type=int, default=4, help="decode rounds before the long prompt arrives")
    ap.add_argument("--max-num-batched-tokens", type=int, default=256)
    ap.add_argument("--slowdowns", type=float, nargs="+", default=[2.0], help="prefill_slowdown values to compare")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    add_prompt_arguments(ap)


def percentile(xs: list, q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def run(args, harness) -> dict:
    from transformers import AutoTokenizer

    if args.streams < 1 or args.reps < 1 or args.long_prompt_tokens < 2 or min(args.slowdowns) <= 1:
        raise SystemExit("--streams, --reps must be >= 1, --long-prompt-tokens >= 2, every --slowdowns > 1")
    torch_threads(args.threads)
    target = resolve_target(args.target)
    tok = AutoTokenizer.from_pretrained(str(target))
    dtype = auto_precision("cpu") if args.dtype == "auto" else args.dtype
    prompts = [chat_prompt_ids(tok, p) for p in load_prompts(args)]
    filler = tok.encode(" ".join(load_prompts(args)) * 50)
    long_prompt = (filler * (args.long_prompt_tokens // max(len(filler), 1) + 1))[:args.long_prompt_tokens]
    runner = TargetRunner.from_pretrained(str(target), dtype=dtype, device="cpu")
    cost, _, _ = load_or_profile_cost_table(runner, ProfileSpec(target=str(target), dtype=dtype), 1)
    policies = {"budget": None} | {f"priced {x:g}": x for x in args.slowdowns}
    greedy = SamplingParams(temperature=0.0)
    print(f"target {target.name} ({dtype}), {args.streams} streams x {args.max_tokens} tokens, a "
          f"{len(long_prompt)}-token prompt after {args.arrive_after} rounds, budget {args.max_num_batched_tokens} "
          f"tokens per round, {args.threads} threads", flush=True)

    def case(slowdown, with_long: bool):
        def one(rep):
            eng = SpeculativeEngine(runner, None, SpecConfig(), tokenizer=tok,
                                    max_num_batched_tokens=args.max_num_batched_tokens, prefill_slowdown=slowdown,
                                    round_cost=cost.step_time if slowdown else None)
            short = [eng.add_request(prompts[(rep + i) % len(prompts)], greedy, args.max_tokens, ignore_eos=True)
                     for i in range(args.streams)]
            last = {}  # stream -> time of its last token
            gaps = []
            long_id, long_t0, ttft, rounds = None, None, None, 0
            while eng.has_unfinished():
                if with_long and long_id is None and rounds == args.arrive_after:
                    long_id, long_t0 = eng.add_request(long_prompt, greedy, 4, ignore_eos=True), time.perf_counter()
                outs = eng.step()
                now = time.perf_counter()
                rounds += 1
                for o in outs:
                    if o.request_id == long_id and ttft is None and o.new_ids:
                        ttft = now - long_t0
                    elif o.request_id in short and o.new_ids:
                        if o.request_id in last:  # a token gap (per token, for rounds that gave several)
                            gaps.append((now - last[o.request_id]) / len(o.new_ids))
                        last[o.request_id] = now
            return {"itl_p50_ms": 1e3 * statistics.median(gaps), "itl_p95_ms": 1e3 * percentile(gaps, 0.95),
                    "ttft_long_s": ttft if ttft is not None else float("nan")}
        return one

    cases = {}
    for name, x in policies.items():
        cases[f"{name} / alone"] = case(x, False)
        cases[f"{name} / long prompt"] = case(x, True)
    s = harness.interleave(cases, args.reps, warmup=1)
    rows, out = [], {}
    for name in policies:
        alone, busy = f"{name} / alone", f"{name} / long prompt"
        r = {"alone_p50_ms": s.median(alone, "itl_p50_ms"), "alone_p95_ms": s.median(alone, "itl_p95_ms"),
             "long_p50_ms": s.median(busy, "itl_p50_ms"), "long_p95_ms": s.median(busy, "itl_p95_ms"),
             "ttft_long_s": s.median(busy, "ttft_long_s")}
        r["p95_ratio"] = r["long_p95_ms"] / r["alone_p95_ms"]
        out[name] = r
        rows.append([name, f"{r['alone_p50_ms']:.1f}", f"{r['alone_p95_ms']:.1f}", f"{r['long_p50_ms']:.1f}",
                     f"{r['long_p95_ms']:.1f}", f"{r['p95_ratio']:.2f}", f"{r['ttft_long_s']:.2f}"])
    harness.table(f"inter-token latency of {args.streams} streams (ms, medians of {args.reps} runs), alone and with "
                  f"a {len(long_prompt)}-token prompt prefilled beside them",
                  ["chunking", "alone p50", "alone p95", "with prompt p50", "with prompt p95", "p95 ratio",
                   "long prompt TTFT s"], rows)
    return {"dtype": dtype, "streams": args.streams, "long_prompt_tokens": len(long_prompt), "policies": out,
            "cost_table": dict(cost.points)}
