"""One user, the load test's prompts: no speculation vs the load-aware (Algorithm 1) scheduler (--systems: fixed depth
too), WITHOUT Ray Serve - to tell the engine's cost from the serving path's.  Two layers, each interleaved per prompt
(order alternating), after one warm-up pass:

  engine   pipeline.engine.engine.SpeculativeEngine.generate, one request at a time
  replica  serve_app.replica.EngineReplica (the Serve deployment's class, its continuous-batching loop and event
           stream) driven in this process, no HTTP / ingress / Ray; the replicas take turns on one engine thread

Prints tokens/s per system (over all measured passes, and the median of the passes), the ratio load-aware / no-spec,
the engine timers (drafting time, skipped drafting rounds) and the target forward's time per kind of round:
decode (every row a decode / verification block; split into rounds of one token per row and rounds that verified
drafts), mixed (prompts prefilled beside decode rows) and prefill only.
Compare with `python -m jobs.bench load --systems none hardware --concurrency 1` (through Serve and HTTP).

--batch N: N requests at once - one engine batch (engine level), N concurrent streams into the replica (replica
level): the load test's concurrency N without Serve; --prompts takes real benchmark prompts like the load test does.
--requests-per-stream K (replica level): each stream sends K requests one after another, as the load test's
closed-loop clients do, so requests finish and new prompts are prefilled beside the others' decoding.
--layouts mixed padded: every system also with the target runner's older prefill layout (every row of a round that
prefills a prompt padded to the prompt's length, `TargetRunner.short_block` above any prompt), interleaved with the
current one.

    python -m jobs.bench one_user --drafter work/gpu/train_dspark/drafter --passes 3
    python -m jobs.bench one_user --drafter DIR --level engine --batch 16 \\
        --prompts ../shared/data/eval/gsm8k.jsonl --prompt-limit 32 --max-tokens 64 --passes 2
    python -m jobs.bench one_user --drafter DIR --level replica --batch 16 --requests-per-stream 2 \\
        --dtype bfloat16:packed --stream-interval 8 --layouts mixed padded --max-tokens 128 \\
        --prompts ../shared/data/eval/gsm8k.jsonl --prompt-limit 64 --passes 3
"""
from __future__ import annotations

import asyncio
import statistics
from dataclasses import dataclass, field

import torch

from jobs.bench.load import add_prompt_arguments, load_prompts, random_drafter
from pipeline.engine.cost_table import ProfileSpec, load_or_profile_cost_table
from pipeline.engine.engine import SpecConfig, SpeculativeEngine
from pipeline.engine.scheduler import make_load_aware_scheduler
from pipeline.eval.evaluation import load_drafter_for
from pipeline.data.prompts import chat_prompt_ids, end_of_turn_ids
from pipeline.ops.sampling import SamplingParams
from pipeline.data.target_model import resolve_target
from pipeline.engine.target_runner import TargetRunner

NAME = "one_user"
HELP = "no-spec vs load-aware speculation for one user (or --batch N), engine and replica level, without Serve"

SCHEDULERS = ["none", "fixed", "hardware"]  # no speculation, every draft verified (num_speculative_tokens), Algorithm 1
PADDED_SHORT_BLOCK = 1 << 30  # no prompt is longer: every row of a prefilling round is padded to the longest


def add_arguments(p) -> None:
    p.add_argument("--drafter", default=None,
                   help="exported DSpark checkpoint folder (default: an untrained 1-layer drafter, a plumbing check "
                        "whose speculation accepts next to nothing)")
    p.add_argument("--target", default=None, help="target HF folder (default: the prepared SmolLM2)")
    p.add_argument("--level", nargs="+", default=["engine", "replica"], choices=["engine", "replica"])
    p.add_argument("--systems", nargs="+", default=["none", "hardware"], choices=SCHEDULERS,
                   help="none (no speculation), fixed (every draft verified), hardware (Algorithm 1, load-aware); "
                        "none always runs (the ratios' base)")
    p.add_argument("--passes", type=int, default=3, help="measured passes over the prompts (after one warm-up)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batch", type=int, default=1,
                   help="requests at once: one engine batch / concurrent replica streams")
    p.add_argument("--requests-per-stream", type=int, default=1,
                   help="replica level: requests each stream sends one after another (closed loop)")
    p.add_argument("--dtype", default="float32",
                   help="target precision, as jobs.serve --dtype (float32, bfloat16, bfloat16:packed, ...); the "
                        "drafter follows it as in the Serve replica")
    p.add_argument("--stream-interval", type=int, default=1,
                   help="replica level: tokens per streamed event after the first, as jobs.serve --stream-interval")
    p.add_argument("--ignore-eos", action="store_true", help="generate --max-tokens tokens for every request")
    p.add_argument("--layouts", nargs="+", default=["mixed"], choices=["mixed", "padded"],
                   help="target runner layouts of a round that prefills prompts beside decode rows: mixed (the "
                        "runner's) and padded (every row padded to the prompt), interleaved")
    add_prompt_arguments(p)


