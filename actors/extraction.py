"""Stage 2 on Ray Data: target hidden states for every response row, into a hidden-state store.

Primary extractor: vLLM actors running the ``extract_hidden_states`` method with our CPU-safe connector
(actors.cpu_hidden_states_connector); fallback: transformers (pipeline.data.hf_extractor).  Each sample (prompt +
response) goes through one prefill; the chosen layers and the final hidden state (the final norm applied to layer
L, in fp32) come back as bf16 and are written to the store (Parquet shards on disk, or Mooncake), manifest last.
Resumable: samples already in the store are skipped.
"""
from __future__ import annotations

import dataclasses
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import torch
from safetensors import safe_open
from tqdm import tqdm

from actors.vllm_engine import (ACTOR_MEMORY_HELP, actor_memory_request, build_llm, engine_actor_plan, engine_config,
                                engine_dtype)
from pipeline.core.config_fields import (actor_resources_field, actor_threads_field, engine_dtype_field,
                                         ray_address_field, target_field)
from pipeline.data.hf_extractor import HFExtractor
from pipeline.core.runtime import MOONCAKE_PROTOCOLS
from pipeline.launch.launch_plan import (DRY_RUN_HELP, GPU_MEM_HELP, GPUS_HELP, MAX_SEQS_HELP, TP_HELP, EngineLayout,
                                         PlanError, actor_pool_plan, check_count, check_non_negative, mooncake_plan)
from pipeline.launch.placement import INFERENCE, role_resources
from pipeline.core.runtime import init_ray
from pipeline.data.shards import ShardSet
from pipeline.stores import open_hidden_store
from pipeline.ops.layers import full_vocab_lse
from pipeline.stores.base import bytes_per_token, tensor_from_bytes, tensor_to_bytes
from pipeline.data.target_model import num_layers, resolve_target
from pipeline.dspark.config import parse_layer_ids
from pipeline.dspark.target_weights import load_target_weights

_IN_SCHEMA = pa.schema([("request_id", pa.string()), ("input_ids", pa.list_(pa.int32())),
                        ("loss_mask", pa.list_(pa.uint8()))])
_OUT_SCHEMA = pa.schema([("request_id", pa.string()), ("n_tokens", pa.int32()), ("input_ids", pa.large_binary()),
                         ("loss_mask", pa.large_binary()), ("aux_hidden", pa.large_binary()),
                         ("last_hidden", pa.large_binary()), ("target_lse", pa.large_binary())])


