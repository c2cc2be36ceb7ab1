"""Bounded loopback load test of the Serve application (serve_app): for each system -- no speculation, fixed depth γ,
load-aware scheduler, and vLLM's own plain decoding behind the same API (--vllm-baselines) -- deploy it locally,
then at each concurrency level run a fixed number of streamed chat requests and report output tokens/s, per-user
tokens/s, median TTFT and the mean verified depth.  A second table says where the time goes: the native engine's
milliseconds per round and busy share (its EngineTimers, read through the replica's stats() around each level) and
the CPU seconds per 1,000 output tokens of the engine replica, the serving path (ingress + HTTP proxy), the load
generator and the rest (psutil, over this process's tree).  Writes results.json + load_test.png (throughput and mean
verified depth vs concurrency) to --out.

All systems are deployed side by side (one Serve application each, under /<system>/v1) and the levels are
INTERLEAVED - for each concurrency, every system in turn (in alternating order), repeated --reps times - so
machine noise hits them alike; the table reports medians over the repetitions.  Stops by itself: a fixed number
of requests per level, a per-request timeout and a global --time-budget (levels not started within the budget are
skipped and reported).

--soak S: instead, S seconds of --soak-clients concurrent streaming clients against the load-aware system, counting
errors and sampling the replicas' resident memory (soak.json, soak.png): the check that a long run neither fails nor
grows.

    python -m jobs.bench load --drafter work/drafter --concurrency 1 2 4 8 16 --max-tokens 32
    python -m jobs.bench load --random-drafter        # plumbing check with an untrained 1-layer drafter
    python -m jobs.bench load --drafter work/drafter --soak 300 --soak-clients 16
"""
from __future__ import annotations

import asyncio
import json
import os
import statistics
import time
from pathlib import Path

import httpx
import psutil
import torch

from pipeline.dspark.checkpoint import export_checkpoint
from pipeline.dspark.config import DrafterConfig
from pipeline.dspark.drafter import DSparkDrafter
from pipeline.eval.evaluation import vllm_baseline_dtypes
from pipeline.data.prompts import read_prompt_files
from pipeline.core.runtime import init_ray
from pipeline.data.subsets import subsample
from pipeline.data.target_model import resolve_target
from serve_app.app import ServeConfig, build_app

NAME = "load"
HELP = "loopback load test of the Serve app: no-spec / fixed / load-aware at several concurrencies (or a soak)"



def add_arguments(p) -> None:
    p.add_argument("--drafter", default=None, help="exported DSpark checkpoint folder")
    p.add_argument("--random-drafter", action="store_true",
                   help="export an untrained 1-layer drafter (reduced vocab) and use it (plumbing check only)")
    p.add_argument("--target", default=None, help="target HF folder (default: the prepared SmolLM2)")
    p.add_argument("--systems", nargs="+", default=["none", "fixed", "hardware"],
                   choices=["none", "fixed", "hardware", "async"], help="schedulers to compare")
    p.add_argument("--vllm-baselines", nargs="+", default=["bfloat16"], metavar="DTYPE",
                   help="precisions of vLLM's own plain decoding (jobs.serve --engine vllm, no drafter) deployed as "
                        "further no-speculation systems vllm-<dtype>; every ratio is against the fastest "
                        "no-speculation system at that concurrency; 'none' = leave vLLM out")
    p.add_argument("--concurrency", nargs="+", type=int, default=[1, 2, 4, 8, 16])
    p.add_argument("--requests-per-level", type=int, default=None,
                   help="requests per concurrency level (default: max(4, 2 x concurrency))")
    add_prompt_arguments(p)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--num-speculative-tokens", "--gamma", type=int, default=None, dest="num_speculative_tokens",
                   help="the verification depth cap: every round for fixed, at most for the load-aware scheduler")
    p.add_argument("--replicas", type=int, default=1)
    p.add_argument("--max-batch", type=int, default=16)
    p.add_argument("--dtype", default="auto", help="the native systems' --dtype (jobs.serve's default: auto)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--prefill-slowdown", type=float, default=0.0,
                   help="the native systems' --prefill-slowdown (0: prompt chunks up to the round's token budget)")
    p.add_argument("--stream-interval", type=int, default=1,
                   help="tokens per streamed event after the first, for every system alike (jobs.serve "
                        "--stream-interval)")
    p.add_argument("--port", type=int, default=8790)
    p.add_argument("--reps", type=int, default=1, help="interleaved repetitions of every (level, system)")
    p.add_argument("--time-budget", type=float, default=900.0, help="seconds for the whole run")
    p.add_argument("--soak", type=float, default=None, help="soak mode: seconds of continuous load")
    p.add_argument("--soak-clients", type=int, default=16)
    p.add_argument("--soak-system", default="hardware", choices=["none", "fixed", "hardware", "async"])
    p.add_argument("--request-timeout", type=float, default=120.0)


