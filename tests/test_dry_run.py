"""``--dry-run`` of jobs.generate / jobs.extract / jobs.serve: the printed Ray resources, vLLM engine configuration
and Serve deployment options for a CPU layout and for GPU layouts (two inference nodes with one GPU per engine;
Serve with vLLM on one GPU per replica), field by field; nothing is started.  Bad flag combinations are usage
errors naming the flag.  A simulated two-node cluster with one (logical) GPU per node then places actors with the
printed options: one engine per inference node.  No GPU needed."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig

from jobs import extract as extract_job
from jobs import generate as generate_job
from jobs import serve as serve_job
from pipeline.dspark.checkpoint import export_checkpoint
from pipeline.dspark.config import DrafterConfig
from pipeline.dspark.drafter import DSparkDrafter
from pipeline.launch.launch_plan import MOONCAKE_GPU_PACKAGE, installed_version
from pipeline.core.runtime import cpu_has_native_bf16
from serve_app.app import ROUTER_CLASS, vllm_class_fields

ROOT = Path(__file__).resolve().parent.parent
GIB = 2**30
RUNTIME_BYTES = int(1.3 * GIB)  # what actors/vllm_engine.py documents as the engine's own footprint


def _weights(target, dtype: str) -> int:
    """The target's weight bytes at ``dtype`` from its files (stored dtype from config.json)."""
    folder = Path(target)
    stored = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    cfg = json.loads((folder / "config.json").read_text())
    width = {"float32": 4, "bfloat16": 2, "float16": 2}
    return stored * width[dtype] // width[cfg.get("torch_dtype") or cfg.get("dtype") or "float32"]


def _dry(job, argv, capsys) -> dict:
    job.main(argv + ["--dry-run"])
    out = capsys.readouterr().out
    return json.loads(out)


def _usage_error(job, argv, capsys) -> str:
    with pytest.raises(SystemExit) as e:
        job.main(argv + ["--dry-run"])
    err = capsys.readouterr().err
    assert e.value.code == 2, err  # argparse's usage-error status
    return err


@pytest.fixture(scope="module")
def drafters(target_dir, tmp_path_factory):
    """Exported checkpoints of the kinds vLLM can and cannot load."""
    hf = AutoConfig.from_pretrained(target_dir)
    root = tmp_path_factory.mktemp("drafters")
    out = {}
    for name, kw in {"vanilla": {}, "gated": {"markov_head_type": "gated"}, "rnn": {"markov_head_type": "rnn"},
                     "dflash": {"kind": "dflash"}}.items():
        torch.manual_seed(0)
        cfg = DrafterConfig.from_target_config(hf, num_hidden_layers=1, draft_vocab_size=512,
                                               **({"markov_rank": 16} if name != "dflash" else {}), **kw)
        d = DSparkDrafter.from_target(cfg, target_dir, draft_ids=torch.arange(512))
        with warnings.catch_warnings():  # export warns that vLLM cannot load the gated / rnn / dflash ones
            warnings.simplefilter("ignore")
            out[name] = export_checkpoint(d, root / name, verifier_name_or_path=str(target_dir))
    return out