@dataclass
class System:
    """One measured configuration: a scheduler on an engine, with a prefill layout."""

    name: str
    scheduler: str  # one of SCHEDULERS
    engine: SpeculativeEngine
    runner: TargetRunner
    layout: str
    timers: dict = field(default_factory=dict)  # growth of the engine timers over the measured calls
    shapes: list = field(default_factory=list)  # the engine's shape_log entries of the measured calls

    def call(self, fn, measuring: bool):
        """fn() with this system's layout; keeps the timers and round shapes of measured calls."""
        self.runner.short_block = PADDED_SHORT_BLOCK if self.layout == "padded" else self.default_short_block
        before, self.engine.shape_log = self.engine.timers.to_dict(), []
        try:
            out = fn()
        finally:
            self.runner.short_block = self.default_short_block
        if measuring:
            for k, v in self.engine.timers.to_dict().items():
                self.timers[k] = self.timers.get(k, 0) + v - before.get(k, 0)
            self.shapes.extend(self.engine.shape_log)
        self.engine.shape_log = None
        return out

    def __post_init__(self):
        self.default_short_block = self.runner.short_block


def make_systems(engines: dict, runners: dict, layouts: list[str]) -> dict[str, System]:
    """{scheduler: engine} x layouts -> {name: System}; names 'none', 'hardware', 'none/padded', ..."""
    out = {}
    for layout in layouts:
        for sched in engines:
            name = sched if layout == "mixed" else f"{sched}/{layout}"
            out[name] = System(name, sched, engines[sched], runners[sched], layout)
    return out


def interleaved(harness, level, run_one, batches, passes, systems: dict[str, System]):
    """run_one(system, batch) -> tokens; one warm-up pass + ``passes`` measured passes, every batch of prompts once
    per pass for each system (order alternating).  Returns {name: [tok/s of each measured pass]} and
    {name: (tokens, seconds)} over all measured passes."""
    state = {"measuring": False}
    cases = {n: (lambda rep, s=s: {"tokens": s.call(lambda: run_one(s, batches[rep % len(batches)]),
                                                     state["measuring"])})
             for n, s in systems.items()}
    smp = harness.interleave(cases, passes * len(batches), warmup=len(batches), label=level,
                             after_warmup=lambda: state.update(measuring=True))
    per_pass = {}
    for n in systems:
        toks, walls = smp.values(n, "tokens"), smp.values(n, "wall_s")
        nb = len(batches)
        per_pass[n] = [sum(toks[i:i + nb]) / sum(walls[i:i + nb]) for i in range(0, len(toks), nb)]
    return per_pass, {n: (smp.total(n, "tokens"), smp.total(n, "wall_s")) for n in systems}


def round_kinds(shapes: list[tuple]) -> dict[str, dict]:
    """shape_log entries -> {kind: {rounds, target_ms median / min / max, rows median}} for the kinds decode (no
    prompt in the round), mixed (prompts beside decode rows), prefill (prompts only)."""
    kinds: dict[str, list] = {"decode": [], "mixed": [], "prefill": []}
    for rows, prefill, target_s, tokens in shapes:
        kind = "decode" if prefill == 0 else ("prefill" if prefill == rows else "mixed")
        kinds[kind].append((target_s * 1e3, rows))
    return _summaries(kinds)


