"""Stop ``jobs.serve`` (or one of its engine replicas) at a chosen moment, start it again, and measure what a user
sees: how long until ``GET /health`` is 200, whether the restarted server's greedy output equals the target's, and
what the stopped run left behind (processes of the stopped run still alive).

    python -m jobs.bench serve_faults [--drafter DIR] [--moments ray-start deploying serving replica]
                                      [--signals SIGTERM SIGKILL]

The moments of a ``jobs.serve`` start-up, in order:

    ray-start      2 s after launch: Ray's local cluster is starting
    deploying      the driver printed "deployed": the ingress is up, the engine replicas are loading
    serving        the first engine replica is ready (GET /health 200)

and ``replica`` (while serving, one engine replica's process is stopped; Serve starts a new one).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.core.runtime import PROJECT_ROOT

NAME = "serve_faults"
HELP = "stop jobs.serve (or a replica) while it starts / serves, start it again: time to ready, output, leftovers"
HEADER = ["what", "signal", "when", "stopped after s", "ready again after s", "greedy output equal", "leftovers",
          "notes"]

MOMENTS = ("ray-start", "deploying", "serving", "replica")
SIGNALS = {"SIGTERM": signal.SIGTERM, "SIGKILL": signal.SIGKILL, "SIGINT": signal.SIGINT}


def http_get(url: str, timeout: float = 10.0) -> tuple[int, dict | None]:
    """(status, JSON body or None); status 0 when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        try:
            return e.code, json.loads(e.read() or b"null")
        except ValueError:
            return e.code, None
    except (OSError, ValueError):
        return 0, None


def http_post(url: str, body: dict, timeout: float = 120.0) -> tuple[int, dict | None]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        try:
            return e.code, json.loads(e.read() or b"null")
        except ValueError:
            return e.code, None
    except OSError:
        return 0, None