# ------------------------------------------------------------------------------------------------ generate
def test_generate_cpu_layout(target_dir, capsys):
    plan = _dry(generate_job, ["--target", str(target_dir), "--max-model-len", "1024", "--seed", "3",
                               "--threads", "2"], capsys)
    assert plan["job"] == "generate"
    dtype = "bfloat16" if cpu_has_native_bf16() else "float32"
    kv_gb = float(os.environ["VLLM_CPU_KVCACHE_SPACE"])
    actor = plan["ray"]["actor"]
    assert actor["class"] == "VLLMGenerator"
    assert actor["num_cpus"] == 1.0 and actor["num_gpus"] == 0.0
    assert actor["memory"] == int(1.25 * (_weights(target_dir, dtype) + kv_gb * GIB + RUNTIME_BYTES))
    assert actor["resources"] == {"inference": 1.0} and actor["placement"]["rule"] == "auto"
    assert actor["placement"]["otherwise"] == {}
    assert actor["runtime_env"] == {"env_vars": {"OMP_NUM_THREADS": "2", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                                                 "VLLM_TARGET_DEVICE": "cpu",
                                                 "VLLM_CPU_KVCACHE_SPACE": os.environ["VLLM_CPU_KVCACHE_SPACE"]}}
    assert plan["ray"]["actor_pool"] == {"strategy": "ray.data.ActorPoolStrategy", "size": 1, "batch_size": 16}
    assert plan["ray"]["total"] == {"num_cpus": 1.0, "num_gpus": 0.0, "memory": actor["memory"]}
    eng = plan["engine"]
    assert eng["backend"] == "vllm" and eng["device"] == "cpu"
    assert eng["kwargs"] == {"model": str(target_dir), "dtype": dtype, "max_model_len": 1024, "seed": 3,
                             "enforce_eager": True, "enable_chunked_prefill": False}
    assert eng["env"] == {k: v for k, v in actor["runtime_env"]["env_vars"].items() if k != "OMP_NUM_THREADS"}


def test_generate_two_gpu_nodes(target_dir, capsys):
    """Two inference nodes with one GPU each: two actors, one GPU and one inference unit each."""
    plan = _dry(generate_job, ["--target", str(target_dir), "--pool-size", "2", "--gpus-per-actor", "1",
                               "--gpu-memory-utilization", "0.85", "--max-num-seqs", "64", "--actor-cpus", "4",
                               "--actor-resources", '{"inference": 1}'], capsys)
    actor = plan["ray"]["actor"]
    assert actor["num_gpus"] == 1.0 and actor["num_cpus"] == 4.0
    # KV cache on the GPU: host memory = weights (bf16) + runtime
    assert actor["memory"] == int(1.25 * (_weights(target_dir, "bfloat16") + RUNTIME_BYTES))
    assert actor["resources"] == {"inference": 1.0} and actor["placement"]["rule"] == "explicit"
    env = actor["runtime_env"]["env_vars"]
    assert env["VLLM_TARGET_DEVICE"] == "cuda" and not any(k.startswith("VLLM_CPU") for k in env)
    assert plan["ray"]["actor_pool"]["size"] == 2
    assert plan["ray"]["total"] == {"num_cpus": 8.0, "num_gpus": 2.0, "memory": 2 * actor["memory"]}
    assert plan["engine"]["device"] == "cuda"
    assert plan["engine"]["kwargs"] == {"model": str(target_dir), "dtype": "bfloat16", "max_model_len": 2048,
                                        "seed": 0, "tensor_parallel_size": 1, "gpu_memory_utilization": 0.85,
                                        "max_num_seqs": 64}
    eng_fields = vllm_class_fields("engine/arg_utils.py", "EngineArgs")
    if eng_fields:  # the installed vLLM knows every name
        assert set(plan["engine"]["kwargs"]) <= eng_fields


def test_generate_tensor_parallel(target_dir, capsys):
    plan = _dry(generate_job, ["--target", str(target_dir), "--gpus-per-actor", "2", "--tensor-parallel-size", "2"],
                capsys)
    assert plan["ray"]["actor"]["num_gpus"] == 2.0
    kw = plan["engine"]["kwargs"]
    assert kw["tensor_parallel_size"] == 2 and kw["distributed_executor_backend"] == "mp"


