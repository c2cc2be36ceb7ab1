"""Stage 1 on Ray Data: an actor pool of vLLM generators regenerates the target's responses.

The driver tokenizes the prompts (chat template), drops the ids that committed shards already hold, streams the
rest through ``map_batches(VLLMGenerator, compute=ActorPoolStrategy(...))`` and writes the results as atomic
Parquet shards (pipeline.data.shards) as they arrive; the manifest is written last.  Kill it at any point and rerun: the
missing rows are generated, none twice (per-request seeds make the rerun sample what the first run would have).
"""
from __future__ import annotations

import dataclasses
import io
import time
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from tqdm import tqdm

from actors.vllm_engine import (ACTOR_MEMORY_HELP, actor_memory_request, build_llm, engine_actor_plan,
                                engine_config, engine_dtype, request_seed)
from pipeline.core.config_fields import (actor_resources_field, actor_threads_field, engine_dtype_field,
                                         ray_address_field, target_field, temperature_field, top_k_field, top_p_field)
from pipeline.launch.launch_plan import (DRY_RUN_HELP, GPU_MEM_HELP, GPUS_HELP, MAX_SEQS_HELP, TP_HELP, EngineLayout,
                                         actor_pool_plan, check_count, check_non_negative)
from pipeline.launch.placement import INFERENCE, role_resources
from pipeline.data.prompts import DEFAULT_PROMPTS, read_prompt_files, tokenize_requests
from pipeline.data.responses import RESPONSE_SCHEMA, SKIP_SCHEMA, loss_mask_for
from pipeline.core.runtime import init_ray
from pipeline.data.shards import ShardSet, atomic_write_bytes
from pipeline.data.target_model import resolve_target


@dataclass
class GenerateConfig:
    prompts: list[Path] = field(default_factory=list, metadata={
        "help": "JSONL prompt files ({\"turns\": [...]} uses the first turn, or {\"prompt\": ...}); "
                "default: the project's small shipped prompt set"})
    out: Path = field(default=Path("work/responses"), metadata={"help": "output folder (Parquet shards + manifest)"})
    target: str | None = target_field()
    limit: int | None = field(default=None, metadata={"help": "use at most this many prompts (over all files)"})
    limit_per_file: int | None = field(default=None, metadata={
        "help": "use at most this many prompts from each file (the first N valid ones), for a balanced mix"})
    max_new_tokens: int = field(default=256, metadata={"help": "response length cap"})
    max_model_len: int = field(default=2048, metadata={"help": "context length of the vLLM engine"})
    temperature: float = temperature_field("of the responses")
    top_p: float = top_p_field("of the responses")
    top_k: int = top_k_field("of the responses")
    seed: int = field(default=0, metadata={"help": "base seed; each request's seed derives from it and its id"})
    dtype: str = engine_dtype_field()
    batch_size: int = field(default=16, metadata={"help": "prompts per vLLM generate call (Ray Data batch)"})
    pool_size: int = field(default=1, metadata={"help": "number of vLLM generator actors"})
    actor_cpus: float = field(default=1.0, metadata={"help": "CPUs reserved per generator actor"})
    threads: int | None = actor_threads_field()
    actor_resources: str | None = actor_resources_field()
    actor_memory: str = field(default="auto", metadata={"help": ACTOR_MEMORY_HELP})
    rows_per_shard: int = field(default=64, metadata={"help": "rows per Parquet shard (the unit of resumption)"})
    address: str | None = ray_address_field()
    max_rows: int | None = field(default=None, metadata={
        "help": "stop after writing this many new rows in this run (for tests of resumption)"})
    gpus_per_actor: float = field(default=0.0, metadata={"help": GPUS_HELP})
    tensor_parallel_size: int = field(default=1, metadata={"help": TP_HELP})
    gpu_memory_utilization: float = field(default=0.9, metadata={"help": GPU_MEM_HELP})
    max_num_seqs: int | None = field(default=None, metadata={"help": MAX_SEQS_HELP})
    dry_run: bool = field(default=False, metadata={"help": DRY_RUN_HELP})

    def __post_init__(self):
        for name in ("pool_size", "batch_size", "rows_per_shard", "max_new_tokens", "max_model_len"):
            check_count(getattr(self, name), "--" + name.replace("_", "-"))
        for name in ("limit", "limit_per_file", "max_rows", "top_k", "actor_cpus"):
            check_non_negative(getattr(self, name), "--" + name.replace("_", "-"))
        check_count(self.threads, "--threads")
        self.layout()

    def layout(self) -> EngineLayout:
        """The engine layout of every generator actor (validated; PlanError names the bad flag)."""
        return EngineLayout(gpus=float(self.gpus_per_actor), tensor_parallel_size=self.tensor_parallel_size,
                            gpu_memory_utilization=self.gpu_memory_utilization,
                            max_num_seqs=self.max_num_seqs).validate()


