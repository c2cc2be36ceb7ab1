"""pipeline.core.runtime: start-only settings reach a job's own process through one re-exec."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

PROBE = r"""
import sys
from pipeline.core.runtime import reexec_for_process_env, _environment_at_start
print("BEFORE", flush=True)
reexec_for_process_env()
print("AT_START", _environment_at_start().get("GLIBC_TUNABLES"), "ARGV", sys.argv[1:], flush=True)
"""


def _run(extra_env: dict, drop=("GLIBC_TUNABLES", "DSPARK_NO_REEXEC", "_DSPARK_REEXECED")):
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(extra_env)
    env["PYTHONPATH"] = str(ROOT)
    p = subprocess.run([sys.executable, "-c", PROBE, "x", "--flag"], env=env, capture_output=True, text=True,
                       timeout=120, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-2000:]
    return p.stdout.split("\n")


def test_reexec_gives_the_process_its_start_only_env():
    from pipeline.core.runtime import _DEFAULTS

    out = _run({})
    assert out.count("BEFORE") == 2  # ran once without, then once more after the exec
    assert f"AT_START {_DEFAULTS['GLIBC_TUNABLES']} ARGV ['x', '--flag']" in out


def test_reexec_respects_user_value_and_opt_out():
    out = _run({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"})  # an explicit setting wins: nothing to do
    assert out.count("BEFORE") == 1 and "AT_START glibc.malloc.arena_max=2 ARGV ['x', '--flag']" in out
    out = _run({"DSPARK_NO_REEXEC": "1"})
    assert out.count("BEFORE") == 1 and "AT_START None ARGV ['x', '--flag']" in out


def test_ray_workers_run_at_the_priority_of_the_rest_of_the_node(ray_session):
    """Ray starts its workers at nice 15 unless told otherwise; an engine replica is a worker and must not yield the
    cores to the raylet, the GCS or a client on the same node (apply_env sets RAY_worker_niceness=0)."""
    assert os.environ.get("RAY_worker_niceness") == "0"

    @ray_session.remote(num_cpus=0)
    def niceness() -> int:
        return os.getpriority(os.PRIO_PROCESS, 0)

    assert ray_session.get(niceness.remote(), timeout=120) == os.getpriority(os.PRIO_PROCESS, 0)