def decode_split(shapes: list[tuple]) -> dict[str, dict]:
    """The decode rounds of shape_log split by whether they verified drafts: "1 token per row" (plain decoding, or a
    round the scheduler did not draft) and "verify" (some row verified drafts)."""
    kinds: dict[str, list] = {"1 token per row": [], "verify": []}
    for rows, prefill, target_s, tokens in shapes:
        if prefill == 0:
            kinds["1 token per row" if tokens == rows else "verify"].append((target_s * 1e3, rows))
    return _summaries(kinds)


def _summaries(kinds: dict[str, list]) -> dict[str, dict]:
    out = {}
    for k, v in kinds.items():
        if v:
            ms = [m for m, _ in v]
            out[k] = {"rounds": len(v), "target_ms_median": round(statistics.median(ms), 1),
                      "target_ms_min": round(min(ms), 1), "target_ms_max": round(max(ms), 1),
                      "rows_median": statistics.median(r for _, r in v)}
    return out


def report(harness, level, systems: dict[str, System], per_pass, tot) -> dict:
    rate = {n: k / sec for n, (k, sec) in tot.items()}
    med = {n: statistics.median(v) for n, v in per_pass.items()}
    timers = {n: {k: (round(v, 2) if isinstance(v, float) else v) for k, v in s.timers.items()}
              for n, s in systems.items()}
    for n in systems:
        print(f"[{level}] {n:16s} {rate[n]:7.2f} tok/s  timers {timers[n]}")
    ratios = {}
    for n in systems:
        for sched in ("fixed", "hardware"):
            if n.startswith(sched):
                base = n.replace(sched, "none", 1)
                ratios[f"{n} / {base}"] = med[n] / med[base]
        if n.endswith("/padded"):
            mixed = n[:-len("/padded")]
            ratios[f"{mixed} / {n}"] = med[mixed] / med[n]
    for k, v in ratios.items():
        print(f"[{level}] {k}: {v:.3f} (medians of the passes)", flush=True)
    harness.table(f"{level}: tokens/s, each measured pass and their median",
                  ["system", "tokens", "seconds", "tok/s (all)", "per pass", "median", "/ none"],
                  [[n, f"{k:.0f}", f"{sec:.2f}", f"{rate[n]:.2f}", " / ".join(f"{x:.1f}" for x in per_pass[n]),
                    f"{med[n]:.2f}", f"{med[n] / med['none']:.3f}"] for n, (k, sec) in tot.items()])
    kinds = {n: round_kinds(s.shapes) for n, s in systems.items()}
    split = {n: decode_split(s.shapes) for n, s in systems.items()}
    harness.table(f"{level}: target forward per kind of round (ms: median, min-max)",
                  ["system", "kind", "rounds", "median rows", "target ms", "min - max"],
                  [[n, k, v["rounds"], f"{v['rows_median']:g}", f"{v['target_ms_median']:.1f}",
                    f"{v['target_ms_min']:.0f} - {v['target_ms_max']:.0f}"]
                   for n, ks in kinds.items() for k, v in list(ks.items()) + [(f"decode, {d}", x) for d, x in
                                                                                split[n].items()]])
    return {"tok_s": rate, "tok_s_per_pass": per_pass, "tok_s_median": med,
            "load_aware_over_no_spec": med["hardware"] / med["none"] if "hardware" in med else None,
            "ratios": ratios, "timers": timers, "round_kinds": kinds, "decode_split": split}


def systems_of(args) -> list[str]:
    """The schedulers to run, 'none' first (the base of every ratio), each once."""
    return ["none"] + [n for n in SCHEDULERS if n != "none" and n in args.systems]