def add_prompt_arguments(p) -> None:
    """--prompts / --prompt-limit (shared with the one_user benchmark)."""
    p.add_argument("--prompts", nargs="+", type=Path, default=None, metavar="JSONL",
                   help="prompt files (benchmark / train-prompt JSONL, first user turn, e.g. ../shared/data/eval/"
                        "gsm8k.jsonl); requests cycle through them in order (default: 8 short built-in chat prompts)")
    p.add_argument("--prompt-limit", type=int, default=64,
                   help="with --prompts: at most this many prompts, a seeded subsample across the files")


PROMPTS = ["Explain what a hash map is.", "Write a short poem about autumn.", "What is 17 times 3?",
           "Give three tips for learning a language.", "Describe the water cycle.", "Name five animals.",
           "What does a compiler do?", "Summarise the plot of Cinderella."]


def load_prompts(args) -> list[str]:
    """The texts the clients send: --prompts files (first user turn, seeded subsample) or the built-in PROMPTS."""
    if not args.prompts:
        return list(PROMPTS)
    if args.prompt_limit < 1:
        raise SystemExit(f"--prompt-limit must be >= 1, got {args.prompt_limit}")
    try:
        rows, skips = read_prompt_files(args.prompts)
    except FileNotFoundError as e:
        raise SystemExit(f"--prompts: {e}") from None
    for sk in skips:
        print(f"[load] skipped {sk.request_id}: {sk.reason}", flush=True)
    texts = [r.text for r in subsample(rows, args.prompt_limit)]
    if not texts:
        raise SystemExit(f"--prompts: no usable prompt in {', '.join(map(str, args.prompts))}")
    return texts


def random_drafter(target: str, out: Path) -> str:
    from transformers import AutoConfig

    torch.manual_seed(0)
    cfg = DrafterConfig.from_target_config(AutoConfig.from_pretrained(target), num_hidden_layers=1,
                                           draft_vocab_size=4096, markov_rank=32)
    d = DSparkDrafter.from_target(cfg, target, draft_ids=torch.arange(4096))
    with torch.no_grad():
        d.markov_head.markov_w2.weight.normal_(0, 0.02)
        d.confidence_head.proj.weight.normal_(0, 0.5)
    return str(export_checkpoint(d, out, verifier_name_or_path=str(target)))


async def one_request(client, url: str, model: str, prompt: str, args) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": args.max_tokens,
            "temperature": args.temperature, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft = None
    final = usage = None
    arrivals = []  # when each content chunk arrived (the gaps are the inter-token latencies at --stream-interval 1)
    async with client.stream("POST", url + "/chat/completions", json=body, timeout=args.request_timeout) as r:
        if r.status_code != 200:
            return {"error": f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"}
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            if ev.get("choices"):
                ch = ev["choices"][0]
                if ch["delta"].get("content"):
                    arrivals.append(time.perf_counter())
                    if ttft is None:
                        ttft = arrivals[-1] - t0
                if ch.get("finish_reason"):
                    final = ev.get("dspark", {})
            if ev.get("usage"):
                usage = ev["usage"]
    t = time.perf_counter() - t0
    n = (usage or {}).get("completion_tokens", 0)
    final = final or {}
    return {"latency": t, "ttft": ttft if ttft is not None else t, "tokens": n, "rounds": final.get("rounds", 0),
            "gaps": [b - a for a, b in zip(arrivals, arrivals[1:])],
            "verified": final.get("verified_tokens", 0), "emitted": final.get("emitted_tokens", 0)}


async def run_level(url: str, model: str, c: int, n: int, args, deadline: float) -> dict:
    queue: asyncio.Queue = asyncio.Queue()
    for i in range(n):
        queue.put_nowait(args.prompt_texts[i % len(args.prompt_texts)])
    results = []

    async def worker(client):
        while not queue.empty() and time.time() < deadline:
            p = queue.get_nowait()
            try:
                results.append(await one_request(client, url, model, p, args))
            except Exception as e:  # timeouts etc.: recorded, the run goes on
                results.append({"error": f"{type(e).__name__}: {e}"})

    t0 = time.perf_counter()
    async with httpx.AsyncClient(trust_env=False, limits=httpx.Limits(max_connections=c + 4)) as client:
        await asyncio.gather(*(worker(client) for _ in range(c)))
    wall = time.perf_counter() - t0
    ok = [r for r in results if "error" not in r]
    toks = sum(r["tokens"] for r in ok)
    rounds = sum(r["rounds"] for r in ok)
    return {
        "concurrency": c, "requests": len(results), "errors": len(results) - len(ok), "wall_s": wall,
        "output_tokens": toks, "output_tok_s": toks / wall if wall > 0 else 0.0,
        "per_user_tok_s": statistics.mean(r["tokens"] / r["latency"] for r in ok) if ok else 0.0,
        "median_ttft_s": statistics.median(r["ttft"] for r in ok) if ok else None,
        "p95_ttft_s": percentile([r["ttft"] for r in ok], 95),
        "p50_itl_s": percentile([g for r in ok for g in r["gaps"]], 50),
        "p95_itl_s": percentile([g for r in ok for g in r["gaps"]], 95),
        "mean_verified_depth": (sum(r["verified"] for r in ok) / rounds) if rounds else 0.0,
        "acceptance_length": (sum(r["emitted"] for r in ok) / rounds) if rounds else 0.0,
        "first_error": next((r["error"] for r in results if "error" in r), None),
    }


def percentile(xs: list, q: float) -> float | None:
    """The q-th percentile (nearest rank) of xs, None for no samples."""
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q / 100 * len(xs)) - 1))]


