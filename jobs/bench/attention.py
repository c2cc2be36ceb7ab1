"""The KV cache's dtype for a bf16 target runner on CPU: one decode step of R requests (one new token each, ragged
cache lengths around --context) with the cache and attention in fp32 vs in bf16, same weights, interleaved
(alternating order), medians; also what ``fp32_attention_wins`` (the runner's automatic choice) says here.

    python -m jobs.bench attention [--target HF_FOLDER] [--dtype bfloat16:packed] [--requests 1 4 16]
        [--context 300] [--reps 15]

PyTorch's CPU flash attention is several times slower in bf16 than in fp32 on a CPU without AMX; the linear layers
are the same in both cases, so the step-time ratio is what the cache dtype is worth on this machine."""
from __future__ import annotations

import torch

from pipeline.data.target_model import resolve_target
from pipeline.engine.target_runner import TargetRunner, fp32_attention_wins

NAME = "attention"
HELP = "bf16 target runner on CPU: decode step time with the KV cache (and attention) in fp32 vs bf16"


def add_arguments(ap) -> None:
    ap.add_argument("--target", default=None, help="HF folder (default: the prepared SmolLM2-135M-Instruct)")
    ap.add_argument("--dtype", default="bfloat16:packed", help="runner precision (bfloat16 or bfloat16:packed)")
    ap.add_argument("--requests", type=int, nargs="+", default=[1, 4, 16], help="requests per decode step")
    ap.add_argument("--context", type=int, default=300, help="mean cached tokens per request (ragged +-25%%)")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--threads", type=int, default=None)


def run(a, harness) -> dict:
    if a.threads:
        torch.set_num_threads(a.threads)
    from transformers import AutoModelForCausalLM

    path = resolve_target(a.target)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    runners = {name: TargetRunner(model, a.dtype, device="cpu", attention_dtype=adt)
               for name, adt in (("fp32 cache", torch.float32), ("bf16 cache", torch.bfloat16))}
    if any(r.dtype != torch.bfloat16 for r in runners.values()):
        raise SystemExit(f"--dtype {a.dtype!r}: this benchmark compares cache dtypes of a bf16 runner")
    c = runners["fp32 cache"].config
    auto = fp32_attention_wins(c.num_heads, c.num_kv_heads, c.head_dim)
    g = torch.Generator().manual_seed(0)
    res = {"target": str(path), "dtype": a.dtype, "context": a.context, "threads": torch.get_num_threads(),
           "automatic_choice": "fp32 cache" if auto else "bf16 cache", "step_ms": {}}
    rows = []
    for R in a.requests:
        lens = [max(1, int(a.context * (0.75 + 0.5 * i / max(1, R - 1)))) for i in range(R)]
        prompts = [torch.randint(0, c.vocab_size, (n,), generator=g).tolist() for n in lens]
        slots = {}
        for name, r in runners.items():
            slots[name] = [r.alloc() for _ in range(R)]
            for s, p in zip(slots[name], prompts):
                r.prefill(s, p)
        ids = [[int(t)] for t in torch.randint(0, c.vocab_size, (R,), generator=g)]

        def step(name):
            r, sl = runners[name], slots[name]

            def call(rep):
                r.forward(sl, ids, logits_last=1)
                for s, n in zip(sl, lens):
                    r.truncate(s, n)  # the same context every repetition
            return call

        s = harness.interleave({n: step(n) for n in runners}, a.reps, warmup=2, label=f"R={R}")
        med = s.medians()
        res["step_ms"][R] = {n: round(v * 1e3, 2) for n, v in med.items()}
        rows.append([R, f"{med['fp32 cache'] * 1e3:.1f}", f"{med['bf16 cache'] * 1e3:.1f}",
                     f"{med['bf16 cache'] / med['fp32 cache']:.2f}"])
        for name, r in runners.items():
            for sl in slots[name]:
                r.free(sl)
    harness.table(f"decode step of R requests at ~{a.context} cached tokens ({a.dtype}), median ms; automatic "
                  f"choice here: {res['automatic_choice']}",
                  ["R", "fp32 cache", "bf16 cache", "bf16 / fp32"], rows)
    return res