def run(args, harness) -> dict:
    if args.batch < 1 or args.passes < 1 or args.requests_per_stream < 1:
        raise SystemExit(f"--batch, --passes and --requests-per-stream must be >= 1, got {args.batch}, "
                         f"{args.passes}, {args.requests_per_stream}")
    if args.stream_interval < 1:
        raise SystemExit(f"--stream-interval must be >= 1, got {args.stream_interval}")
    if args.requests_per_stream > 1 and args.level != ["replica"]:
        raise SystemExit("--requests-per-stream needs --level replica (the engine level runs closed batches)")
    from transformers import AutoTokenizer

    torch.set_num_threads(args.threads)
    target = str(resolve_target(args.target))
    tok = AutoTokenizer.from_pretrained(target)
    prompts = [chat_prompt_ids(tok, p) for p in load_prompts(args)]
    if args.drafter is None:
        args.drafter = random_drafter(target, harness.out_dir / "random_drafter")
    # one unit of work = --batch x --requests-per-stream prompts (cycling through the list); --batch 1: one prompt
    per_unit = args.batch * args.requests_per_stream
    batches = [[prompts[(i + j) % len(prompts)] for j in range(per_unit)] for i in range(0, len(prompts), per_unit)]
    result = {}
    from serve_app.replica import EngineReplica, engine_executor

    # every torch computation of both levels on ONE engine thread (the replicas take turns on it): a second thread
    # that runs OpenMP regions gets a worker pool of its own, and libgomp, then counting more threads than CPUs,
    # slows every parallel region of all of them -- which a Serve replica, one process with one engine thread, does
    # not pay (a replica level after an engine level on the main thread: 38 instead of 27 ms per 1-row forward)
    shared = engine_executor(args.threads)

    def engine_level() -> dict:
        runner = TargetRunner.from_pretrained(target, dtype=args.dtype, device="cpu", max_seq_len=2048)
        eos = set(runner.config.eos_token_ids) | set(end_of_turn_ids(tok))
        d = load_drafter_for(args.drafter, target, "auto", args.dtype)
        cost, _, _ = load_or_profile_cost_table(runner, ProfileSpec(target=str(target), dtype=args.dtype),
                                                d.cfg.block_size + 1)
        specs = {"fixed": SpecConfig(method=d.cfg.kind, scheduler="fixed"),
                 "hardware": SpecConfig(method=d.cfg.kind, scheduler=make_load_aware_scheduler("hardware", cost))}
        engines = {"none": SpeculativeEngine(runner, None, SpecConfig(), tokenizer=tok, eos_token_ids=eos)}
        engines.update({n: SpeculativeEngine(runner, d, specs[n], tokenizer=tok, eos_token_ids=eos)
                        for n in systems_of(args) if n != "none"})
        systems = make_systems(engines, {n: runner for n in engines}, args.layouts)

        def run_one(s, batch):
            outs = s.engine.generate(batch, SamplingParams(temperature=0.0), max_tokens=args.max_tokens,
                                     ignore_eos=args.ignore_eos)
            return sum(len(o.output_ids) for o in outs)

        return report(harness, "engine", systems,
                      *interleaved(harness, "engine", run_one, batches, args.passes, systems))

    if "engine" in args.level:
        result["engine"] = shared.submit(engine_level).result()

    if "replica" in args.level:
        mb = max(8, args.batch)  # the replica's default max_batch, or room for all the streams
        common = dict(target=target, threads=args.threads, max_batch=mb, dtype=args.dtype,
                      stream_interval=args.stream_interval)
        reps = {"none": EngineReplica(dict(common, scheduler="none"), executor=shared)}
        reps.update({n: EngineReplica(dict(common, drafter=args.drafter, scheduler=n), executor=shared)
                     for n in systems_of(args) if n != "none"})
        systems = make_systems({n: r.engine for n, r in reps.items()}, {n: r.runner for n, r in reps.items()},
                               args.layouts)
        loop = asyncio.new_event_loop()

        async def one(rep, ids):
            k = 0
            req = dict(prompt_ids=ids, max_tokens=args.max_tokens, temperature=0.0, ignore_eos=args.ignore_eos)
            async for ev in rep.generate(req):
                k += len(ev.get("token_ids", []))
            return k

        async def stream(rep, queue):  # a closed-loop client: the next request when the last one finished
            k = 0
            while queue:
                k += await one(rep, queue.pop(0))
            return k

        async def streams(s, batch):
            rep = reps[s.scheduler]
            queues = [batch[i::args.batch] for i in range(args.batch)]
            return sum(await asyncio.gather(*(stream(rep, q) for q in queues)))

        try:
            result["replica"] = report(harness, "replica", systems, *interleaved(
                harness, "replica", lambda s, batch: loop.run_until_complete(streams(s, batch)), batches,
                args.passes, systems))
        finally:
            for r in reps.values():
                loop.run_until_complete(r.aclose())
            loop.close()
    shared.shutdown()
    return result