@dataclass
class ExtractConfig:
    responses: Path = field(default=Path("work/responses"), metadata={"help": "stage-1 output folder"})
    out: Path = field(default=Path("work/hidden"), metadata={
        "help": "disk store folder (--store disk); with --store mooncake, where the run summary is written"})
    store: str = field(default="disk", metadata={"help": "hidden-state backend", "choices": ["disk", "mooncake"]})
    mooncake_master: str | None = field(default=None, metadata={
        "help": "existing Mooncake master 'host:port' (default: the job starts one on 127.0.0.1 and stops it)"})
    mooncake_metadata: str | None = field(default=None, metadata={
        "help": "metadata server URL of an existing Mooncake master (with --mooncake-master)"})
    mooncake_prefix: str = field(default="dspark/hidden", metadata={"help": "key prefix of this data set in Mooncake"})
    mooncake_segment: str = field(default="4G", metadata={
        "help": "memory the job's own Mooncake segment server holds (when the job starts the master)"})
    target: str | None = target_field()
    layer_ids: str | None = field(default=None, metadata={
        "help": "comma-separated target layer ids (vLLM convention, 0=embeddings, L=last layer before the norm); "
                "default: DFlash rule with 3 layers"})
    extractor: str = field(default="vllm", metadata={"help": "extractor", "choices": ["vllm", "hf"]})
    max_model_len: int = field(default=2048, metadata={"help": "longest sample in tokens (longer ones are skipped)"})
    dtype: str = engine_dtype_field()
    target_lse: bool = field(default=True, metadata={
        "help": "also store the full-vocabulary logsumexp per token (4 bytes/token) so training skips the full-"
                "vocabulary LM-head pass (--target-lse false to skip)"})
    batch_size: int = field(default=16, metadata={"help": "samples per extractor call"})
    pool_size: int = field(default=1, metadata={"help": "number of extractor actors"})
    actor_cpus: float = field(default=1.0, metadata={"help": "CPUs reserved per extractor actor"})
    threads: int | None = actor_threads_field()
    actor_resources: str | None = actor_resources_field()
    actor_memory: str = field(default="auto", metadata={"help": ACTOR_MEMORY_HELP})
    limit: int | None = field(default=None, metadata={"help": "extract at most this many samples"})
    address: str | None = ray_address_field()
    gpus_per_actor: float = field(default=0.0, metadata={"help": GPUS_HELP})
    tensor_parallel_size: int = field(default=1, metadata={
        "help": TP_HELP + "; the vllm extractor needs 1 (its connector hands tensors over in-process)"})
    gpu_memory_utilization: float = field(default=0.9, metadata={"help": GPU_MEM_HELP})
    max_num_seqs: int | None = field(default=None, metadata={"help": MAX_SEQS_HELP})
    mooncake_protocol: str = field(default="tcp", metadata={
        "help": "Mooncake transport of the store clients: tcp (every build) | rdma (the CUDA build, "
                "mooncake-transfer-engine)", "choices": list(MOONCAKE_PROTOCOLS)})
    dry_run: bool = field(default=False, metadata={"help": DRY_RUN_HELP})

    def __post_init__(self):
        for name in ("pool_size", "batch_size", "max_model_len"):
            check_count(getattr(self, name), "--" + name.replace("_", "-"))
        check_non_negative(self.limit, "--limit")
        check_non_negative(self.actor_cpus, "--actor-cpus")
        check_count(self.threads, "--threads")
        layout = self.layout()
        if self.extractor == "vllm" and layout.tensor_parallel_size > 1:
            raise PlanError(f"--tensor-parallel-size {layout.tensor_parallel_size} with --extractor vllm: the "
                            "hidden-state connector hands tensors to the actor through its own process memory, so the "
                            "engine must run in it (tensor parallel workers are other processes); use "
                            "--tensor-parallel-size 1 (one GPU per extractor) or --extractor hf")
        if self.extractor == "hf" and layout.tensor_parallel_size > 1:
            raise PlanError("--tensor-parallel-size applies to the vllm extractor only (--extractor hf runs the "
                            "target on one device)")
        if self.mooncake_protocol not in MOONCAKE_PROTOCOLS:
            raise PlanError(f"--mooncake-protocol must be one of {MOONCAKE_PROTOCOLS}, got {self.mooncake_protocol!r}")

    def layout(self) -> EngineLayout:
        """The engine layout of every extractor actor (validated; PlanError names the bad flag)."""
        return EngineLayout(gpus=float(self.gpus_per_actor), tensor_parallel_size=self.tensor_parallel_size,
                            gpu_memory_utilization=self.gpu_memory_utilization,
                            max_num_seqs=self.max_num_seqs).validate()


def _final_norm(target: str):
    """The target's final RMSNorm (weight, eps), applied in fp32 to layer L's output."""
    cfg = json.loads((Path(target) / "config.json").read_text())
    eps = float(cfg.get("rms_norm_eps", 1e-6))
    for f in sorted(Path(target).glob("*.safetensors")):
        with safe_open(str(f), "pt") as sf:
            for name in ("model.norm.weight", "model.language_model.norm.weight", "norm.weight"):
                if name in sf.keys():
                    return sf.get_tensor(name).float(), eps
    raise KeyError(f"{target}: final norm weight not found")