def plot(results: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2, a3) = plt.subplots(1, 3, figsize=(15, 4))
    for name, levels in results.items():
        xs = [lv["concurrency"] for lv in levels]
        a1.plot(xs, [lv["output_tok_s"] for lv in levels], marker="o", label=name)
        a2.plot(xs, [lv.get("median_ttft_s") or float("nan") for lv in levels], marker="o", label=name)
        a3.plot(xs, [lv["mean_verified_depth"] for lv in levels], marker="o", label=name)
    for a, t in ((a1, "output tokens/s (total)"), (a2, "time to first token, median (s)"),
                 (a3, "mean verified depth (drafts / round)")):
        a.set_xscale("log", base=2)
        a.set_xlabel("concurrent users")
        a.set_title(t)
        a.grid(alpha=0.3)
        a.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


LABELS = {"none": "no-spec", "fixed": "fixed", "hardware": "load-aware", "async": "load-aware-async"}


def replica_rss_bytes(app: str) -> int:
    """Resident memory of application `app`'s Serve replica processes on this machine, summed."""
    total = 0
    for proc in psutil.process_iter(["cmdline", "memory_info"]):
        try:
            if any(f"ServeReplica:{app}:" in c for c in proc.info["cmdline"] or []):
                total += proc.info["memory_info"].rss
        except (psutil.Error, TypeError):
            continue
    return total


ROLES = ("engine", "serving", "client", "other")


def cpu_seconds_by_role(app: str) -> dict[int, tuple[str, float]]:
    """{pid: (role, user + system CPU seconds so far)} for this process and everything it started (Ray's daemons and
    workers, and their children such as vLLM's engine core).  Roles, for application `app`: engine (its engine
    replica and that replica's children), serving (its ingress and Serve's HTTP proxy), client (this process: the
    load generator), other (the rest: Ray's daemons, the other applications' idle replicas ...)."""
    me = psutil.Process()
    procs = [me] + me.children(recursive=True)
    role_of: dict[int, str] = {me.pid: "client"}
    out = {}
    for proc in procs:  # parents come before their children in psutil's recursive listing
        try:
            cmd = " ".join(proc.cmdline())
            if proc.pid not in role_of:
                if f"ServeReplica:{app}:" in cmd:
                    role_of[proc.pid] = "serving" if ":OpenAIIngress" in cmd else "engine"
                elif "ProxyActor" in cmd:
                    role_of[proc.pid] = "serving"
                else:  # a child of the engine replica (vLLM's engine core) is the engine; Ray's daemons are not
                    role_of[proc.pid] = "engine" if role_of.get(proc.ppid()) == "engine" else "other"
            t = proc.cpu_times()
            out[proc.pid] = (role_of[proc.pid], t.user + t.system)
        except psutil.Error:
            continue
    return out