class VLLMGenerator:
    """Ray Data actor: pa.Table batch (request_id, source_file, prompt_ids) -> response rows."""

    def __init__(self, target: str, max_model_len: int, max_new_tokens: int, temperature: float, top_p: float,
                 top_k: int, seed: int, dtype: str = "auto", layout: dict | None = None):
        self.llm = build_llm(target, max_model_len=max_model_len, seed=seed, dtype=dtype,
                             layout=layout or dataclasses.asdict(EngineLayout()))
        self.max_new_tokens, self.seed = max_new_tokens, seed
        self.sampling = dict(temperature=temperature, top_p=top_p, top_k=top_k if top_k > 0 else -1)

    def __call__(self, batch: pa.Table) -> pa.Table:
        from vllm import SamplingParams

        rows = batch.to_pylist()
        params = [SamplingParams(max_tokens=self.max_new_tokens, seed=request_seed(self.seed, r["request_id"]),
                                 **self.sampling) for r in rows]
        outs = self.llm.generate([{"prompt_token_ids": r["prompt_ids"]} for r in rows], params, use_tqdm=False)
        result = []
        for r, o in zip(rows, outs):
            resp = list(o.outputs[0].token_ids)
            finish = "length" if o.outputs[0].finish_reason == "length" else "stop"
            result.append(dict(request_id=r["request_id"], source_file=r["source_file"], prompt_ids=r["prompt_ids"],
                               response_ids=resp, loss_mask=loss_mask_for(len(r["prompt_ids"]), len(resp)),
                               finish_reason=finish))
        return pa.Table.from_pylist(result, schema=RESPONSE_SCHEMA)


def generation_plan(cfg: GenerateConfig, target) -> dict:
    """What stage 1 launches (pipeline.launch.launch_plan): the Ray Data actor pool, each actor's Ray options and its vLLM
    engine configuration; ``--dry-run`` prints it, ``run_generation`` launches it."""
    layout = cfg.layout()
    dtype = engine_dtype(cfg.dtype, layout)
    kwargs, env = engine_config(str(target), cfg.max_model_len, cfg.seed, dtype, layout=layout)
    actor = engine_actor_plan("VLLMGenerator", str(target), dtype, layout, cfg.actor_cpus, cfg.threads,
                              cfg.actor_memory, cfg.actor_resources, env, kv_cache=True)
    return {
        "job": "generate",
        "ray": actor_pool_plan(cfg.address, cfg.pool_size, cfg.batch_size, actor, cfg.actor_cpus, layout),
        "engine": {"backend": "vllm", "device": layout.device, "kwargs": kwargs, "env": env,
                   "sampling": {"max_tokens": cfg.max_new_tokens, "temperature": cfg.temperature, "top_p": cfg.top_p,
                                "top_k": cfg.top_k if cfg.top_k > 0 else -1,
                                "seed": f"per request from --seed {cfg.seed} and the request id"}},
        "output": {"folder": str(cfg.out), "rows_per_shard": cfg.rows_per_shard},
    }