# ------------------------------------------------------------------------------------------------ extract
def test_extract_gpu_mooncake(target_dir, capsys):
    plan = _dry(extract_job, ["--target", str(target_dir), "--pool-size", "2", "--gpus-per-actor", "1",
                              "--store", "mooncake", "--layer-ids", "2,15,28", "--max-model-len", "512"], capsys)
    assert plan["job"] == "extract"
    actor = plan["ray"]["actor"]
    assert actor["class"] == "VLLMExtractor" and actor["num_gpus"] == 1.0
    assert actor["runtime_env"]["env_vars"]["DSPARK_MOONCAKE_PROTOCOL"] == "tcp"
    kw = plan["engine"]["kwargs"]
    n_layers = AutoConfig.from_pretrained(target_dir).num_hidden_layers
    assert plan["engine"]["captured_layers"] == [2, 15, 28, n_layers]
    assert kw["speculative_config"] == {"method": "extract_hidden_states", "num_speculative_tokens": 1,
                                        "draft_model_config": {"hf_config": {
                                            "eagle_aux_hidden_state_layer_ids": [2, 15, 28, n_layers]}}}
    assert kw["max_model_len"] == 513 and kw["dtype"] == "bfloat16" and kw["tensor_parallel_size"] == 1
    assert kw["kv_transfer_config"]["kv_connector_module_path"] == "actors.cpu_hidden_states_connector"
    moon = plan["store"]["mooncake"]
    assert plan["store"]["backend"] == "mooncake" and moon["protocol"] == "tcp"
    assert moon["rdma_available"] == (installed_version(MOONCAKE_GPU_PACKAGE) is not None)


def test_extract_rdma_needs_the_cuda_build(target_dir, capsys):
    if installed_version(MOONCAKE_GPU_PACKAGE):
        plan = _dry(extract_job, ["--target", str(target_dir), "--store", "mooncake", "--mooncake-protocol", "rdma"],
                    capsys)
        assert plan["store"]["mooncake"]["protocol"] == "rdma"
        return
    with pytest.raises(SystemExit) as e:
        extract_job.main(["--target", str(target_dir), "--store", "mooncake", "--mooncake-protocol", "rdma",
                          "--dry-run"])
    assert "--mooncake-protocol rdma" in str(e.value) and MOONCAKE_GPU_PACKAGE in str(e.value)


# ------------------------------------------------------------------------------------------------ serve
def test_serve_vllm_one_gpu_per_replica(target_dir, drafters, capsys):
    plan = _dry(serve_job, ["--target", str(target_dir), "--engine", "vllm", "--drafter", str(drafters["vanilla"]),
                            "--replicas", "2", "--gamma", "4", "--max-batch", "32", "--max-queue", "16",
                            "--gpu-memory-utilization", "0.8"], capsys)
    assert plan["job"] == "serve"
    eng_dep, ingress = plan["ray"]["deployments"]
    assert eng_dep["name"] == "DSparkEngine" and eng_dep["num_replicas"] == 2
    assert eng_dep["max_ongoing_requests"] == 48
    assert eng_dep["ray_actor_options"] == {"num_cpus": 1.0, "num_gpus": 1.0}
    assert eng_dep["request_router"]["request_router_class"] == ROUTER_CLASS == "serve_app.router.LoadAwareRouter"
    assert eng_dep["request_router"]["request_routing_stats_period_s"] == 1.0
    assert ingress["name"] == "OpenAIIngress" and ingress["ray_actor_options"] == {"num_cpus": 0}
    assert plan["ray"]["total"] == {"num_cpus": 2.0, "num_gpus": 2.0}
    eng = plan["engine"]
    assert eng["backend"] == "vllm" and eng["replica_class"] == "serve_app.vllm_replica.VLLMEngineReplica"
    assert eng["env"] == {"VLLM_TARGET_DEVICE": "cuda"}
    assert eng["kwargs"] == {
        "model": str(target_dir), "served_model_name": Path(target_dir).name, "dtype": "bfloat16",
        "max_model_len": 8192, "seed": 0, "tensor_parallel_size": 1, "gpu_memory_utilization": 0.8,
        "max_num_seqs": 32,
        "speculative_config": {"method": "dspark", "model": str(drafters["vanilla"]), "num_speculative_tokens": 4,
                               "draft_sample_method": "probabilistic", "rejection_sample_method": "standard",
                               "enable_adaptive_verification": True},
        "per_request_spec_decode_metrics": "summary"}
    eng_fields = vllm_class_fields("engine/arg_utils.py", "EngineArgs")
    spec_fields = vllm_class_fields("config/speculative.py", "SpeculativeConfig")
    if eng_fields:  # the installed vLLM knows every name
        assert set(eng["kwargs"]) <= eng_fields and set(eng["kwargs"]["speculative_config"]) <= spec_fields
    assert "adaptive verification" in eng["depth_control"]
    assert plan["serve"]["url"] == "http://127.0.0.1:8000/v1"


