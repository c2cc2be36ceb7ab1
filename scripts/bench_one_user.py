"""One user, the load test's prompts: no speculation vs the load-aware (Algorithm 1) scheduler, WITHOUT Ray Serve -
to tell the engine's cost from the serving path's.  Two layers, each interleaved per prompt (order alternating),
after one warm-up pass:

  engine   pipeline.engine.SpeculativeEngine.generate, one request at a time
  replica  serve_app.replica.EngineReplica (the Serve deployment's class, its continuous-batching loop and event
           stream) driven in this process, no HTTP / ingress / Ray

Prints tokens/s per system, the ratio load-aware / no-spec, and the engine timers (drafting time, skipped drafting
rounds).  Compare with `scripts/load_test.py --systems none hardware --concurrency 1` (through Serve and HTTP).

--batch N: N requests at once - one engine batch (engine level), N concurrent streams into the replica (replica
level): the load test's concurrency N without Serve; --prompts takes real benchmark prompts like load_test.py does.

    .venv/bin/python scripts/bench_one_user.py --drafter work/gpu/train_dspark/drafter --passes 3
    .venv/bin/python scripts/bench_one_user.py --drafter DIR --level engine --batch 16 \
        --prompts ../shared/data/eval/gsm8k.jsonl --prompt-limit 32 --max-tokens 64 --passes 2
"""
from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pipeline.runtime import apply_env, reexec_for_process_env  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--drafter", required=True, help="exported DSpark checkpoint folder")
    p.add_argument("--target", default=None, help="target HF folder (default: the prepared SmolLM2)")
    p.add_argument("--level", nargs="+", default=["engine", "replica"], choices=["engine", "replica"])
    p.add_argument("--passes", type=int, default=3, help="measured passes over the prompts (after one warm-up)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batch", type=int, default=1,
                   help="requests at once: one engine batch / concurrent replica streams")
    p.add_argument("--prompts", nargs="+", type=Path, default=None, metavar="JSONL",
                   help="prompt files as in load_test.py (default: its 8 built-in chat prompts)")
    p.add_argument("--prompt-limit", type=int, default=64, help="with --prompts: at most this many (seeded subsample)")
    args = p.parse_args(argv)
    if args.batch < 1:
        p.error(f"--batch must be >= 1, got {args.batch}")
    return args


def load_test_prompts(args) -> list[str]:
    """The load test's prompts: its --prompts files or its built-in chat prompts (scripts/load_test.load_prompts)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("load_test", Path(__file__).with_name("load_test.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.load_prompts(args)


def interleaved(run_one, names, units, passes, after_warmup=lambda: None):
    """run_one(name, unit) -> tokens, a unit being a batch of prompt ids; returns {name: (tokens, seconds)} over the
    measured passes; after_warmup() runs once, before the first measured pass."""
    tot = {n: [0, 0.0] for n in names}
    for p in range(passes + 1):
        if p == 1:
            after_warmup()
        for i, unit in enumerate(units):
            for n in (names if (p + i) % 2 == 0 else names[::-1]):
                t0 = time.perf_counter()
                k = run_one(n, unit)
                if p:
                    tot[n][0] += k
                    tot[n][1] += time.perf_counter() - t0
    return tot


def report(level, tot, timers):
    rate = {n: k / s for n, (k, s) in tot.items()}
    for n in tot:
        print(f"[{level}] {n:9s} {rate[n]:6.2f} tok/s  timers {timers[n]}")
    print(f"[{level}] load-aware / no-spec: {rate['hardware'] / rate['none']:.3f}", flush=True)


def main(argv=None):
    args = parse_args(argv)
    apply_env()
    import torch
    from transformers import AutoTokenizer

    from pipeline.prompts import chat_prompt_ids
    from pipeline.target_model import resolve_target

    torch.set_num_threads(args.threads)
    target = str(resolve_target(args.target))
    tok = AutoTokenizer.from_pretrained(target)
    prompts = [chat_prompt_ids(tok, p) for p in load_test_prompts(args)]
    # one unit of work = --batch prompts at once (cycling through the list); --batch 1: one prompt per unit
    batches = [[prompts[(i + j) % len(prompts)] for j in range(args.batch)] for i in range(0, len(prompts), args.batch)]
    names = ["none", "hardware"]

    start = {}  # EngineTimers.to_dict() when the measured passes begin (the warm-up pass is left out)

    def snapshot(engines):
        return lambda: start.update({n: e.timers.to_dict() for n, e in engines.items()})

    def timers(n, engine):
        t = {k: v - start.get(n, {}).get(k, 0) for k, v in engine.timers.to_dict().items()}
        return {k: (round(v, 2) if isinstance(v, float) else v) for k, v in t.items()}

    if "engine" in args.level:
        from pipeline.dspark.checkpoint import load_drafter
        from pipeline.engine import SpecConfig, SpeculativeEngine
        from pipeline.prompts import end_of_turn_ids
        from pipeline.sampling import SamplingParams
        from pipeline.target_runner import TargetRunner
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

        tot = interleaved(run_one, names, batches, args.passes, snapshot(engines))
        report("engine", tot, {n: timers(n, e) for n, e in engines.items()})

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

        tot = interleaved(lambda n, batch: loop.run_until_complete(streams(n, batch)), names, batches, args.passes,
                          snapshot({n: r.engine for n, r in reps.items()}))
        report("replica", tot, {n: timers(n, r.engine) for n, r in reps.items()})


if __name__ == "__main__":
    reexec_for_process_env()
    main()