def run_generation(cfg: GenerateConfig) -> dict:
    from transformers import AutoTokenizer

    target = resolve_target(cfg.target)
    plan = generation_plan(cfg, target)
    prompt_files = cfg.prompts or [DEFAULT_PROMPTS]
    rows, skips = read_prompt_files(prompt_files, cfg.limit, cfg.limit_per_file)
    tok = AutoTokenizer.from_pretrained(target)
    max_prompt = cfg.max_model_len - cfg.max_new_tokens
    if max_prompt <= 0:
        raise ValueError(f"--max-new-tokens {cfg.max_new_tokens} leaves no room for a prompt in "
                         f"--max-model-len {cfg.max_model_len}")
    requests, too_long = tokenize_requests(tok, rows, max_prompt)
    skips += too_long
    shards = ShardSet(cfg.out, key="request_id")
    done = shards.done_ids()
    pending = [r for r in requests if r["request_id"] not in done]
    meta = dict(stage="responses", target=str(target), prompt_files=[str(p) for p in prompt_files],
                limit=cfg.limit, limit_per_file=cfg.limit_per_file, max_new_tokens=cfg.max_new_tokens,
                temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
                dtype=cfg.dtype, seed=cfg.seed, num_requests=len(requests), num_skipped=len(skips))
    # skips are recorded next to the data (not silently dropped) - rewritten whole each run, atomically
    skip_table = pa.Table.from_pylist([s.__dict__ for s in skips], schema=SKIP_SCHEMA)
    buf = io.BytesIO()
    pq.write_table(skip_table, buf)
    atomic_write_bytes(Path(cfg.out) / "skipped.parquet", buf.getvalue())
    for s in skips:
        print(f"[generate] skipped {s.request_id} ({s.source_file} line {s.line}): {s.reason}")
    print(f"[generate] {len(requests)} requests, {len(done)} already done, {len(pending)} to generate")
    written = 0
    if pending:
        ray = init_ray(cfg.address)
        import ray.data
        from ray.data import ActorPoolStrategy

        ctx = ray.data.DataContext.get_current()
        ctx.enable_progress_bars = False
        ds = ray.data.from_arrow(pa.Table.from_pylist(
            pending, schema=pa.schema([("request_id", pa.string()), ("source_file", pa.string()),
                                       ("prompt_ids", pa.list_(pa.int32()))])))
        ds = ds.repartition(max(1, (len(pending) + cfg.batch_size - 1) // cfg.batch_size))
        layout, actor = cfg.layout(), plan["ray"]["actor"]
        resources = role_resources(INFERENCE, cfg.actor_resources, "actor-resources")
        memory = actor_memory_request(cfg.actor_memory, str(target), cfg.dtype, cfg.pool_size, kv_cache=True,
                                      layout=layout)
        print(f"[generate] {cfg.pool_size} vLLM actor(s), resources {resources or 'unconstrained'}, "
              f"memory {memory / 2**30:.1f} GiB each, {layout.device} engine"
              + (f" on {layout.gpus:g} GPU(s) each" if layout.gpus else ""))
        ds = ds.map_batches(
            VLLMGenerator, batch_format="pyarrow", batch_size=cfg.batch_size,
            compute=ActorPoolStrategy(size=cfg.pool_size), num_cpus=cfg.actor_cpus,
            **({"num_gpus": layout.gpus} if layout.gpus else {}),
            **({"memory": memory} if memory else {}),
            **({"resources": resources} if resources else {}), runtime_env=actor["runtime_env"],
            fn_constructor_kwargs=dict(target=str(target), max_model_len=cfg.max_model_len,
                                       max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
                                       top_p=cfg.top_p, top_k=cfg.top_k, seed=cfg.seed, dtype=cfg.dtype,
                                       layout=dataclasses.asdict(layout)))
        buffer: list[pa.Table] = []
        buffered = 0
        t0, ntok = time.time(), 0
        bar = tqdm(total=len(pending), desc="generate", unit="resp", dynamic_ncols=True)
        for batch in ds.iter_batches(batch_size=None, batch_format="pyarrow"):
            buffer.append(batch)
            buffered += batch.num_rows
            ntok += sum(len(x) for x in batch.column("response_ids").to_pylist())
            bar.update(batch.num_rows)
            bar.set_postfix(tok_s=f"{ntok / max(1e-9, time.time() - t0):.1f}")
            if buffered >= cfg.rows_per_shard:
                shards.write_shard(pa.concat_tables(buffer))
                written += buffered
                buffer, buffered = [], 0
                if cfg.max_rows is not None and written >= cfg.max_rows:
                    break
        if buffer and (cfg.max_rows is None or written < cfg.max_rows):
            shards.write_shard(pa.concat_tables(buffer))
            written += buffered
        bar.close()
        dt = time.time() - t0
        print(f"[generate] wrote {written} rows, {ntok} response tokens in {dt:.1f}s ({ntok / max(dt, 1e-9):.1f} tok/s)")
    done = shards.done_ids()
    missing = {r["request_id"] for r in requests} - done
    if missing:
        print(f"[generate] {len(missing)} requests still missing; rerun to finish them (no manifest written)")
        return dict(meta, complete=False, missing=len(missing))
    return shards.write_manifest(dict(meta, complete=True))