def test_serve_vllm_fixed_depth_and_tensor_parallel(target_dir, drafters, capsys):
    plan = _dry(serve_job, ["--target", str(target_dir), "--engine", "vllm", "--drafter", str(drafters["vanilla"]),
                            "--scheduler", "fixed", "--tensor-parallel-size", "2", "--draft-sample-method",
                            "greedy"], capsys)
    assert plan["ray"]["deployments"][0]["ray_actor_options"]["num_gpus"] == 2.0
    kw = plan["engine"]["kwargs"]
    assert kw["tensor_parallel_size"] == 2 and kw["distributed_executor_backend"] == "mp"
    spec = kw["speculative_config"]
    assert spec["enable_adaptive_verification"] is False and spec["draft_sample_method"] == "greedy"
    assert spec["num_speculative_tokens"] == 7  # the drafter's block size
    assert plan["engine"]["depth_control"] == "fixed num_speculative_tokens"


def test_serve_native_cpu(target_dir, drafters, capsys):
    plan = _dry(serve_job, ["--target", str(target_dir), "--drafter", str(drafters["gated"]), "--replicas", "2",
                            "--threads", "1"], capsys)
    eng_dep = plan["ray"]["deployments"][0]
    assert eng_dep["ray_actor_options"] == {"num_cpus": 1.0, "num_gpus": 0.0}
    assert plan["engine"]["backend"] == "native" and plan["engine"]["device"] == "cpu"
    opts = plan["engine"]["replica_options"]
    assert opts["dtype"] == "auto" and opts["drafter"] == str(drafters["gated"]) and opts["threads"] == 1  # per replica
    assert opts["max_num_batched_tokens"] == 256 and opts["kv_cache_gb"] == 2.0
    assert eng_dep["request_router"]["request_router_class"] == ROUTER_CLASS


def test_serve_vllm_plain_decoding_on_cpu(target_dir, capsys):
    """--vllm-device cpu: the vllm-cpu build's plain decoding behind the same API (no GPU, KV cache in host memory)."""
    plan = _dry(serve_job, ["--target", str(target_dir), "--engine", "vllm", "--vllm-device", "cpu", "--scheduler",
                            "none", "--dtype", "bfloat16"], capsys)
    assert plan["ray"]["deployments"][0]["ray_actor_options"]["num_gpus"] == 0.0
    assert plan["engine"]["device"] == "cpu" and plan["engine"]["depth_control"] == "no speculation"
    assert plan["engine"]["env"]["VLLM_TARGET_DEVICE"] == "cpu" and plan["engine"]["env"]["VLLM_CPU_KVCACHE_SPACE"]
    assert plan["engine"]["kwargs"]["dtype"] == "bfloat16" and "speculative_config" not in plan["engine"]["kwargs"]