@dataclass
class ServeRun:
    """One ``python -m jobs.serve`` in a session of its own (so a signal to its group reaches what it started)."""

    args: list
    port: int
    log: Path
    proc: subprocess.Popen | None = None
    t0: float = 0.0

    def start(self) -> "ServeRun":
        self.log.parent.mkdir(parents=True, exist_ok=True)
        out = open(self.log, "w")
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen([sys.executable, "-m", "jobs.serve", *self.args, "--port", str(self.port)],
                                     cwd=PROJECT_ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        return self

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def wait_for(self, text: str, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if text in self.output():
                return True
            if self.proc.poll() is not None:
                return False
            time.sleep(0.2)
        return False

    def wait_ready(self, timeout: float) -> float | None:
        """Seconds from launch until GET /health is 200 (None: not within ``timeout``, or the driver exited)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return None
            status, _ = http_get(self.base + "/health", timeout=5)
            if status == 200:
                return time.monotonic() - self.t0
            time.sleep(0.5)
        return None

    def stop(self, sig: int = signal.SIGTERM, wait_s: float = 60.0) -> None:
        """Signal the driver (as a user's Ctrl-C / kill / pod stop does) and wait for it to exit."""
        if self.proc is None or self.proc.poll() is not None:
            return
        os.kill(self.proc.pid, sig)
        try:
            self.proc.wait(wait_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


AGENT_GRACE_S = 90.0  # how long after the restart check a killed run's Ray agents may still be exiting


def descendants(pid: int) -> dict[int, str]:
    """{pid: command line} of every process ``pid`` started, directly or not, that is alive now."""
    import psutil

    try:
        kids = psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return {}
    out = {}
    for k in kids:
        try:
            out[k.pid] = " ".join(k.cmdline())[:80]
        except psutil.Error:
            pass
    return out


def survivors(procs: dict[int, str], settle_s: float = 30.0) -> list[str]:
    """Which of ``procs`` are still alive ``settle_s`` after a stop (Ray's own clean-up gets that long): what the
    stopped run left running."""
    import psutil

    deadline = time.monotonic() + settle_s
    while True:
        alive = [f"{pid} {cmd}" for pid, cmd in procs.items()
                 if psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]
        if not alive or time.monotonic() >= deadline:
            return alive
        time.sleep(1.0)


def engine_replica_pids() -> list[int]:
    import psutil

    return [p.info["pid"] for p in psutil.process_iter(["pid", "cmdline"])
            if "ServeReplica" in " ".join(p.info["cmdline"] or []) and "DSparkEngine" in " ".join(p.info["cmdline"] or [])]


def greedy_chat(base: str, model: str, prompt: str, max_tokens: int) -> list[int] | None:
    status, body = http_post(base + "/v1/chat/completions",
                             {"model": model, "messages": [{"role": "user", "content": prompt}],
                              "max_tokens": max_tokens, "temperature": 0, "return_token_ids": True})
    if status != 200:
        return None
    return body["choices"][0]["token_ids"]


@dataclass
class ServeFault:
    moment: str
    signal: str
    killed_after_s: float | None = None
    restart_ready_s: float | None = None  # launch of the restart -> GET /health 200
    output_equal: bool | None = None  # the restarted server's greedy output == the target's
    leftovers: list = field(default_factory=list)  # processes of the stopped run alive 30 s after the stop
    leftovers_at_end: list = field(default_factory=list)  # ... and still alive AGENT_GRACE_S after the restart check
    notes: str = ""

    def row(self) -> list:
        fmt = lambda x: "-" if x is None else f"{x:.1f}"
        equal = "-" if self.output_equal is None else ("yes" if self.output_equal else "NO")
        return ["serve" if self.moment != "replica" else "engine replica", self.signal, self.moment,
                fmt(self.killed_after_s), fmt(self.restart_ready_s), equal, self.describe_leftovers(), self.notes]

    def describe_leftovers(self) -> str:
        if not self.leftovers:
            return "none"
        names = sorted({x.split(" ", 1)[1].split()[0] for x in self.leftovers})
        gone = "all gone by the end of the restart check" if not self.leftovers_at_end else \
            f"{len(self.leftovers_at_end)} still alive {AGENT_GRACE_S:.0f} s after it"
        return f"{', '.join(names)} alive 30 s after the stop; {gone}"


def run_serve_fault(moment: str, sig_name: str, serve_args: list, port: int, workdir: Path, model: str,
                    prompt: str, expected: list[int], ready_timeout: float = 600.0) -> ServeFault:
    """Start ``jobs.serve``, stop it (or, for ``replica``, one engine replica) at ``moment`` with ``sig_name``,
    then check the restarted server (or the surviving deployment) serves the expected greedy output."""
    if moment not in MOMENTS:
        raise ValueError(f"moment must be one of {MOMENTS}, got {moment!r}")
    sig = SIGNALS[sig_name]
    result = ServeFault(moment, sig_name)
    first = ServeRun(serve_args, port, workdir / f"{moment}-{sig_name}-1.log").start()
    try:
        if moment == "ray-start":
            time.sleep(2.0)
        elif moment == "deploying":
            if not first.wait_for("deployed", ready_timeout):
                raise RuntimeError(f"jobs.serve never deployed:\n{first.output()[-3000:]}")
        else:
            if first.wait_ready(ready_timeout) is None:
                raise RuntimeError(f"jobs.serve never became ready:\n{first.output()[-3000:]}")
        if moment == "replica":
            return _replica_fault(first, sig, result, model, prompt, expected, ready_timeout)
        started = descendants(first.proc.pid)
        result.killed_after_s = time.monotonic() - first.t0
        first.stop(sig)
    finally:
        if moment != "replica":
            first.stop(signal.SIGKILL)
    result.leftovers = survivors(started)
    second = ServeRun(serve_args, port, workdir / f"{moment}-{sig_name}-2.log").start()
    try:
        result.restart_ready_s = second.wait_ready(ready_timeout)
        if result.restart_ready_s is None:
            result.notes = "restart never became ready: " + second.output()[-500:].replace("\n", " ")
            return result
        result.output_equal = greedy_chat(second.base, model, prompt, len(expected)) == expected
    finally:
        second.stop(signal.SIGTERM)
        # the agents of a SIGKILLed Ray cluster wait out their GCS reconnect timeout (60 s) before they exit
        result.leftovers_at_end = survivors({int(x.split()[0]): x.split(" ", 1)[1] for x in result.leftovers},
                                            settle_s=AGENT_GRACE_S)
    return result


def _replica_fault(run: ServeRun, sig: int, result: ServeFault, model: str, prompt: str, expected: list[int],
                   timeout: float) -> ServeFault:
    try:
        pids = engine_replica_pids()
        if not pids:
            raise RuntimeError("no engine replica process found")
        t0 = time.monotonic()
        result.killed_after_s = t0 - run.t0
        os.kill(pids[0], sig)
        # the deployment is whole again when every wanted replica is RUNNING
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            status, body = http_get(run.base + "/health", timeout=5)
            if status == 200 and body and body["ready_replicas"] == body["wanted_replicas"] and \
                    pids[0] not in engine_replica_pids():
                result.restart_ready_s = time.monotonic() - t0
                break
            time.sleep(0.5)
        if result.restart_ready_s is None:
            result.notes = "the stopped replica was not replaced"
        result.output_equal = greedy_chat(run.base, model, prompt, len(expected)) == expected
        result.notes = result.notes or "Serve replaced the replica; the others served meanwhile"
        return result
    finally:
        started = descendants(run.proc.pid)
        run.stop(signal.SIGTERM)
        result.leftovers = survivors(started)


def add_arguments(p) -> None:
    p.add_argument("--drafter", default=None, help="exported drafter (default: an untrained one, exported here)")
    p.add_argument("--moments", nargs="+", default=list(MOMENTS), choices=list(MOMENTS))
    p.add_argument("--signals", nargs="+", default=["SIGTERM", "SIGKILL"], choices=list(SIGNALS))
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--port", type=int, default=8793)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for a start")


def run(args, harness) -> dict:
    from transformers import AutoTokenizer

    from jobs.bench.load import random_drafter
    from pipeline.data.prompts import chat_prompt_ids, end_of_turn_ids
    from pipeline.data.target_model import prepare_smollm2
    from pipeline.engine.engine import SpecConfig, SpeculativeEngine
    from pipeline.engine.target_runner import TargetRunner, auto_precision
    from pipeline.ops.sampling import SamplingParams

    target = prepare_smollm2()
    drafter = args.drafter or random_drafter(str(target), harness.out_dir / "drafter")
    tok = AutoTokenizer.from_pretrained(str(target))
    prompt, max_tokens = "Name three colours.", 12
    runner = TargetRunner.from_pretrained(str(target), auto_precision())  # the replicas' --dtype auto
    eng = SpeculativeEngine(runner, None, SpecConfig(), tokenizer=tok,
                            eos_token_ids=set(runner.config.eos_token_ids) | set(end_of_turn_ids(tok)))
    expected = eng.generate([chat_prompt_ids(tok, prompt)], SamplingParams(temperature=0.0), max_tokens)[0].output_ids
    del eng, runner
    serve_args = ["--drafter", str(drafter), "--target", str(target), "--replicas", str(args.replicas),
                  "--profile-batch-sizes", "1", "2", "4", "--ready-wait-s", "10"]
    rows, results = [], []
    for moment in args.moments:
        for sig in args.signals:
            print(f"[serve_faults] {moment} {sig} ...", flush=True)
            r = run_serve_fault(moment, sig, serve_args, args.port, harness.out_dir / "logs", target.name, prompt,
                                expected, ready_timeout=args.timeout)
            print("[serve_faults] " + " | ".join(map(str, r.row())), flush=True)
            rows.append(r.row())
            results.append(r.__dict__)
    harness.table("jobs.serve stopped and started again", HEADER, rows)
    if any(not r["output_equal"] or r["leftovers_at_end"] for r in results):
        harness.exit_status = 1
    return {"scenarios": results}