def cpu_used(before: dict, after: dict) -> dict[str, float]:
    """CPU seconds per role between two `cpu_seconds_by_role` snapshots (a process started in between: all of its
    time)."""
    used = dict.fromkeys(ROLES, 0.0)
    for pid, (role, sec) in after.items():
        used[role] += sec - before.get(pid, (role, 0.0))[1]
    return used


def engine_stats(app: str) -> dict:
    """The native engine replica's stats() ({} for vLLM's replica, whose stats hold no engine timers)."""
    from ray import serve

    from serve_app.app import ENGINE_DEPLOYMENT

    try:
        st = serve.get_deployment_handle(ENGINE_DEPLOYMENT, app_name=app).stats.remote().result(timeout_s=30)
    except Exception:
        return {}
    return st if st.get("engine_timers") else {}


# the load-aware scheduler's state kept after each level
SCHEDULER_STATE = ("live_cost", "model_skips", "control_rounds", "skipped_drafts", "depth_hist", "sps")


async def soak(url: str, model: str, app: str, args) -> dict:
    """--soak-clients clients, each sending streamed requests back to back for --soak seconds; RSS every 10 s."""
    end = time.time() + args.soak
    results, rss = [], [(0.0, replica_rss_bytes(app))]
    t0 = time.time()

    async def client_loop(client, i):
        k = i
        while time.time() < end:
            try:
                prompt = args.prompt_texts[k % len(args.prompt_texts)]
                results.append(await one_request(client, url, model, prompt, args))
            except Exception as e:
                results.append({"error": f"{type(e).__name__}: {e}"})
            k += args.soak_clients

    async def sampler():
        while time.time() < end:
            await asyncio.sleep(10)
            rss.append((time.time() - t0, replica_rss_bytes(app)))

    async with httpx.AsyncClient(trust_env=False, limits=httpx.Limits(max_connections=args.soak_clients + 4)) as c:
        await asyncio.gather(sampler(), *(client_loop(c, i) for i in range(args.soak_clients)))
    ok = [r for r in results if "error" not in r]
    wall = time.time() - t0
    return {"seconds": wall, "clients": args.soak_clients, "requests": len(results), "errors": len(results) - len(ok),
            "first_error": next((r["error"] for r in results if "error" in r), None),
            "output_tokens": sum(r["tokens"] for r in ok), "output_tok_s": sum(r["tokens"] for r in ok) / wall,
            "rss_samples": rss, "rss_first_mb": rss[1][1] / 2**20 if len(rss) > 1 else None,
            "rss_last_mb": rss[-1][1] / 2**20, "rss_max_mb": max(b for _, b in rss) / 2**20}


def plot_soak(res: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [t for t, _ in res["rss_samples"]]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.plot(xs, [b / 2**20 for _, b in res["rss_samples"]], marker=".")
    ax.set_xlabel("seconds")
    ax.set_ylabel("replica RSS (MiB)")
    ax.set_title(f"soak: {res['clients']} streaming clients, {res['requests']} requests, {res['errors']} errors")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)