# ------------------------------------------------------------------------------------------------ bad input
@pytest.mark.parametrize("argv,message", [
    (["--tensor-parallel-size", "2", "--gpus-per-actor", "1"], "--tensor-parallel-size 2 needs --gpus-per-actor 2"),
    (["--tensor-parallel-size", "2"], "--tensor-parallel-size 2 shards the target over GPUs"),
    (["--gpus-per-actor", "-1"], "--gpus-per-actor must be >= 0"),
    (["--gpus-per-actor", "2"], "--gpus-per-actor 2 with --tensor-parallel-size 1"),
    (["--gpus-per-actor", "1.5", "--tensor-parallel-size", "1"], "--gpus-per-actor above 1 must be a whole number"),
    (["--gpus-per-actor", "0.5"], "--gpu-memory-utilization 0.9 exceeds"),
    (["--gpus-per-actor", "1", "--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization must lie in (0, 1]"),
    (["--tensor-parallel-size", "0"], "--tensor-parallel-size must be an integer >= 1"),
    (["--max-num-seqs", "0"], "--max-num-seqs must be >= 1"),
    (["--pool-size", "-2"], "--pool-size must be >= 1"),
    (["--actor-cpus", "-1"], "--actor-cpus must be >= 0"),
])
def test_generate_bad_layouts(target_dir, capsys, argv, message):
    assert message in _usage_error(generate_job, ["--target", str(target_dir)] + argv, capsys)


def test_extract_bad_layouts(target_dir, capsys):
    err = _usage_error(extract_job, ["--target", str(target_dir), "--gpus-per-actor", "2",
                                     "--tensor-parallel-size", "2"], capsys)
    assert "--tensor-parallel-size 2 with --extractor vllm" in err
    err = _usage_error(extract_job, ["--target", str(target_dir), "--pool-size", "0"], capsys)
    assert "--pool-size must be >= 1" in err


def test_serve_vllm_cpu_refuses_speculation(target_dir, drafters, capsys):
    err = _usage_error(serve_job, ["--target", str(target_dir), "--engine", "vllm", "--vllm-device", "cpu",
                                   "--drafter", str(drafters["vanilla"])], capsys)
    assert "--vllm-device cpu runs vLLM's plain decoding only" in err and "--engine native" in err


@pytest.mark.parametrize("kind,message", [("gated", "its Markov head is 'gated'"), ("rnn", "its Markov head is 'rnn'"),
                                          ("dflash", "it has no Markov head")])
def test_serve_vllm_refuses_checkpoints_it_cannot_load(target_dir, drafters, capsys, kind, message):
    err = _usage_error(serve_job, ["--target", str(target_dir), "--engine", "vllm", "--drafter",
                                   str(drafters[kind])], capsys)
    assert "--engine vllm cannot load --drafter" in err and message in err and "--engine native" in err


@pytest.mark.parametrize("argv,message", [
    (["--tensor-parallel-size", "2"], "--tensor-parallel-size 2 needs --engine vllm"),
    (["--engine", "vllm", "--scheduler", "none", "--tensor-parallel-size", "0"], "--tensor-parallel-size must be"),
    (["--engine", "vllm", "--scheduler", "none", "--gpu-memory-utilization", "0"], "--gpu-memory-utilization"),
    (["--engine", "vllm", "--scheduler", "none", "--dtype", "float32:mkl"], "--dtype float32:mkl"),
    (["--replica-cpus", "-1"], "--replica-cpus must be >= 0"),
    (["--max-model-len", "9000"], "--max-model-len 9000: the target has 8192 positions"),
    (["--max-num-batched-tokens", "8"], "--max-num-batched-tokens (8) must exceed --max-batch (8)"),
    (["--engine", "vllm", "--vllm-device", "cpu", "--scheduler", "none", "--tensor-parallel-size", "2"],
     "--vllm-device cpu runs one engine per replica"),
])
def test_serve_bad_layouts(target_dir, capsys, argv, message):
    assert message in _usage_error(serve_job, ["--target", str(target_dir)] + argv, capsys)


# ------------------------------------------------------------------------------------------------ nothing starts
NOTHING_STARTS = r"""
import json, sys
from jobs import generate, serve
generate.main(["--target", sys.argv[1], "--gpus-per-actor", "1", "--dry-run"])
serve.main(["--target", sys.argv[1], "--engine", "vllm", "--drafter", sys.argv[2], "--dry-run"])
ray = sys.modules.get("ray")
print("STATE" + json.dumps({"vllm_imported": "vllm" in sys.modules,
                            "ray_initialized": bool(ray is not None and ray.is_initialized())}))
"""


def test_dry_run_starts_nothing(target_dir, drafters):
    """The real CLIs in a fresh interpreter, with RAY_ADDRESS naming a port nothing listens on: a ray.init would
    fail; vLLM is never imported."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), RAY_ADDRESS="127.0.0.1:9")
    r = subprocess.run([sys.executable, "-c", NOTHING_STARTS, str(target_dir), str(drafters["vanilla"])], env=env,
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    state = json.loads(r.stdout.split("STATE", 1)[1])
    assert state == {"vllm_imported": False, "ray_initialized": False}
    first = json.loads(r.stdout[: r.stdout.index("}\n{") + 1])  # the generate plan, then the serve plan
    assert first["job"] == "generate" and first["ray"]["address"] == "127.0.0.1:9"


# ------------------------------------------------------------------------------------------------ placement
PLACE_WITH_PLAN = r"""
import json, sys
import ray
from ray.cluster_utils import Cluster
from pipeline.core.runtime import LOOPBACK, apply_env

apply_env()
plan = json.loads(sys.stdin.read())
actor = plan["ray"]["actor"]
node = dict(node_ip_address=LOOPBACK, object_store_memory=256 * 2**20, num_cpus=1)
cluster = Cluster(initialize_head=True, shutdown_at_exit=True, head_node_args=dict(node, include_dashboard=False))
try:
    for _ in range(2):   # two inference nodes, one (logical) GPU each
        cluster.add_node(**node, num_gpus=1, resources={"inference": 1})
    cluster.wait_for_nodes()
    ray.init(address=cluster.address)

    class Engine:
        def where(self):
            ctx = ray.get_runtime_context()
            return {"node": ctx.get_node_id(), "gpus": ctx.get_accelerator_ids().get("GPU", [])}

    cls = ray.remote(num_cpus=0, num_gpus=actor["num_gpus"], resources=actor["resources"])(Engine)
    pool = [cls.remote() for _ in range(plan["ray"]["actor_pool"]["size"])]
    placed = ray.get([a.where.remote() for a in pool], timeout=300)
    extra = cls.remote()   # a third engine finds no free GPU + inference unit
    ready, _ = ray.wait([extra.where.remote()], timeout=5)
    roles = {n["NodeID"]: n["Resources"].get("inference", 0) for n in ray.nodes() if n["Alive"]}
    print("PLACED" + json.dumps({"placed": placed, "roles": roles, "third_started": bool(ready)}))
finally:
    ray.shutdown()
    cluster.shutdown()
"""


@pytest.mark.slow
def test_gpu_plan_places_one_engine_per_inference_node(target_dir, capsys):
    """The printed GPU layout on a simulated 2-node cluster (Ray's GPU resource is a count; no GPU needed): each
    engine gets one GPU on its own inference node, and the pool uses them all."""
    plan = _dry(generate_job, ["--target", str(target_dir), "--pool-size", "2", "--gpus-per-actor", "1",
                               "--actor-resources", '{"inference": 1}'], capsys)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("RAY_ADDRESS", None)
    r = subprocess.run([sys.executable, "-c", PLACE_WITH_PLAN], input=json.dumps(plan), env=env, cwd=ROOT,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    rep = json.loads(r.stdout.split("PLACED", 1)[1])
    nodes = [p["node"] for p in rep["placed"]]
    assert len(set(nodes)) == 2 and all(rep["roles"][n] == 1 for n in nodes)  # one per inference node
    assert all(len(p["gpus"]) == 1 for p in rep["placed"])
    assert not rep["third_started"]
