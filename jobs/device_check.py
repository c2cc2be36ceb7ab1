"""The checks that need a GPU, in one run: ``python -m jobs.device_check [--device cuda] [--quick] [--pytest]``.

1. training: one accumulated drafter step (pipeline.train.step.accumulate_gradients) on the device in bf16 autocast
   and in fp32 against the CPU fp32 step on the same tiny batch (loss parts, gradient relative errors);
2. engine: plain greedy decoding (no drafter) and the DSpark engine, each eager and with CUDA graphs
   (SpecConfig(cuda_graphs=True)), in bf16 and fp32: tokens/s, the ratio to plain eager decoding, and whether every
   greedy output equals plain eager decoding's;
3. tests: the CUDA tests (tests/test_cuda_path.py) and the padding tests (tests/test_cuda_graphs.py) through
   pytest, when pytest and the tests' imports are there.

The target is the HF folder given by --target (default work/models/SmolLM2-135M-Instruct) when it exists and
transformers is installed, else a random Llama of SmolLM2-135M's shape built in plain PyTorch (``target.kind`` in
the JSON says which); --quick uses a tiny random Llama and short runs (how this runs on a CPU in seconds).  The drafter
is a freshly initialised DSparkDrafter, so acceptance is low: the speed ratios measure the engine's overhead and the
graphs' gain, not a trained drafter's speed-up.  On a CPU, "graphs" runs the same padded shapes without capture.

Prints ONE JSON summary and writes it to $OUT/device_check.json when OUT is set.  Needs torch only (no Ray, no
vLLM, no network); run from the repository root.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn as nn

from pipeline.engine.cuda_graphs import StaticShapes
from pipeline.dspark.anchors import make_blocks
from pipeline.dspark.config import DrafterConfig
from pipeline.dspark.drafter import DSparkDrafter
from pipeline.engine.engine import SpecConfig, SpeculativeEngine
from pipeline.ops.layers import RMSNorm, rms_norm
from pipeline.ops.sampling import SamplingParams
from pipeline.engine.target_runner import TargetRunner

DEFAULT_TARGET = Path("work/models/SmolLM2-135M-Instruct")
# SmolLM2-135M's shape (its config.json): the random stand-in when the checkpoint is not there
SMOLLM2_135M = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, head_dim=64, rms_norm_eps=1e-5,
                    rope_theta=100000.0, max_position_embeddings=8192)
TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=512)


@dataclass
class CheckConfig:
    device: str = "cuda"
    quick: bool = False
    target: str = str(DEFAULT_TARGET)
    batch_sizes: tuple = (1, 8)
    prompt_len: int = 64
    max_tokens: int = 96
    repeats: int = 3
    dtypes: tuple = ("bfloat16", "float32")
    block_size: int = 4
    run_pytest: bool = True
    pytest_timeout_s: int = 240

    @classmethod
    def from_args(cls, argv=None) -> "CheckConfig":
        ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
        ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
        ap.add_argument("--quick", action="store_true", help="tiny random target, short runs, no pytest")
        ap.add_argument("--target", default=str(DEFAULT_TARGET), help="HF folder of the target (random if absent)")
        ap.add_argument("--max-tokens", type=int, default=None)
        ap.add_argument("--no-pytest", action="store_true")
        a = ap.parse_args(argv)
        cfg = cls(device=a.device, quick=a.quick, target=a.target, run_pytest=not (a.no_pytest or a.quick))
        if a.device.startswith("cuda") and not torch.cuda.is_available():
            ap.error("--device cuda but torch sees no CUDA device")
        if a.quick:
            cfg.batch_sizes, cfg.prompt_len, cfg.max_tokens, cfg.repeats, cfg.dtypes = (2,), 8, 8, 1, ("float32",)
        if a.max_tokens is not None:
            if a.max_tokens < 2:
                ap.error("--max-tokens must be >= 2")
            cfg.max_tokens = a.max_tokens
        return cfg


# ------------------------------------------------------------------------------------------------- the target
class _Attention(nn.Module):
    def __init__(self, c):
        super().__init__()
        d, H, K, h = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj, self.k_proj = nn.Linear(d, H * h, bias=False), nn.Linear(d, K * h, bias=False)
        self.v_proj, self.o_proj = nn.Linear(d, K * h, bias=False), nn.Linear(H * h, d, bias=False)


class _MLP(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)


class _Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.self_attn, self.mlp = _Attention(c), _MLP(c)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)


class _Base(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(_Block(c) for _ in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)


class RandomLlama(nn.Module):
    """A Llama with random weights (normal, std 0.02), laid out as transformers' LlamaForCausalLM so TargetRunner and
    load_target_weights read it; it has no forward of its own (TargetRunner computes).  Its LM head is untied and
    ``head_scale`` times sharper than the embedding, so greedy decoding is not a coin flip between near-tied
    logits (random weights make them near-flat)."""

    def __init__(self, shape: dict, seed: int = 0, head_scale: float = 8.0):
        super().__init__()
        self.config = SimpleNamespace(model_type="llama", hidden_act="silu", eos_token_id=2, pad_token_id=2,
                                      architectures=["LlamaForCausalLM"], _name_or_path="random", **shape)
        torch.manual_seed(seed)
        self.model = _Base(self.config)
        self.lm_head = nn.Linear(shape["hidden_size"], shape["vocab_size"], bias=False)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if "norm" not in name:
                    p.normal_(0.0, 0.02)
            self.lm_head.weight.mul_(head_scale)
        self.eval()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def get_output_embeddings(self):
        return self.lm_head


def build_target(cfg: CheckConfig):
    """-> (an HF-like model on the CPU, a description for the JSON)."""
    folder = Path(cfg.target)
    if not cfg.quick and (folder / "config.json").is_file() and importlib.util.find_spec("transformers"):
        from transformers import AutoModelForCausalLM  # heavy, optional

        return (AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval(),
                {"kind": "checkpoint", "path": str(folder)})
    shape = TINY if cfg.quick else SMOLLM2_135M
    why = "--quick" if cfg.quick else (f"{folder} absent" if not (folder / "config.json").is_file()
                                       else "transformers not installed")
    return RandomLlama(shape), {"kind": "random", "shape": "tiny" if cfg.quick else "SmolLM2-135M", "why": why,
                                "layers": shape["num_hidden_layers"], "hidden": shape["hidden_size"],
                                "vocab": shape["vocab_size"]}


def drafter_config(model, block_size: int) -> DrafterConfig:
    c = getattr(model.config, "text_config", None) or model.config
    return DrafterConfig.from_target_config(c, num_hidden_layers=1, block_size=block_size, markov_rank=16)


# ------------------------------------------------------------------------------------------------- 1. training
def check_training(cfg: CheckConfig, model) -> dict:
    """CPU fp32 vs device fp32 and device bf16 autocast: one accumulated step on three short sequences."""
    try:  # the losses and pipeline.train.step need pyarrow (their stores): report it missing, run the other checks
        training = importlib.import_module("pipeline.train.step")
        from pipeline.dspark.losses import LossConfig, TargetHead, weight_sum
    except ImportError as e:
        return {"skipped": f"import failed: {e}"}
    dcfg = drafter_config(model, cfg.block_size)
    runner = TargetRunner(model, "float32", device="cpu", max_seq_len=256)
    L = runner.config.num_layers
    g = torch.Generator().manual_seed(0)
    V = runner.config.vocab_size
    samples = []
    for T in (30, 17, 24):  # the target's aux features and normed last hidden state, as a hidden-state store holds
        ids = torch.randint(3, V, (T,), generator=g)
        s = runner.alloc()
        aux = runner.forward([s], [ids], logits_last=0, aux_layer_ids=list(dcfg.aux_layer_ids) + [L]).aux_hidden
        runner.free(s)
        d = runner.config.hidden_size
        last = rms_norm(aux[:, -d:], runner.norm, runner.config.rms_norm_eps)
        lm = torch.zeros(T, dtype=torch.uint8)
        lm[5:] = 1
        samples.append(dict(input_ids=ids.int(), loss_mask=lm, aux_hidden=aux[:, :-d].contiguous(),
                            last_hidden=last))
    blocks = [make_blocks(s["input_ids"].long(), s["loss_mask"], 6, cfg.block_size,
                          torch.Generator().manual_seed(i)) for i, s in enumerate(samples)]
    denom = sum(float(weight_sum(b.label_mask)) for b in blocks)
    out_emb = model.get_output_embeddings()
    head_w = (out_emb if out_emb is not None else model.get_input_embeddings()).weight
    runs = {}
    for name, dev, bf16 in (("cpu_fp32", "cpu", False), ("device_fp32", cfg.device, False),
                            ("device_bf16", cfg.device, True)):
        if dev.startswith("cuda"):
            torch.backends.cuda.matmul.allow_tf32 = False
        torch.manual_seed(0)
        m = DSparkDrafter.from_target(dcfg, model).to(dev)
        head = TargetHead(head_w.detach().float().to(dev), m.draft_ids)
        t0 = time.perf_counter()
        parts, n_sup, _ = training.accumulate_gradients(m, head, samples, blocks, LossConfig(), denom,
                                                        micro_batch=3, bf16=bf16, device=dev)
        if dev.startswith("cuda"):
            torch.cuda.synchronize()
        runs[name] = (parts, n_sup, {k: p.grad.detach().float().cpu() for k, p in m.named_parameters()
                                     if p.grad is not None}, time.perf_counter() - t0)
    ref_parts, ref_n, ref_g, _ = runs["cpu_fp32"]
    out = {"supervised": ref_n, "loss_cpu": ref_parts["loss"]}
    # fp32: the same numbers up to summation order; bf16 autocast: ~3 significant digits, so the loss within 1% and
    # every gradient pointing the same way (cosine), not equal element by element
    for name, loss_tol, grad_tol, min_cos in (("device_fp32", 1e-3, 1e-3, None), ("device_bf16", 1e-2, None, 0.98)):
        parts, n_sup, grads, secs = runs[name]
        same = sorted(grads) == sorted(ref_g)
        loss_rel = max(abs(parts[k] - ref_parts[k]) / max(abs(ref_parts[k]), 1e-8) for k in ref_parts)
        rel = {k: float((grads[k] - ref_g[k]).norm() / ref_g[k].norm().clamp_min(1e-12)) for k in ref_g}
        cos = {k: 1.0 if max(float(grads[k].norm()), float(ref_g[k].norm())) < 1e-12 else  # both zero
               float(torch.nn.functional.cosine_similarity(grads[k].flatten(), ref_g[k].flatten(), dim=0))
               for k in ref_g}
        worst = max(rel, key=rel.get)
        ok = n_sup == ref_n and same and loss_rel < loss_tol
        ok = ok and (rel[worst] < grad_tol if grad_tol is not None else min(cos.values()) >= min_cos)
        out[name] = {"loss": parts["loss"], "loss_rel_err": loss_rel, "grad_rel_err_max": rel[worst],
                     "worst_param": worst, "grad_cosine_min": min(cos.values()), "same_params": same, "ok": ok,
                     "tolerance": {"loss_rel": loss_tol, "grad_rel": grad_tol, "grad_cosine_min": min_cos},
                     "seconds": secs}
    return out


# ------------------------------------------------------------------------------------------------- 2. engine
def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _engine(cfg: CheckConfig, model, dtype: str, speculative: bool, graphs: bool, max_batch: int):
    runner = TargetRunner(model, dtype, device=cfg.device, max_seq_len=cfg.prompt_len + cfg.max_tokens + 16,
                          init_slots=max_batch + 2, init_len=cfg.prompt_len + cfg.max_tokens + 16)
    drafter = None
    if speculative:
        torch.manual_seed(0)
        drafter = DSparkDrafter.from_target(drafter_config(model, cfg.block_size), model).to(
            device=cfg.device, dtype=runner.dtype).eval()
    on_cuda = cfg.device.startswith("cuda")
    spec = SpecConfig(method="dspark" if speculative else None, cuda_graphs=graphs and on_cuda)
    eng = SpeculativeEngine(runner, drafter, spec, eos_token_ids=[])
    if graphs and not on_cuda:
        eng.use_static_shapes(capture=False, shapes=StaticShapes(max_tokens=eng.num_speculative_tokens + 1))
    return eng


def _generate(eng, prompts, max_tokens: int):
    return eng.generate(prompts, SamplingParams(), max_tokens=max_tokens, ignore_eos=True)


def check_engine(cfg: CheckConfig, model) -> dict:
    g = torch.Generator().manual_seed(1)
    V = model.config.vocab_size
    out = {}
    for dtype in cfg.dtypes:
        for B in cfg.batch_sizes:
            prompts = [torch.randint(3, V, (cfg.prompt_len,), generator=g).tolist() for _ in range(B)]
            res, ref = {}, None
            for name, speculative, graphs in (("plain_eager", False, False), ("plain_graphs", False, True),
                                              ("dspark_eager", True, False), ("dspark_graphs", True, True)):
                eng = _engine(cfg, model, dtype, speculative, graphs, B)
                _generate(eng, prompts, cfg.max_tokens)  # warm-up: kernels, graph recording for these shapes
                times, outs = [], None
                for _ in range(cfg.repeats):
                    _sync(cfg.device)
                    t0 = time.perf_counter()
                    outs = _generate(eng, prompts, cfg.max_tokens)
                    _sync(cfg.device)
                    times.append(time.perf_counter() - t0)
                secs = sorted(times)[len(times) // 2]
                ids = [o.output_ids for o in outs]
                if ref is None:
                    ref = ids
                rounds = sum(o.stats.rounds for o in outs)
                r = {"tokens_per_s": B * cfg.max_tokens / secs, "median_s": secs,
                     "greedy_equals_plain_eager": ids == ref,
                     "matching_requests": sum(a == b for a, b in zip(ids, ref)),
                     "tau": sum(o.stats.emitted for o in outs) / rounds if rounds else None}
                static = eng.target.static_forward
                if static is not None:
                    r["target_padded_runs"], r["target_graphs"] = static.runs, static.recorded
                    r["target_graph_replays"] = static.replays
                if eng.static_draft is not None:
                    r["draft_padded_runs"], r["draft_graphs"] = eng.static_draft.runs, eng.static_draft.recorded
                    r["draft_graph_replays"] = eng.static_draft.replays
                res[name] = r
            base = res["plain_eager"]["tokens_per_s"]
            for r in res.values():
                r["ratio_to_plain_eager"] = r["tokens_per_s"] / base
            out[f"{dtype}/batch{B}"] = res
    return out


# ------------------------------------------------------------------------------------------------- 3. tests
def run_tests(cfg: CheckConfig) -> dict:
    if not cfg.run_pytest:
        return {"skipped": "--quick / --no-pytest"}
    if importlib.util.find_spec("pytest") is None:
        return {"skipped": "pytest not installed"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_cuda_path.py",
           "tests/test_cuda_graphs.py"]
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=cfg.pytest_timeout_s)
    except subprocess.TimeoutExpired as e:
        return {"command": " ".join(cmd[1:]), "timed_out": cfg.pytest_timeout_s,
                "tail": (e.stdout or b"")[-3000:].decode() if isinstance(e.stdout, bytes) else (e.stdout or "")[-3000:]}
    lines = (p.stdout + p.stderr).strip().splitlines()
    return {"command": " ".join(cmd[1:]), "returncode": p.returncode, "summary": lines[-1] if lines else "",
            "tail": "\n".join(lines[-40:]), "seconds": time.perf_counter() - t0}


def main(argv=None) -> dict:
    cfg = CheckConfig.from_args(argv)
    t0 = time.perf_counter()
    summary = {"device": cfg.device, "quick": cfg.quick, "torch": torch.__version__,
               "cuda_device": torch.cuda.get_device_name(0) if cfg.device.startswith("cuda") else None}
    model, summary["target"] = build_target(cfg)
    for name, check in (("training", check_training), ("engine", check_engine)):
        t = time.perf_counter()
        try:
            summary[name] = check(cfg, model)
        except Exception as e:  # one failing check must not hide the others' results
            summary[name] = {"error": f"{type(e).__name__}: {e}"}
        summary[name + "_s"] = time.perf_counter() - t
    summary["tests"] = run_tests(cfg)
    summary["total_s"] = time.perf_counter() - t0
    text = json.dumps(summary, indent=1, default=str)
    print(text)
    out_dir = os.environ.get("OUT")
    if out_dir:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        (Path(out_dir) / "device_check.json").write_text(text + "\n")
    return summary


if __name__ == "__main__":
    main()
