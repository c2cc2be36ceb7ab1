"""One user, the load test's prompts: no speculation vs the load-aware (Algorithm 1) scheduler, WITHOUT Ray Serve -
to tell the engine's cost from the serving path's.  Two layers, each interleaved per prompt (order alternating),
after one warm-up pass:

  engine   pipeline.engine.SpeculativeEngine.generate, one request at a time
  replica  serve_app.replica.EngineReplica (the Serve deployment's class, its continuous-batching loop and event
           stream) driven in this process, no HTTP / ingress / Ray

Prints tokens/s per system, the ratio load-aware / no-spec, and the engine timers (drafting time, skipped drafting
rounds).  Compare with `scripts/load_test.py --systems none hardware --concurrency 1` (through Serve and HTTP).

    .venv/bin/python scripts/bench_one_user.py --drafter work/gpu/train_dspark/drafter --passes 3
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
    return p.parse_args(argv)


def load_test_prompts() -> list[str]:
    import importlib.util

    spec = importlib.util.spec_from_file_location("load_test", Path(__file__).with_name("load_test.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return list(mod.PROMPTS)


def interleaved(run_one, names, prompts, passes):
    """run_one(name, prompt_ids) -> tokens; returns {name: (tokens, seconds)} over the measured passes."""
    tot = {n: [0, 0.0] for n in names}
    for p in range(passes + 1):
        for i, ids in enumerate(prompts):
            for n in (names if (p + i) % 2 == 0 else names[::-1]):
                t0 = time.perf_counter()
                k = run_one(n, ids)
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
    prompts = [chat_prompt_ids(tok, p) for p in load_test_prompts()]
    names = ["none", "hardware"]

    def timers(engine):
        t = engine.timers
        return dict(steps=t.steps, skipped_drafts=t.skipped_drafts, draft_s=round(t.draft_s, 2),
                    target_s=round(t.target_s, 2), total_s=round(t.total_s, 2))

    if "engine" in args.level:
        from pipeline.checkpoint import load_drafter
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
        tot = interleaved(lambda n, ids: len(engines[n].generate([ids], SamplingParams(temperature=0.0),
                                                                 max_tokens=args.max_tokens)[0].output_ids),
                          names, prompts, args.passes)
        report("engine", tot, {n: timers(e) for n, e in engines.items()})

    if "replica" in args.level:
        from serve_app.replica import EngineReplica

        reps = {"none": EngineReplica(dict(target=target, scheduler="none", threads=args.threads)),
                "hardware": EngineReplica(dict(target=target, drafter=args.drafter, scheduler="hardware",
                                               threads=args.threads))}
        loop = asyncio.new_event_loop()

        async def one(n, ids):
            k = 0
            async for ev in reps[n].generate(dict(prompt_ids=ids, max_tokens=args.max_tokens, temperature=0.0)):
                k += len(ev.get("token_ids", []))
            return k

        tot = interleaved(lambda n, ids: loop.run_until_complete(one(n, ids)), names, prompts, args.passes)
        report("replica", tot, {n: timers(r.engine) for n, r in reps.items()})


if __name__ == "__main__":
    reexec_for_process_env()
    main()
