"""Start-up and shutdown faults of the batch stages, through the scenario code of ``python -m jobs.bench faults``
(jobs/bench/faults.py): the real ``python -m jobs.<stage>`` commands, killed with a signal at start-up or in the
middle of their work, then run again to the end, must give what an uninterrupted run of the same command gives,
lose and duplicate nothing, and leave no process and no temporary file behind.  generate and extract run on the
session's Ray cluster (RAY_ADDRESS), so a killed job's actors must be ended by the cluster; train starts its own, as
the benchmark's commands all do.  Also: a dead cluster's address file does not block a job's own local cluster."""
import os
import subprocess
import sys
import tempfile

import pytest

from jobs.bench.faults import Command, run_scenario, run_to_done, stage_commands, train_args
from jobs.train import main as train_main
from pipeline.core.runtime import PROJECT_ROOT
from tiny_training import build_tiny_training_set

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def commands(ray_session, target_dir, tmp_path_factory):
    """generate / extract commands on 4 prompts (2 shards each) on the session cluster, with the uninterrupted
    generate run done (extract's input)."""
    root = tmp_path_factory.mktemp("faults")
    env = {"RAY_ADDRESS": ray_session.get_runtime_context().gcs_address}
    cmds = stage_commands(root, target_dir, n_prompts=4, env=env)
    run_to_done(cmds["generate"], root / "logs" / "generate.reference.log")
    return root, cmds


def assert_recovered(o, kept: bool):
    """The rerun finished with the uninterrupted run's output, nothing lost or duplicated, nothing left behind."""
    assert o.error is None, o.error
    assert (o.kept is not None) == kept, o.kept
    assert o.equal, o.detail
    assert o.lost == [] and o.duplicated == []
    assert o.leftovers == [], f"processes of the killed run still alive: {o.leftovers}"
    assert o.temporaries_after_rerun == [], o.temporaries_after_rerun
    assert o.temp_folder_left == [], o.temp_folder_left


def test_generate_sigterm_at_startup(commands):
    """Stopped before it wrote anything: the same command generates every row, as the uninterrupted run did."""
    root, cmds = commands
    o = run_scenario(cmds["generate"].with_out(root / "killed" / "generate"), cmds["generate"].out, "SIGTERM",
                     "startup", root / "logs", startup_delay=3.0)
    assert_recovered(o, kept=False)
    assert o.killed_after_s < 10


def test_extract_sigkill_midwork(commands):
    """Killed after its first hidden-state shard: the rerun extracts only the rest, the store equals an
    uninterrupted run's bit for bit, and the killed engine's rendezvous file (vllm_dist_*) is swept by the rerun's
    engine."""
    root, cmds = commands
    run_to_done(cmds["extract"], root / "logs" / "extract.reference.log")
    o = run_scenario(cmds["extract"].with_out(root / "killed" / "extract"), cmds["extract"].out, "SIGKILL",
                     "midwork", root / "logs")
    assert_recovered(o, kept=True)
    assert "bitwise" in o.detail
    kept = int(o.kept.split()[0])
    rerun = (root / "logs" / "extract-SIGKILL-midwork.rerun.log").read_text()
    assert f"{kept} samples already stored, {4 - kept} to extract" in rerun


def test_train_sigkill_midwork_resumes_exactly(tmp_path):
    """Killed after its first checkpoint: the same command (with --resume, which also starts the first run)
    continues from the newest checkpoint, and the losses of every step and the exported weights equal the
    uninterrupted run's bit for bit.  The checkpoint being staged when the kill came is swept by the rerun's
    trainer, and the checkpoints the killed run persisted but Ray Train never registered by the rerun's end.  The
    uninterrupted run is the single-process back end's (the same Trainer, bit for bit the Ray run's, in seconds
    instead of a Ray start).  The job starts its own cluster, as a user's does: on a cluster without a dashboard
    (the session's) Ray Train's detached placement-group cleaner of a killed run cannot query the controller's
    state and never exits."""
    tiny = build_tiny_training_set(tmp_path / "tiny")
    args = train_args(tiny / "hidden", tmp_path / "reference", tiny / "target", steps=12)
    train_main([*args, "--backend", "local", "--device", "cpu"])
    cmd = Command("train", args, tmp_path / "reference").with_out(tmp_path / "killed")
    o = run_scenario(cmd, tmp_path / "reference", "SIGKILL", "midwork", tmp_path / "logs")
    assert_recovered(o, kept=True)
    # it resumed from the newest checkpoint the killed run left (not from an older one Ray Train had registered)
    rerun = (tmp_path / "logs" / "train-SIGKILL-midwork.rerun.log").read_text()
    assert f"resumed at step {o.kept.split()[-1]}" in rerun, (o.kept, rerun[-2000:])
    assert "bitwise" in o.detail


STALE_ADDRESS = """
import os, time
from pipeline.core.runtime import init_ray
os.makedirs(os.path.join(os.environ["TMPDIR"], "ray"), exist_ok=True)
with open(os.path.join(os.environ["TMPDIR"], "ray", "ray_current_cluster"), "w") as f:
    f.write("127.0.0.1:9")  # what a `ray start` head killed without `ray stop` leaves: nothing listens there
ray = init_ray(num_cpus=1)
print("STARTED", ray.get_runtime_context().gcs_address, flush=True)
ray.shutdown()
"""


def test_dead_cluster_address_file_does_not_block_a_local_start():
    """ray.init() without an address joins the cluster named in <temp>/ray/ray_current_cluster (``ray start`` and
    Ray's test clusters write it); one killed without ``ray stop`` leaves a dead address there, which ray.init
    retried without end.  A job's own local cluster (init_ray with no address) ignores the file."""
    with tempfile.TemporaryDirectory(dir="/tmp") as tmp:  # short: Ray's socket paths live under it
        env = dict(os.environ, TMPDIR=tmp, PYTHONPATH=str(PROJECT_ROOT))
        env.pop("RAY_ADDRESS", None)
        p = subprocess.run([sys.executable, "-c", STALE_ADDRESS], cwd=PROJECT_ROOT, env=env, capture_output=True,
                           text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    started = [line for line in p.stdout.splitlines() if line.startswith("STARTED")]
    assert started and not started[0].endswith(":9")