def rms_norm_fp32(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


class VLLMExtractor:
    """Ray Data actor: pa.Table (request_id, input_ids, loss_mask) -> serialized sample tensors."""

    def __init__(self, target: str, layer_ids: list[int], n_layers: int, max_model_len: int, kind: str = "vllm",
                 dtype: str = "auto", target_lse: bool = True, layout: dict | None = None):
        self.layer_ids = list(layer_ids)
        self.kind = kind
        # cumulative seconds per part of __call__ (`python -m jobs.bench extract` prints them)
        self.timers = {"engine": 0.0, "collect": 0.0, "norm": 0.0, "lse": 0.0, "serialize": 0.0}
        self.want = sorted(set(self.layer_ids) | {n_layers})  # layer L always, for the final hidden state
        self.norm_w, self.eps = _final_norm(target)
        self.lm_head = None
        layout = EngineLayout(**layout) if layout else EngineLayout()
        if target_lse:
            self.lm_head = load_target_weights(target).lm_head.float()
        if kind == "vllm":
            self.llm = build_llm(target, max_model_len=max_model_len + 1, extract_layer_ids=self.want, dtype=dtype,
                                 layout=layout)
        else:
            self.hf = HFExtractor(target, self.layer_ids, device=layout.device)

    def _vllm_hidden(self, seqs: list[list[int]]) -> list[torch.Tensor]:
        from vllm import SamplingParams

        from actors.cpu_hidden_states_connector import _REGISTRY, pop_hidden_states

        t0 = time.perf_counter()
        outs = self.llm.generate([{"prompt_token_ids": s} for s in seqs], SamplingParams(max_tokens=1, temperature=0),
                                 use_tqdm=False)
        keys = [o.kv_transfer_params["hidden_states_path"] for o in outs]
        t1 = time.perf_counter()
        for _ in range(64):  # the connector finishes its copies on the engine's next steps
            if all(k in _REGISTRY for k in keys):
                break
            self.llm.llm_engine.step()
        result = []
        for k, s in zip(keys, seqs):
            d = pop_hidden_states(k)
            if d["token_ids"].tolist() != s:
                raise RuntimeError("vLLM returned hidden states for different tokens than requested")
            result.append(d["hidden_states"])  # [T, len(want), d]
        self.timers["engine"] += t1 - t0
        self.timers["collect"] += time.perf_counter() - t1
        return result

    def __call__(self, batch: pa.Table) -> pa.Table:
        rows = batch.to_pylist()
        out = []
        if self.kind == "vllm":
            hidden = self._vllm_hidden([r["input_ids"] for r in rows])
            idx = [self.want.index(k) for k in self.layer_ids]
            for r, hs in zip(rows, hidden):
                t0 = time.perf_counter()
                aux = hs[:, idx].reshape(hs.shape[0], -1).to(torch.bfloat16)
                last = rms_norm_fp32(hs[:, self.want.index(self.want[-1])], self.norm_w, self.eps).to(torch.bfloat16)
                self.timers["norm"] += time.perf_counter() - t0
                out.append(self._row(r, aux, last))
        else:
            for r in rows:
                aux, last = self.hf.extract(r["input_ids"])
                out.append(self._row(r, aux, last))
        return pa.Table.from_pylist(out, schema=_OUT_SCHEMA)

    def _row(self, r, aux, last):
        t0 = time.perf_counter()
        lse = None if self.lm_head is None else tensor_to_bytes(full_vocab_lse(last, self.lm_head))
        t1 = time.perf_counter()
        row = dict(request_id=r["request_id"], n_tokens=len(r["input_ids"]),
                   input_ids=tensor_to_bytes(torch.tensor(r["input_ids"], dtype=torch.int32)),
                   loss_mask=tensor_to_bytes(torch.tensor(r["loss_mask"], dtype=torch.uint8)),
                   aux_hidden=tensor_to_bytes(aux), last_hidden=tensor_to_bytes(last), target_lse=lse)
        self.timers["lse"] += t1 - t0
        self.timers["serialize"] += time.perf_counter() - t1
        return row


def row_to_sample(row: dict, aux_dim: int, hidden: int) -> dict[str, torch.Tensor]:
    T = row["n_tokens"]
    return {"input_ids": tensor_from_bytes(row["input_ids"], torch.int32, (T,)),
            "loss_mask": tensor_from_bytes(row["loss_mask"], torch.uint8, (T,)),
            "aux_hidden": tensor_from_bytes(row["aux_hidden"], torch.bfloat16, (T, aux_dim)),
            "last_hidden": tensor_from_bytes(row["last_hidden"], torch.bfloat16, (T, hidden)),
            **({} if row.get("target_lse") is None else
               {"target_lse": tensor_from_bytes(row["target_lse"], torch.float32, (T,))})}


def extraction_plan(cfg: ExtractConfig, target) -> dict:
    """What stage 2 launches (pipeline.launch.launch_plan): the Ray Data extractor pool, each actor's Ray options, its
    engine configuration and the hidden-state store; ``--dry-run`` prints it, ``run_extraction`` launches it."""
    layout = cfg.layout()
    L = num_layers(target)
    layer_ids = parse_layer_ids(cfg.layer_ids, L)
    want = sorted(set(layer_ids) | {L})  # layer L always, for the final hidden state
    dtype = engine_dtype(cfg.dtype, layout)
    store = {"backend": cfg.store}
    extra_env = {}
    if cfg.store == "mooncake":
        moon = mooncake_plan(cfg.mooncake_protocol)
        extra_env = moon["env"]
        store.update(prefix=cfg.mooncake_prefix, mooncake=dict(
            moon, master=cfg.mooncake_master or "started by the job on 127.0.0.1",
            segment=cfg.mooncake_segment if not cfg.mooncake_master else "the running master's"))
    else:
        store["folder"] = str(cfg.out)
    if cfg.extractor == "vllm":
        kwargs, env = engine_config(str(target), cfg.max_model_len + 1, 0, dtype, extract_layer_ids=want,
                                    layout=layout)
        engine = {"backend": "vllm", "device": layout.device, "kwargs": kwargs, "env": env}
    else:
        env = {}
        engine = {"backend": "transformers", "device": layout.device, "dtype": "float32"}
    engine.update(layer_ids=layer_ids, captured_layers=want, target_lse=cfg.target_lse)
    actor = engine_actor_plan("VLLMExtractor", str(target), dtype, layout, cfg.actor_cpus, cfg.threads,
                              cfg.actor_memory, cfg.actor_resources, env, kv_cache=cfg.extractor == "vllm",
                              extra_env=extra_env)
    return {
        "job": "extract",
        "ray": actor_pool_plan(cfg.address, cfg.pool_size, cfg.batch_size, actor, cfg.actor_cpus, layout),
        "engine": engine,
        "store": store,
    }


def open_store(cfg: ExtractConfig, endpoint=None):
    """The store named by the config (disk folder, or Mooncake at ``endpoint``)."""
    return open_hidden_store(cfg.store, cfg.out, cfg.mooncake_prefix, endpoint)


def run_extraction(cfg: ExtractConfig, endpoint=None) -> dict:
    """Run stage 2.  With --store mooncake, ``endpoint`` is a running master (the job starts one if None)."""
    target = resolve_target(cfg.target)
    plan = extraction_plan(cfg, target)
    os.environ.update((plan["store"].get("mooncake") or {}).get("env", {}))  # the driver's own store client
    L = num_layers(target)
    layer_ids = plan["engine"]["layer_ids"]
    hidden = json.loads((Path(target) / "config.json").read_text())["hidden_size"]
    responses = ShardSet(cfg.responses, key="request_id")
    resp_manifest = responses.manifest()  # stage 1 must have finished
    store = open_store(cfg, endpoint)
    done = store.done_ids()
    todo, too_long = [], []
    for row in responses.iter_rows(["request_id", "prompt_ids", "response_ids", "loss_mask"]):
        if row["request_id"] in done:
            continue
        ids = row["prompt_ids"] + row["response_ids"]
        if len(ids) > cfg.max_model_len:
            too_long.append(row["request_id"])
            continue
        todo.append({"request_id": row["request_id"], "input_ids": ids, "loss_mask": row["loss_mask"]})
    if cfg.limit is not None:
        todo = todo[: max(0, cfg.limit - len(done))]
    for rid in too_long:
        print(f"[extract] skipped {rid}: longer than --max-model-len {cfg.max_model_len}")
    print(f"[extract] layers {layer_ids} of {L}; {len(done)} samples already stored, {len(todo)} to extract")
    meta = dict(stage="hidden_states", target=str(target), layer_ids=layer_ids, num_target_layers=L,
                hidden_size=hidden, aux_dim=hidden * len(layer_ids), extractor=cfg.extractor,
                compute_dtype=cfg.dtype,
                responses=str(cfg.responses), response_manifest_rows=resp_manifest.get("num_rows"),
                skipped_too_long=too_long, bytes_per_token=bytes_per_token(len(layer_ids), hidden, cfg.target_lse),
                target_lse=cfg.target_lse)
    t0, ntok = time.time(), 0
    if todo:
        ray = init_ray(cfg.address)
        import ray.data
        from ray.data import ActorPoolStrategy

        ray.data.DataContext.get_current().enable_progress_bars = False
        ds = ray.data.from_arrow(pa.Table.from_pylist(todo, schema=_IN_SCHEMA))
        ds = ds.repartition(max(1, (len(todo) + cfg.batch_size - 1) // cfg.batch_size))
        layout = cfg.layout()
        resources = role_resources(INFERENCE, cfg.actor_resources, "actor-resources")
        memory = actor_memory_request(cfg.actor_memory, str(target), cfg.dtype, cfg.pool_size,
                                      kv_cache=cfg.extractor == "vllm", layout=layout)
        print(f"[extract] {cfg.pool_size} extractor actor(s), resources {resources or 'unconstrained'}, "
              f"memory {memory / 2**30:.1f} GiB each, {layout.device} engine"
              + (f" on {layout.gpus:g} GPU(s) each" if layout.gpus else ""))
        ds = ds.map_batches(VLLMExtractor, batch_format="pyarrow", batch_size=cfg.batch_size,
                            compute=ActorPoolStrategy(size=cfg.pool_size), num_cpus=cfg.actor_cpus,
                            **({"num_gpus": layout.gpus} if layout.gpus else {}),
                            **({"memory": memory} if memory else {}),
                            **({"resources": resources} if resources else {}),
                            runtime_env=plan["ray"]["actor"]["runtime_env"],
                            fn_constructor_kwargs=dict(target=str(target), layer_ids=layer_ids, n_layers=L,
                                                       max_model_len=cfg.max_model_len, kind=cfg.extractor,
                                                       dtype=cfg.dtype, target_lse=cfg.target_lse,
                                                       layout=dataclasses.asdict(layout)))
        bar = tqdm(total=len(todo), desc="extract", unit="sample", dynamic_ncols=True)
        for batch in ds.iter_batches(batch_size=None, batch_format="pyarrow"):
            for row in batch.to_pylist():
                store.put(row["request_id"], row_to_sample(row, hidden * len(layer_ids), hidden))
                ntok += row["n_tokens"]
            store.flush()
            bar.update(batch.num_rows)
            bar.set_postfix(tok_s=f"{ntok / max(1e-9, time.time() - t0):.0f}")
        bar.close()
    dt = time.time() - t0
    manifest = store.commit(dict(meta, extract_seconds=round(dt, 2), extracted_tokens=ntok))
    if ntok:
        print(f"[extract] {ntok} tokens in {dt:.1f}s: {ntok / dt:.0f} tok/s end to end (incl. engine start); "
              f"{meta['bytes_per_token']} bytes/token stored")
    store.close()
    return manifest
