"""One user, the load test's prompts: no speculation vs the load-aware (Algorithm 1) scheduler, WITHOUT Ray Serve -
to tell the engine's cost from the serving path's.  Two layers, each interleaved per prompt (order alternating),
after one warm-up pass:

  engine   pipeline.engine.SpeculativeEngine.generate, one request at a time
  replica  serve_app.replica.EngineReplica (the Serve deployment's class, its continuous-batching loop and event
           stream) driven in this process, no HTTP / ingress / Ray

Prints tokens/s per system, the ratio load-aware / no-spec, and the engine timers (drafting time, skipped drafting
rounds).  Compare with `python -m jobs.bench load --systems none hardware --concurrency 1` (through Serve and HTTP).

--batch N: N requests at once - one engine batch (engine level), N concurrent streams into the replica (replica
level): the load test's concurrency N without Serve; --prompts takes real benchmark prompts like the load test does.

    python -m jobs.bench one_user --drafter work/gpu/train_dspark/drafter --passes 3
    python -m jobs.bench one_user --drafter DIR --level engine --batch 16 \\
        --prompts ../shared/data/eval/gsm8k.jsonl --prompt-limit 32 --max-tokens 64 --passes 2
"""
from __future__ import annotations

import asyncio

import torch

from jobs.bench.load import add_prompt_arguments, load_prompts
from pipeline.dspark.checkpoint import load_drafter
from pipeline.engine import SpecConfig, SpeculativeEngine
from pipeline.prompts import chat_prompt_ids, end_of_turn_ids
from pipeline.sampling import SamplingParams
from pipeline.target_model import resolve_target
from pipeline.target_runner import TargetRunner

NAME = "one_user"
HELP = "no-spec vs load-aware speculation for one user (or --batch N), engine and replica level, without Serve"

SYSTEMS = ["none", "hardware"]


def add_arguments(p) -> None:
    p.add_argument("--drafter", required=True, help="exported DSpark checkpoint folder")
    p.add_argument("--target", default=None, help="target HF folder (default: the prepared SmolLM2)")
    p.add_argument("--level", nargs="+", default=["engine", "replica"], choices=["engine", "replica"])
    p.add_argument("--passes", type=int, default=3, help="measured passes over the prompts (after one warm-up)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batch", type=int, default=1,
                   help="requests at once: one engine batch / concurrent replica streams")
    add_prompt_arguments(p)


def interleaved(harness, level, run_one, batches, passes, engines):
    """run_one(name, batch) -> tokens over one warm-up pass + ``passes`` measured passes, every batch of prompts
    once per pass for each system (order alternating); returns {name: (tokens, seconds)} over the measured passes
    and the engine timers' growth over them."""
    start = {}  # EngineTimers.to_dict() when the measured passes begin (the warm-up pass is left out)
    cases = {n: (lambda rep, n=n: {"tokens": run_one(n, batches[rep % len(batches)])}) for n in SYSTEMS}
    s = harness.interleave(cases, passes * len(batches), warmup=len(batches), label=level,
                           after_warmup=lambda: start.update({n: e.timers.to_dict() for n, e in engines.items()}))

    def timers(n, engine):
        t = {k: v - start.get(n, {}).get(k, 0) for k, v in engine.timers.to_dict().items()}
        return {k: (round(v, 2) if isinstance(v, float) else v) for k, v in t.items()}

    tot = {n: (s.total(n, "tokens"), s.total(n, "wall_s")) for n in SYSTEMS}
    return tot, {n: timers(n, e) for n, e in engines.items()}


def report(harness, level, tot, timers) -> dict:
    rate = {n: k / sec for n, (k, sec) in tot.items()}
    for n in tot:
        print(f"[{level}] {n:9s} {rate[n]:6.2f} tok/s  timers {timers[n]}")
    ratio = rate["hardware"] / rate["none"]
    print(f"[{level}] load-aware / no-spec: {ratio:.3f}", flush=True)
    harness.table(f"{level}: tokens/s over the measured passes",
                  ["system", "tokens", "seconds", "tok/s", "/ none"],
                  [[n, f"{k:.0f}", f"{sec:.2f}", f"{rate[n]:.2f}", f"{rate[n] / rate['none']:.3f}"]
                   for n, (k, sec) in tot.items()])
    return {"tok_s": rate, "load_aware_over_no_spec": ratio, "timers": timers}


def run(args, harness) -> dict:
    if args.batch < 1 or args.passes < 1:
        raise SystemExit(f"--batch and --passes must be >= 1, got {args.batch}, {args.passes}")
    from transformers import AutoTokenizer

    torch.set_num_threads(args.threads)
    target = str(resolve_target(args.target))
    tok = AutoTokenizer.from_pretrained(target)
    prompts = [chat_prompt_ids(tok, p) for p in load_prompts(args)]
    # one unit of work = --batch prompts at once (cycling through the list); --batch 1: one prompt per unit
    batches = [[prompts[(i + j) % len(prompts)] for j in range(args.batch)] for i in range(0, len(prompts), args.batch)]
    result = {}

    if "engine" in args.level:
        from serve_app.replica import ReplicaOptions, load_or_profile_cost_table, make_load_aware_scheduler

        runner = TargetRunner.from_pretrained(target, dtype="float32", device="cpu", max_seq_len=2048)
        eos = set(runner.config.eos_token_ids) | set(end_of_turn_ids(tok))
        d = load_drafter(args.drafter, target, dtype=runner.dtype, device=runner.device)
        cost, _, _ = load_or_profile_cost_table(runner, ReplicaOptions(target=target, drafter=args.drafter),
                                                d.cfg.block_size + 1)
        spec = SpecConfig(method=d.cfg.kind, scheduler=make_load_aware_scheduler("hardware", cost))
        engines = {"none": SpeculativeEngine(runner, None, SpecConfig(), tokenizer=tok, eos_token_ids=eos),
                   "hardware": SpeculativeEngine(runner, d, spec, tokenizer=tok, eos_token_ids=eos)}

        def run_one(n, batch):
            outs = engines[n].generate(batch, SamplingParams(temperature=0.0), max_tokens=args.max_tokens)
            return sum(len(o.output_ids) for o in outs)

        result["engine"] = report(harness, "engine", *interleaved(harness, "engine", run_one, batches, args.passes,
                                                                  engines))

    if "replica" in args.level:
        from serve_app.replica import EngineReplica

        mb = max(8, args.batch)  # the replica's default max_batch, or room for all the streams
        reps = {"none": EngineReplica(dict(target=target, scheduler="none", threads=args.threads, max_batch=mb)),
                "hardware": EngineReplica(dict(target=target, drafter=args.drafter, scheduler="hardware", max_batch=mb,
                                               threads=args.threads))}
        loop = asyncio.new_event_loop()

        async def one(n, ids):
            k = 0
            async for ev in reps[n].generate(dict(prompt_ids=ids, max_tokens=args.max_tokens, temperature=0.0)):
                k += len(ev.get("token_ids", []))
            return k

        async def streams(n, batch):
            return sum(await asyncio.gather(*(one(n, ids) for ids in batch)))

        result["replica"] = report(harness, "replica", *interleaved(
            harness, "replica", lambda n, batch: loop.run_until_complete(streams(n, batch)), batches, args.passes,
            {n: r.engine for n, r in reps.items()}))
    return result