def run(args, harness) -> dict:
    args.prompt_texts = load_prompts(args)
    t_start = time.time()
    deadline = t_start + args.time_budget
    out = harness.out_dir
    out.mkdir(parents=True, exist_ok=True)
    target = str(resolve_target(args.target))
    drafter = args.drafter
    if drafter is None and args.random_drafter:
        drafter = random_drafter(target, out / "random_drafter")
    systems = [args.soak_system] if args.soak else [s for s in args.systems if s == "none" or drafter]
    if args.soak and args.soak_system != "none" and not drafter:
        raise SystemExit("--soak with a speculative system needs --drafter")
    if len(systems) < len(args.systems) and not args.soak:
        print("no --drafter: only the no-speculation system runs", flush=True)
    try:
        vllm_dtypes = [] if args.soak else vllm_baseline_dtypes(args.vllm_baselines)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    # label -> the ServeConfig fields of its application
    deployments = {LABELS[s]: dict(drafter=drafter if s != "none" else None, scheduler=s, dtype=args.dtype)
                   for s in systems}
    vllm_device = "cuda" if torch.cuda.is_available() else "cpu"
    deployments |= {f"vllm-{dt}": dict(engine="vllm", vllm_device=vllm_device, drafter=None, scheduler="none",
                                       dtype=dt) for dt in vllm_dtypes}
    baselines = [label for label, d in deployments.items() if d["scheduler"] == "none"]

    # the systems' replicas live side by side but only one works at a time: logical CPUs for all of them
    init_ray(num_cpus=max(os.cpu_count() or 1, 2) * len(deployments))
    from ray import serve

    serve.start(http_options={"host": "127.0.0.1", "port": args.port})
    base = f"http://127.0.0.1:{args.port}"
    raw: dict = {label: {} for label in deployments}
    skipped = []
    levels = list(args.concurrency)

    def level_case(label):
        def one_level(rep):  # harness repetition rep = (repetition, level) pairs, levels varying fastest
            r, c = rep // len(levels), levels[rep % len(levels)]
            if time.time() > deadline:
                skipped.append(f"{label}@{c}#{r}")
                return {}
            n = args.requests_per_level or max(4, 2 * c)
            cpu0, st0 = cpu_seconds_by_role(label), engine_stats(label)
            lv = asyncio.run(run_level(f"{base}/{label}/v1", "m", c, n, args, deadline))
            cpu1, st1 = cpu_seconds_by_role(label), engine_stats(label)
            t0, t1 = st0.get("engine_timers"), st1.get("engine_timers")
            lv["cpu_s"] = cpu_used(cpu0, cpu1)
            if st1.get("live_cost"):  # the load-aware scheduler's state after the level (its live costs, skips)
                lv["scheduler_after"] = {k: st1.get(k) for k in SCHEDULER_STATE}
            if t0 and t1 and t1["steps"] > t0["steps"]:  # the native engine: its rounds during this level
                steps = t1["steps"] - t0["steps"]
                lv["engine_ms_per_round"] = 1e3 * (t1["total_s"] - t0["total_s"]) / steps
                lv["engine_draft_ms_per_round"] = 1e3 * (t1["draft_s"] - t0["draft_s"]) / steps
                lv["engine_target_ms_per_round"] = 1e3 * (t1["target_s"] - t0["target_s"]) / steps
                lv["engine_busy"] = (t1["total_s"] - t0["total_s"]) / lv["wall_s"]
            else:
                lv["engine_ms_per_round"] = lv["engine_busy"] = None
                lv["engine_draft_ms_per_round"] = lv["engine_target_ms_per_round"] = None
            raw[label].setdefault(c, []).append(lv)
            cpu = lv["cpu_s"]
            rnd = (f"  {lv['engine_ms_per_round']:6.1f} ms/round (draft {lv['engine_draft_ms_per_round']:.1f}, "
                   f"target {lv['engine_target_ms_per_round']:.1f}), busy {lv['engine_busy']:.0%}"
                   if lv["engine_ms_per_round"] is not None else "")
            print(f"[{label}] rep {r} c={c:<3} {lv['output_tok_s']:7.1f} tok/s  "
                  f"{lv['per_user_tok_s']:6.2f} tok/s/user  TTFT {lv['median_ttft_s'] or 0:6.3f}s  depth "
                  f"{lv['mean_verified_depth']:4.2f}  tau {lv['acceptance_length']:4.2f}  errors {lv['errors']}"
                  f"{rnd}  CPU-s engine {cpu['engine']:.1f} serving {cpu['serving']:.1f} client {cpu['client']:.1f} "
                  f"other {cpu['other']:.1f}", flush=True)
            return {f"c{c}_output_tok_s": lv["output_tok_s"], f"c{c}_errors": lv["errors"]}
        return one_level

    try:
        for label, fields in deployments.items():  # side by side: one application per system
            cfg = ServeConfig(target=target, replicas=args.replicas, port=args.port, num_speculative_tokens=args.num_speculative_tokens,
                              max_batch=args.max_batch, threads=args.threads, model_name="m",
                              stream_interval=args.stream_interval, prefill_slowdown=args.prefill_slowdown,
                              **fields)
            t0 = time.time()
            serve.run(build_app(cfg), name=label, route_prefix=f"/{label}", blocking=False)
            asyncio.run(run_level(f"{base}/{label}/v1", "m", 1, 1, args, deadline))  # warm-up
            print(f"[{label}] deployed and warmed up in {time.time() - t0:.0f}s", flush=True)
        if args.soak:
            label = LABELS[systems[0]]
            res = asyncio.run(soak(f"{base}/{label}/v1", "m", label, args))
            res["system"] = label
            (out / "soak.json").write_text(json.dumps(res, indent=1))
            plot_soak(res, out / "soak.png")
            print(f"soak [{label}]: {res['requests']} requests, {res['errors']} errors, {res['output_tok_s']:.1f} "
                  f"tok/s, replica RSS {res['rss_first_mb']:.0f} -> {res['rss_last_mb']:.0f} MiB "
                  f"(max {res['rss_max_mb']:.0f})  ->  {out / 'soak.json'}, {out / 'soak.png'}", flush=True)
            return {"soak": res}
        # the order of the systems alternates (A B, B A, ...) so that whatever a run leaves behind (the previous
        # system's tail work, GC, log flushing) does not always land on the same system
        harness.interleave({label: level_case(label) for label in deployments}, args.reps * len(levels),
                           label="levels")
    finally:
        serve.shutdown()

    def med(lvs, key):
        vals = [lv[key] for lv in lvs if lv[key] is not None]
        return statistics.median(vals) if vals else None

    results = {label: [dict(concurrency=c, reps=len(lvs), errors=sum(lv["errors"] for lv in lvs),
                            **{k: med(lvs, k) for k in ("output_tok_s", "per_user_tok_s", "median_ttft_s",
                                                        "p95_ttft_s", "p50_itl_s", "p95_itl_s",
                                                        "mean_verified_depth", "acceptance_length",
                                                        "engine_ms_per_round", "engine_draft_ms_per_round",
                                                        "engine_target_ms_per_round", "engine_busy")},
                            cpu_s_per_1k_tokens={role: statistics.median(
                                1e3 * lv["cpu_s"][role] / max(lv["output_tokens"], 1) for lv in lvs) for role in ROLES})
                       for c, lvs in sorted(by_c.items())] for label, by_c in raw.items()}
    # the reference at each concurrency: the FASTEST no-speculation system there (ours or vLLM's)
    ref: dict[int, tuple[float, str]] = {}
    for label in baselines:
        for lv in results.get(label, []):
            ref[lv["concurrency"]] = max(ref.get(lv["concurrency"], (0.0, "")), (lv["output_tok_s"], label))
    for label, lvs in results.items():
        for lv in lvs:
            best = ref.get(lv["concurrency"])
            lv["fastest_no_spec"] = best[1] if best else None
            lv["vs_fastest_no_spec"] = lv["output_tok_s"] / best[0] if best and best[0] else None
    rows = []
    for label, lvs in results.items():
        for lv in lvs:
            r = lv["vs_fastest_no_spec"]
            rows.append([label, lv["concurrency"], f"{lv['output_tok_s']:.1f}", f"{lv['per_user_tok_s']:.2f}",
                         f"{lv['median_ttft_s'] or 0:.3f}", f"{lv['p95_ttft_s'] or 0:.3f}",
                         f"{1e3 * (lv['p50_itl_s'] or 0):.0f} / {1e3 * (lv['p95_itl_s'] or 0):.0f}",
                         f"{lv['mean_verified_depth']:.2f}",
                         f"{lv['acceptance_length']:.2f}", f"{r:.2f}" if r is not None else "n/a",
                         lv["fastest_no_spec"] or "n/a"])
    harness.table("load test (medians over the repetitions)",
                  ["system", "users", "tok/s", "tok/s/user", "TTFT p50 s", "TTFT p95 s", "ITL p50/p95 ms", "depth",
                   "tau", "vs fastest no-spec",
                   "fastest no-spec"], rows)
    cost_rows = []
    for label, lvs in results.items():
        for lv in lvs:
            ms, cpu = lv["engine_ms_per_round"], lv["cpu_s_per_1k_tokens"]
            part = [lv["engine_draft_ms_per_round"], lv["engine_target_ms_per_round"]]
            cost_rows.append([label, lv["concurrency"], f"{ms:.1f}" if ms is not None else "-",
                              *(f"{x:.1f}" if x is not None else "-" for x in part),
                              f"{lv['engine_busy']:.0%}" if lv["engine_busy"] is not None else "-",
                              *(f"{cpu[role]:.2f}" for role in ROLES)])
    harness.table("where the time goes (medians): the native engine's ms per round and busy share of the wall "
                  "clock; CPU seconds per 1,000 output tokens by process role",
                  ["system", "users", "ms/round", "draft ms", "target ms", "engine busy", "CPU engine", "CPU serving",
                   "CPU client", "CPU other"], cost_rows)
    if skipped:
        print(f"skipped (time budget): {skipped}")
    if results:
        plot(results, out / "load_test.png")
        print(f"plot: {out / 'load_test.png'}")
    meta = {"drafter": drafter, "target": target, "no_spec_systems": baselines, "elapsed_s": time.time() - t_start,
            "skipped": skipped}
    return {"meta": meta, "results": results,
            "raw": {label: {str(c): lvs for c, lvs in by_c.items()} for label, by_c in raw.items()}}
