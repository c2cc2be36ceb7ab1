"""The reference deployment's topology on one machine: a 3-node Ray cluster (a head that is the training node, two
inference nodes; separate raylets with their own resources, all on 127.0.0.1, started with Ray's own multi-node
simulator ray.cluster_utils.Cluster).  The pipeline job (jobs.miniature: generate -> extract into Mooncake -> train)
connects to it with --address and its default placement rule must put every vLLM actor on an inference node (one
per node) and every Ray Train worker on the training node.  Checked from outside through Ray's state API."""
import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.core.runtime import LOOPBACK, apply_env

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parent.parent

PLACEMENT_REPORT = r"""
import json, ray
from ray.util.state import list_actors
ray.init()
roles = {n["NodeID"]: ("training" if n["Resources"].get("training") else
                       "inference" if n["Resources"].get("inference") else "other")
         for n in ray.nodes() if n["Alive"]}
out = [{"class": a.class_name, "node": a.node_id, "role": roles.get(a.node_id, "?")}
       for a in list_actors(limit=10000, raise_on_missing_output=False)]
print("REPORT" + json.dumps({"roles": roles, "actors": out}))
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


def test_three_node_placement(target_dir, tmp_path):
    apply_env()
    from ray.cluster_utils import Cluster

    node = dict(node_ip_address=LOOPBACK, object_store_memory=512 * 2**20)
    cluster = Cluster(initialize_head=True, shutdown_at_exit=True, head_node_args=dict(
        node, num_cpus=3, resources={"training": 1}, include_dashboard=True, dashboard_host=LOOPBACK,
        dashboard_port=_free_port()))
    try:
        for _ in range(2):
            cluster.add_node(**node, num_cpus=2, resources={"inference": 1})
        cluster.wait_for_nodes()
        env = dict(os.environ, PYTHONPATH=str(ROOT), RAY_ADDRESS=cluster.address)
        prompts = tmp_path / "p.jsonl"
        prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in
                                   ["Say hi.", "Count to 3.", "Name a color.", "What is 2+2?", "Name a fruit.",
                                    "Spell cat."]))
        job = subprocess.run(
            [sys.executable, "-m", "jobs.miniature", "--address", cluster.address, "--work", str(tmp_path / "run"),
             "--prompts", str(prompts), "--target", str(target_dir), "--max-new-tokens", "8",
             "--stages", "generate,extract,train", "--store", "mooncake", "--inference-actors", "2",
             "--train-steps", "2"],
            env=env, cwd=ROOT, capture_output=True, text=True, timeout=1200)
        assert job.returncode == 0, (job.stdout + job.stderr)[-5000:]
        assert (tmp_path / "run" / "train_dspark" / "drafter" / "config.json").is_file()
        # the default rule found the roles without any flag
        assert "[generate] 2 vLLM actor(s), resources {'inference': 1.0}" in job.stdout, job.stdout[-3000:]
        # the train job lists the worker's whole resource request (CPUs too); the role unit must be in it
        assert re.search(r"\[train\] 1 worker\(s\), resources \{[^}]*'training': 1\.0", job.stdout), job.stdout[-3000:]

        rep = subprocess.run([sys.executable, "-c", PLACEMENT_REPORT], env=env, capture_output=True, text=True,
                             timeout=300)
        assert rep.returncode == 0, rep.stderr[-3000:]
        report = json.loads(rep.stdout.split("REPORT", 1)[1])
        assert sorted(report["roles"].values()) == ["inference", "inference", "training"]
        by_class: dict[str, list[dict]] = {}
        for a in report["actors"]:
            by_class.setdefault(a["class"], []).append(a)
        # a pool actor that was never needed (6 prompts fit one batch) may be torn down before it was placed
        # (node None); every actor that WAS placed must be on a node of its role
        placed = lambda name: [a for c, v in by_class.items() if name in c for a in v if a["node"]]  # noqa: E731
        gen, ext, trn = placed("VLLMGenerator"), placed("VLLMExtractor"), placed("RayTrainWorker")
        assert gen and ext and len(trn) == 1, report["actors"]
        assert {a["role"] for a in gen + ext} == {"inference"}, gen + ext
        assert len({a["node"] for a in gen}) == len(gen) and len({a["node"] for a in ext}) == len(ext)  # 1/node
        assert {a["role"] for a in trn} == {"training"}, trn
    finally:
        cluster.shutdown()
