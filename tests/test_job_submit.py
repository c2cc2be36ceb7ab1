"""`ray job submit` path: a real `ray start --head` cluster on 127.0.0.1 (token auth, dashboard on loopback) runs a
real stage submitted as a job; the job's output lands on the shared path."""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline.core.runtime import LOOPBACK, apply_env, ray_start_head_command

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parent.parent


def _ray(*args, env, timeout=180):
    ray_bin = Path(sys.executable).with_name("ray")
    return subprocess.run([str(ray_bin), *args], env=env, capture_output=True, text=True, timeout=timeout)


def test_stage_as_ray_job(target_dir, tmp_path):
    apply_env()
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)
    port, dash = 6391, 8266
    start = ray_start_head_command(port=port, dashboard_port=dash, resources={"inference": 1})
    import shutil
    import tempfile

    import socket

    def free_port():
        with socket.socket() as s:
            s.bind((LOOPBACK, 0))
            return s.getsockname()[1]

    temp = tempfile.mkdtemp(prefix="rayjob", dir="/tmp")  # short: Ray's socket paths live under it
    # every agent port explicit and free: the test session's own Ray instance already holds the defaults
    ports = [f"--dashboard-agent-listen-port={free_port()}", f"--dashboard-agent-grpc-port={free_port()}",
             f"--runtime-env-agent-port={free_port()}", f"--metrics-export-port={free_port()}",
             f"--ray-client-server-port={free_port()}"]
    r = subprocess.run([str(Path(sys.executable).with_name("ray")), *start[1:], "--num-cpus=2", f"--temp-dir={temp}",
                        *ports], env=env, capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    try:
        prompts = tmp_path / "p.jsonl"
        prompts.write_text(json.dumps({"prompt": "Say hi."}) + "\n" + json.dumps({"prompt": "Count to 3."}) + "\n")
        out = tmp_path / "resp"
        deadline = time.time() + 120
        while True:  # the dashboard's job agent comes up a few seconds after `ray start` returns
            job = _ray("job", "submit", f"--address=http://{LOOPBACK}:{dash}", "--", sys.executable, "-m",
                       "jobs.generate", "--prompts", str(prompts), "--out", str(out), "--target", str(target_dir),
                       "--max-new-tokens", "8", "--max-model-len", "256", "--actor-resources", '{"inference": 1}',
                       env=dict(env, PYTHONPATH=str(ROOT)), timeout=600)
            if "No available agent" not in job.stderr + job.stdout or time.time() > deadline:
                break
            time.sleep(3)
        assert job.returncode == 0, (job.stdout + job.stderr)[-4000:]
        assert "Job 'raysubmit_" in job.stdout + job.stderr and "succeeded" in job.stdout + job.stderr
        m = json.loads((out / "manifest.json").read_text())
        assert m["complete"] and m["num_rows"] == 2
    finally:
        # stop THIS cluster only (`ray stop` would also kill the test session's own cluster): every process of
        # it carries its temp dir on the command line
        subprocess.run(["pkill", "-TERM", "-f", temp])
        time.sleep(3)
        subprocess.run(["pkill", "-KILL", "-f", temp])
        shutil.rmtree(temp, ignore_errors=True)
