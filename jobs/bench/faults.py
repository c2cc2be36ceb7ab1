"""Start-up and shutdown faults of the batch stages: kill ``jobs.generate``, ``jobs.extract`` or ``jobs.train`` with
SIGTERM or SIGKILL at start-up or in the middle of its work, run the same command again, and check what came back.

Each scenario runs the real command (``python -m jobs.<stage> ...``, its own local Ray cluster, the real SmolLM2
target) as a subprocess in a session of its own, and signals its whole process group (``--kill driver``: the driver
process alone, as ``kill PID`` or an out-of-memory kill would) at one moment:

* ``startup``: ``--startup-delay`` seconds after launch (imports, Ray and the engine starting; no shard or
  checkpoint written yet);
* ``cluster``: as soon as the run's Ray cluster is up (a raylet among its processes), before any output;
* ``midwork``: as soon as the first durable piece of output appears (a response or hidden-state shard, a training
  checkpoint).

It then waits for the processes of the killed run to go (every process of its tree and session, watched while it
ran; with ``--ray-address`` also the cluster workers it started) and reports the ones still alive after
``--orphan-grace`` seconds, reruns the command to the end and times it, lists what the two runs left (in the output
folder: shard, export and checkpoint temporaries, checkpoints beyond the two Ray Train keeps; in the temp folder:
vLLM's ``vllm_dist_*`` rendezvous files, checkpoints staged for Ray Train), and compares the outputs with an
uninterrupted run of the same command: the same response rows, the same hidden states, for training the same
losses at every step and the same exported weights (the trainer's resume is exact).

The commands share their inputs: extract reads the uninterrupted generate run's responses and train the
uninterrupted extract run's hidden states (8 prompts x 16 tokens; a 24-step training run with a checkpoint every 4
steps).  ``jobs.train`` runs with ``--resume`` every time: the same command starts a run or continues it.

    python -m jobs.bench faults                                        # 3 stages x 2 signals x 2 moments
    python -m jobs.bench faults --stages train --signals SIGKILL --moments startup,midwork
    python -m jobs.bench faults --kill driver                          # signal the driver process only

tests/test_faults_stages.py runs a few scenarios through the same functions (``run_scenario``)."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.core.runtime import PROJECT_ROOT, apply_env

NAME = "faults"
HELP = "kill generate / extract / train (SIGTERM, SIGKILL) at start-up and mid-work, rerun: time to done, outputs vs uninterrupted, leftovers"

STAGES = ("generate", "extract", "train")
SIGNALS = ("SIGTERM", "SIGKILL")
MOMENTS = ("startup", "cluster", "midwork")
DEFAULT_MOMENTS = ("startup", "midwork")
# what a killed writer may leave in an output folder: shard / manifest temporaries (pipeline.data.shards), temporaries
# named by pipeline.core.file_lock (the drafter export's), half-copied local checkpoints.  (Lock files are not among
# them: the project's locks are OS locks that die with their holder, the file left on disk blocks nothing.)
TEMPORARY_PATTERNS = (".*.tmp", "*.tmp-*", "*.partial")
POLL_S = 0.25


def add_arguments(ap) -> None:
    ap.add_argument("--stages", default=",".join(STAGES), help=f"comma-separated subset of {','.join(STAGES)}")
    ap.add_argument("--signals", default=",".join(SIGNALS), help=f"comma-separated subset of {','.join(SIGNALS)}")
    ap.add_argument("--moments", default=",".join(DEFAULT_MOMENTS),
                    help=f"comma-separated subset of {','.join(MOMENTS)} (default {','.join(DEFAULT_MOMENTS)})")
    ap.add_argument("--kill", choices=["group", "driver"], default="group",
                    help="signal the command's whole process group (default) or its driver process only")
    ap.add_argument("--startup-delay", type=float, default=3.0, help="seconds after launch of a startup kill")
    ap.add_argument("--orphan-grace", type=float, default=10.0,
                    help="seconds the killed run's processes get to exit before they count as leftovers")
    ap.add_argument("--target", default=None, help="HF folder (default: the prepared SmolLM2-135M-Instruct)")
    ap.add_argument("--prompts", type=int, default=8, help="prompts of the generate command (default 8)")
    ap.add_argument("--ray-address", default=None,
                    help="run every command on this existing cluster (default: each starts its own local one)")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds any one command may run")


# ---- the commands --------------------------------------------------------------------------------------------------
@dataclass
class Command:
    """One stage's command line, where it writes, and what counts as durable progress in that folder."""

    stage: str
    args: list[str]
    out: Path
    env: dict = field(default_factory=dict)  # on top of this process's environment (e.g. RAY_ADDRESS)

    def argv(self) -> list[str]:
        return [sys.executable, "-m", f"jobs.{self.stage}", *self.args]

    def with_out(self, out: Path) -> "Command":
        """The same command writing to ``out`` (its --out flag replaced)."""
        args = list(self.args)
        args[args.index("--out") + 1] = str(out)
        return Command(self.stage, args, Path(out), dict(self.env))

    def progress(self) -> str | None:
        """The durable output the folder holds ("4 rows in 2 shard(s)", "checkpoint at step 2"), or None: what a
        rerun keeps."""
        if self.stage == "train":
            steps = [s for f in sorted(self.out.glob("**/train_state.pt")) if (s := _checkpoint_step(f)) is not None]
            return f"checkpoint at step {max(steps)}" if steps else None
        import pyarrow.parquet as pq

        shards = sorted(self.out.glob("part-*.parquet"))
        rows = sum(pq.ParquetFile(p).metadata.num_rows for p in shards)
        return f"{rows} rows in {len(shards)} shard(s)" if shards else None


_LOADED: dict[tuple, int | None] = {}  # (path, size, mtime) -> the checkpoint's step, None where it does not load


def _checkpoint_step(path: Path) -> int | None:
    """The step of a training checkpoint that loads (one being written does not), read once per file version."""
    import torch

    try:
        st = path.stat()
    except OSError:
        return None
    key = (str(path), st.st_size, st.st_mtime_ns)
    if key not in _LOADED:
        try:
            _LOADED[key] = int(torch.load(path, map_location="cpu", weights_only=False)["step"])
        except Exception:  # partly written
            _LOADED[key] = None
    return _LOADED[key]


def stage_commands(root: Path, target: Path, n_prompts: int = 8, env: dict | None = None) -> dict[str, Command]:
    """The bench's three commands on small real inputs: ``n_prompts`` prompts x 16 new tokens; extract on the
    reference generate run's responses (root/reference/generate), train on the reference extract run's hidden
    states (root/reference/extract)."""
    root = Path(root)
    prompts = root / "prompts.jsonl"
    prompts.parent.mkdir(parents=True, exist_ok=True)
    prompts.write_text("".join(json.dumps({"prompt": f"Count from {i} to {i + 5}."}) + "\n"
                               for i in range(n_prompts)))
    ref = root / "reference"
    engine = ["--target", str(target), "--max-model-len", "256", "--batch-size", "2"]
    return {
        "generate": Command("generate", ["--prompts", str(prompts), "--out", str(ref / "generate"), *engine,
                                         "--max-new-tokens", "16", "--rows-per-shard", "2"],
                            ref / "generate", dict(env or {})),
        "extract": Command("extract", ["--responses", str(ref / "generate"), "--out", str(ref / "extract"),
                                       *engine], ref / "extract", dict(env or {})),
        "train": Command("train", train_args(ref / "extract", ref / "train", target, steps=24, checkpoint_every=4),
                         ref / "train", dict(env or {})),
    }


def train_args(data: Path, out: Path, target: Path, steps: int = 8, checkpoint_every: int = 2) -> list[str]:
    """A short jobs.train run on one CPU worker, checkpointed (and logged) every ``checkpoint_every`` steps, with
    --resume: the same command starts the run or continues it.  (Ray Train holds one report at a time and takes it
    at its 2 s health check, so a report at every step of a small run would cost 2 s a step.)"""
    return ["--data", str(data), "--out", str(out), "--target", str(target), "--max-steps", str(steps),
            "--seqs-per-step", "2", "--num-anchors", "8", "--checkpoint-every", str(checkpoint_every),
            "--log-every", str(checkpoint_every), "--holdout-frac", "0.25", "--cpus-per-worker", "1",
            "--eval-every", "0", "--markov-rank", "16", "--resume"]


# ---- processes -----------------------------------------------------------------------------------------------------
def _environment(cmd: Command) -> dict:
    env = dict(os.environ)
    if "RAY_ADDRESS" not in cmd.env:
        env.pop("RAY_ADDRESS", None)  # a command of its own starts its own local cluster
    env.update(cmd.env)
    return env


def run_to_done(cmd: Command, log: Path, timeout: float = 600.0) -> float:
    """Run the command to its end; seconds it took.  RuntimeError (with the log's tail) when it fails."""
    log.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd.argv(), cwd=PROJECT_ROOT, env=_environment(cmd), stdout=f,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise RuntimeError(f"jobs.{cmd.stage} ran past {timeout:g} s; log {log}:\n{_tail(log)}") from None
    if rc != 0:
        raise RuntimeError(f"jobs.{cmd.stage} exited with {rc}; log {log}:\n{_tail(log)}")
    return time.monotonic() - t0


def _tail(path: Path, n: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


def _cluster_raylets(address: str | None) -> list:
    """The raylet processes of the existing cluster at ``address`` (host:port of its GCS)."""
    import psutil

    if not address:
        return []
    found = []
    for p in psutil.process_iter(["name", "cmdline"]):
        cmdline = p.info["cmdline"] or []
        if p.info["name"] == "raylet" and f"--gcs-address={address}" in cmdline:
            found.append(p)
    return found


# workers an existing cluster keeps whatever its jobs do: idle workers it reuses, and Ray Data's cluster-wide
# helper actors (detached, started by the first Ray Data job)
CLUSTER_SCOPED = ("ray::IDLE", "ray::_StatsActor", "ray::_AutoscalingCoordinatorActor", "ray::ActorLocationTracker")


class Watched:
    """A command running in its own session, and every process it started: its process tree and session, and -- on
    an existing cluster -- the Ray workers that cluster's raylets started for it while it ran (its actors, which the
    cluster, not the driver's process tree, must end)."""

    def __init__(self, cmd: Command, log: Path):
        import psutil

        log.parent.mkdir(parents=True, exist_ok=True)
        self.cmd, self.log = cmd, log
        self._log_file = open(log, "w")
        self.raylets = _cluster_raylets(cmd.env.get("RAY_ADDRESS"))
        self.before = {c.pid for r in self.raylets for c in r.children(recursive=True)}
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen(cmd.argv(), cwd=PROJECT_ROOT, env=_environment(cmd), stdout=self._log_file,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        self.root = psutil.Process(self.proc.pid)
        self.own: dict[int, "psutil.Process"] = {}  # the run's process tree and session
        self.cluster: dict[int, "psutil.Process"] = {}  # workers the existing cluster started during the run
        self.names: dict[int, str] = {}  # the last name seen of each (a process may be gone by the time it is named)

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def track(self) -> None:
        """Remember every process of the run now alive (called while it runs, and right before the kill)."""
        import psutil

        for parent, into in [(self.root, self.own)] + [(r, self.cluster) for r in self.raylets]:
            try:
                for c in parent.children(recursive=True):
                    if c.pid not in self.before:
                        into.setdefault(c.pid, c)
            except psutil.NoSuchProcess:
                pass
        for p in list(self.own.values()) + list(self.cluster.values()):
            if (name := _name(p)) != "?":
                self.names[p.pid] = name

    def cluster_up(self) -> bool:
        return any(_name(p) == "raylet" for p in self.own.values())

    def wait_for(self, moment: str, delay: float, timeout: float) -> str | None:
        """Poll until ``moment`` (module docstring); None when it came, else why not (the run ended first, or
        ran past ``timeout``)."""
        while True:
            self.track()
            if moment == "startup" and self.elapsed() >= delay:
                return None
            if moment == "cluster" and self.cluster_up():
                return None
            if moment == "midwork" and self.cmd.progress():
                return None
            if self.proc.poll() is not None:
                return f"exited with {self.proc.returncode} before the {moment} moment"
            if self.elapsed() > timeout:
                return f"no {moment} moment within {timeout:g} s"
            time.sleep(POLL_S)

    def kill(self, sig: int, scope: str = "group") -> None:
        self.track()
        try:
            if scope == "group":
                os.killpg(self.proc.pid, sig)
            else:
                os.kill(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def wait_gone(self, grace: float, exit_timeout: float = 60.0) -> tuple[float, list[str]]:
        """After the kill: seconds until the driver exited (SIGKILLed after ``exit_timeout``), and the processes of
        the run still alive ``grace`` seconds later ("name pid").  Those of its own tree and session are then
        SIGKILLed, so that the next scenario starts clean; an existing cluster's are left to the cluster."""
        import psutil

        t_kill = time.monotonic()
        try:
            self.proc.wait(timeout=exit_timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        exited = time.monotonic() - t_kill
        self._log_file.close()
        for p in psutil.process_iter():
            if _sid(p.pid) == self.proc.pid:  # the session outlives its leader
                self.own.setdefault(p.pid, p)
        watched = list(self.own.values()) + list(self.cluster.values())
        deadline = time.monotonic() + grace
        while True:
            self.track()
            watched = [p for p in watched if _alive(p) and not (p.pid in self.cluster and
                                                                 self.names.get(p.pid) in CLUSTER_SCOPED)]
            if not watched or time.monotonic() >= deadline:
                break
            time.sleep(POLL_S)
        left = [f"{self.names.get(p.pid, '?')} {p.pid}" for p in watched if _alive(p)]
        for p in watched:
            if p.pid in self.own:
                try:
                    p.kill()
                except psutil.Error:
                    pass
        return exited, left


def _name(p) -> str:
    """A process's name; a Ray worker's by its title (ray::MapWorker(...), ray::IDLE)."""
    import psutil

    try:
        cmdline = p.cmdline()
        if cmdline and cmdline[0].startswith("ray::"):
            return cmdline[0].split(".")[0].split(" ")[0]
        return p.name()
    except psutil.Error:
        return "?"


def _alive(p) -> bool:
    import psutil

    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _sid(pid: int) -> int | None:
    try:
        return os.getsid(pid)
    except OSError:
        return None


def temporaries(folder: Path) -> list[str]:
    """Temporary files and folders under ``folder`` (TEMPORARY_PATTERNS), relative names."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    found = {p for pattern in TEMPORARY_PATTERNS for p in folder.rglob(pattern)}
    return sorted(str(p.relative_to(folder)) for p in found)


def surplus_checkpoints(out: Path, kept: int = 2) -> list[str]:
    """Checkpoint folders in a finished training run's Ray Train folder beyond the ``kept`` it holds
    (jobs.train.CHECKPOINTS_KEPT): what an interrupted run left there."""
    found = sorted(p for p in Path(out).glob("ray/*/checkpoint_*") if p.is_dir())
    return [str(p.relative_to(out)) for p in found[:-kept]] if len(found) > kept else []


def temp_folder_entries() -> set[str]:
    """What a killed run can leave in the temp folder the commands share (the project's work/tmp): vLLM's rendezvous
    files (``vllm_dist_*``, at the top or in an engine's own folder, actors.vllm_engine.engine_temp_folder) and
    checkpoints staged for the launcher (a folder holding train_state.pt, pipeline.train.trainer.checkpoint_staging)."""
    apply_env()
    base = Path(os.environ["TMPDIR"])
    return {str(p.relative_to(base)) for pattern in ("vllm_dist_*", "*/vllm_dist_*", "*/train_state.pt")
            for p in base.glob(pattern)}


# ---- comparing outputs ---------------------------------------------------------------------------------------------
@dataclass
class Comparison:
    equal: bool
    detail: str  # how they compare ("bitwise", "max |diff| ...") or what differs
    lost: list = field(default_factory=list)  # ids / steps of the reference missing from the result
    duplicated: list = field(default_factory=list)  # ids written more than once


def compare_outputs(stage: str, reference: Path, result: Path) -> Comparison:
    return {"generate": compare_responses, "extract": compare_hidden_states, "train": compare_training}[stage](
        Path(reference), Path(result))


def _rows_by_id(folder: Path, key: str) -> tuple[dict, list]:
    """{id: row} of a shard set, and the ids found more than once."""
    import pyarrow.parquet as pq

    rows, dup = {}, []
    for p in sorted(folder.glob("part-*.parquet")):
        for r in pq.read_table(p).to_pylist():
            if r[key] in rows:
                dup.append(r[key])
            rows[r[key]] = r
    return rows, sorted(dup)


def compare_responses(reference: Path, result: Path) -> Comparison:
    """The same response rows (every column), each once, a complete manifest, the same skipped prompts."""
    import pyarrow.parquet as pq

    ref, _ = _rows_by_id(reference, "request_id")
    got, dup = _rows_by_id(result, "request_id")
    lost = sorted(set(ref) - set(got))
    extra = sorted(set(got) - set(ref))
    differ = sorted(i for i in set(ref) & set(got) if ref[i] != got[i])
    problems = []
    if not (result / "manifest.json").is_file() or not json.loads((result / "manifest.json").read_text())["complete"]:
        problems.append("no complete manifest")
    if pq.read_table(reference / "skipped.parquet") != pq.read_table(result / "skipped.parquet"):
        problems.append("skipped.parquet differs")
    problems += [f"{len(x)} {what}" for x, what in ((lost, "rows missing"), (extra, "rows extra"),
                                                    (differ, "rows differ"), (dup, "rows duplicated")) if x]
    return Comparison(not problems, "; ".join(problems) or f"{len(got)} rows, every column equal", lost, dup)


def compare_hidden_states(reference: Path, result: Path) -> Comparison:
    """The same samples, each once: token ids and loss masks equal, the hidden states and lse bitwise or within the
    largest difference reported."""
    import torch

    from pipeline.stores.disk import DiskHiddenStore

    _, dup = _rows_by_id(result, "sample_id")
    ref, got = DiskHiddenStore(reference), DiskHiddenStore(result)
    ref_ids, got_ids = set(ref.manifest()["sample_ids"]), set(got.manifest()["sample_ids"])
    lost = sorted(ref_ids - got_ids)
    problems = [f"{len(x)} {what}" for x, what in ((lost, "samples missing"), (sorted(got_ids - ref_ids),
                                                                               "samples extra"),
                                                   (dup, "samples duplicated")) if x]
    worst = 0.0
    for sid in sorted(ref_ids & got_ids):
        a, b = ref.get(sid), got.get(sid)
        if sorted(a) != sorted(b):
            problems.append(f"{sid}: fields {sorted(a)} vs {sorted(b)}")
            continue
        for name in a:
            if a[name].shape != b[name].shape or (name in ("input_ids", "loss_mask") and not torch.equal(a[name],
                                                                                                        b[name])):
                problems.append(f"{sid}: {name} differs")
            elif not torch.equal(a[name], b[name]):
                worst = max(worst, float((a[name].float() - b[name].float()).abs().max()))
    detail = "; ".join(problems) or (f"{len(got_ids)} samples, bitwise equal" if worst == 0 else
                                     f"{len(got_ids)} samples, tokens equal, hidden states max |diff| {worst:.3g}")
    return Comparison(not problems and worst == 0, detail, lost, dup)


def _steps(out: Path) -> dict[int, dict]:
    """{step: metrics row} of a run (a resumed run's rows for a step replace the earlier ones)."""
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return {r["step"]: r for r in rows}


def compare_training(reference: Path, result: Path) -> Comparison:
    """The same steps with the same losses (every loss part, relative 1e-6) and the same exported drafter (config
    equal, weights bitwise or within the largest difference reported)."""
    from safetensors.torch import load_file

    ref, got = _steps(reference), _steps(result)
    lost = sorted(set(ref) - set(got))
    problems = [f"steps missing {lost}"] if lost else []
    rel = 0.0
    for step in sorted(set(ref) & set(got)):
        for k, v in ref[step].items():
            if k.startswith("loss") or k in ("supervised_positions", "grad_norm", "positions_seen"):
                w = got[step].get(k)
                if w is None:
                    problems.append(f"step {step}: no {k}")
                else:
                    rel = max(rel, abs(w - v) / max(abs(v), 1e-12))
    if rel > 1e-6:
        problems.append(f"losses differ (max relative {rel:.2g})")
    drafter = result / "drafter"
    if not (drafter / "config.json").is_file():
        problems.append("no exported drafter")
        return Comparison(False, "; ".join(problems), lost)
    if json.loads((drafter / "config.json").read_text()) != json.loads(
            (reference / "drafter" / "config.json").read_text()):
        problems.append("drafter config differs")
    a, b = load_file(str(reference / "drafter" / "model.safetensors")), load_file(str(drafter / "model.safetensors"))
    worst = 0.0
    if sorted(a) != sorted(b):
        problems.append("drafter tensors differ in names")
    else:
        worst = max((float((a[k].float() - b[k].float()).abs().max()) for k in a), default=0.0)
    detail = "; ".join(problems) or (f"{len(got)} steps, losses equal, weights bitwise equal" if worst == 0 else
                                     f"{len(got)} steps, losses equal (max rel {rel:.2g}), weights max |diff| "
                                     f"{worst:.3g}")
    return Comparison(not problems and worst == 0, detail, lost)


# ---- one scenario --------------------------------------------------------------------------------------------------
@dataclass
class Outcome:
    """What one scenario measured (one row of the fault matrix)."""

    stage: str
    signal: str
    moment: str
    killed_after_s: float | None = None
    exited_after_s: float | None = None  # driver gone, after the signal
    kept: str | None = None  # durable output the killed run left ("2 shard(s)"), None for none
    temporaries_after_kill: list = field(default_factory=list)
    leftovers: list = field(default_factory=list)  # processes of the killed run alive after the grace
    rerun_s: float | None = None
    temporaries_after_rerun: list = field(default_factory=list)  # still there after the rerun: not swept
    temp_folder_left: list = field(default_factory=list)  # temp_folder_entries the two runs left behind
    equal: bool = False
    detail: str = ""
    lost: list = field(default_factory=list)
    duplicated: list = field(default_factory=list)
    error: str | None = None


def run_scenario(cmd: Command, reference: Path, sig: str, moment: str, logs: Path, *, scope: str = "group",
                 startup_delay: float = 3.0, grace: float = 10.0, timeout: float = 600.0) -> Outcome:
    """Start ``cmd`` in a fresh output folder, signal it (``scope``: its process group or its driver) at ``moment``,
    collect what it left, rerun the same command to the end and compare the outputs with ``reference`` (an
    uninterrupted run's output folder)."""
    out = Outcome(cmd.stage, sig, moment)
    shutil.rmtree(cmd.out, ignore_errors=True)
    temp_before = temp_folder_entries()
    run = Watched(cmd, logs / f"{cmd.stage}-{sig}-{moment}.killed.log")
    missed = run.wait_for(moment, startup_delay, timeout)
    if missed:
        run.kill(signal.SIGKILL)
        run.wait_gone(0)
        out.error = missed + f" (log {run.log})"
        return out
    out.killed_after_s = run.elapsed()
    run.kill(getattr(signal, sig), scope)
    out.exited_after_s, out.leftovers = run.wait_gone(grace)
    out.kept = cmd.progress()
    out.temporaries_after_kill = temporaries(cmd.out)
    try:
        out.rerun_s = run_to_done(cmd, logs / f"{cmd.stage}-{sig}-{moment}.rerun.log", timeout)
    except RuntimeError as e:
        out.error = f"rerun failed: {e}"
        return out
    out.temporaries_after_rerun = temporaries(cmd.out) + (surplus_checkpoints(cmd.out) if cmd.stage == "train" else [])
    out.temp_folder_left = sorted(temp_folder_entries() - temp_before)
    cmp = compare_outputs(cmd.stage, reference, cmd.out)
    out.equal, out.detail, out.lost, out.duplicated = cmp.equal, cmp.detail, cmp.lost, cmp.duplicated
    return out


def matrix_row(o: Outcome) -> list:
    """One row of the printed table."""
    if o.error:
        equal = f"ERROR: {o.error.splitlines()[0][:120]}"
    else:
        equal = ("yes" if o.equal else "NO") + f" ({o.detail})"
    lost = [f"{len(o.lost)} lost" if o.lost else "", f"{len(o.duplicated)} duplicated" if o.duplicated else ""]
    left = list(o.leftovers) + [f"not swept: {t}" for t in o.temporaries_after_rerun]
    left += [f"in the temp folder: {t}" for t in o.temp_folder_left]
    return [o.stage, o.signal, o.moment, _num(o.killed_after_s), _num(o.exited_after_s), o.kept or "none",
            _num(o.rerun_s), equal, ", ".join(x for x in lost if x) or ("?" if o.error else "nothing"),
            "; ".join(left) or "none"]


MATRIX_HEADER = ["stage", "signal", "when", "killed after s", "driver gone after s", "kept", "rerun to done s",
                 "outputs equal to uninterrupted", "anything lost", "leftovers"]


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


# ---- the benchmark -------------------------------------------------------------------------------------------------
def _subset(spec: str, allowed: tuple, flag: str) -> list[str]:
    got = [s.strip() for s in spec.split(",") if s.strip()]
    bad = [s for s in got if s not in allowed]
    if bad or not got:
        raise SystemExit(f"{flag}: {bad or spec!r} not in {', '.join(allowed)}")
    return got


def run(args, harness) -> dict:
    from pipeline.data.target_model import prepare_smollm2, resolve_target

    stages = _subset(args.stages, STAGES, "--stages")
    signals = _subset(args.signals, SIGNALS, "--signals")
    moments = _subset(args.moments, MOMENTS, "--moments")
    target = resolve_target(args.target) if args.target else prepare_smollm2()
    if "train" in stages:
        import torch  # noqa: F401  (now, not on the first look at a checkpoint: that look decides when to kill)
    root = harness.out_dir / "work"
    logs = root / "logs"
    env = {"RAY_ADDRESS": args.ray_address} if args.ray_address else {}
    commands = stage_commands(root, target, args.prompts, env)

    # uninterrupted runs, in stage order (each is the next one's input); every stage before the last one asked
    # for, as the later stages read them
    needed = STAGES[: max(STAGES.index(s) for s in stages) + 1]
    reference_s = {}
    for stage in needed:
        cmd = commands[stage]
        shutil.rmtree(cmd.out, ignore_errors=True)
        print(f"[faults] uninterrupted {stage} ...", flush=True)
        reference_s[stage] = run_to_done(cmd, logs / f"{stage}.reference.log", args.timeout)
        print(f"[faults] uninterrupted {stage}: {reference_s[stage]:.1f} s", flush=True)
    harness.table("uninterrupted runs (each starts its own Ray cluster)" if not args.ray_address else
                  f"uninterrupted runs (on the cluster at {args.ray_address})",
                  ["stage", "seconds"], [[s, f"{reference_s[s]:.1f}"] for s in needed])

    outcomes = []
    for stage in stages:
        cmd = commands[stage].with_out(root / "killed" / stage)
        for sig in signals:
            for moment in moments:
                print(f"[faults] {stage}: {sig} at {moment} ...", flush=True)
                o = run_scenario(cmd, commands[stage].out, sig, moment, logs, scope=args.kill,
                                 startup_delay=args.startup_delay, grace=args.orphan_grace, timeout=args.timeout)
                print("[faults] " + " | ".join(str(c) for c in matrix_row(o)), flush=True)
                outcomes.append(o)
    rows = [matrix_row(o) for o in outcomes]
    harness.table(f"fault matrix (kill: {args.kill}{', cluster ' + args.ray_address if args.ray_address else ''}; "
                  f"leftovers: processes alive {args.orphan_grace:g} s after the kill, files not swept by the "
                  "rerun)", MATRIX_HEADER, rows)
    failed = [o for o in outcomes if o.error or not o.equal or o.lost or o.duplicated or o.leftovers
              or o.temporaries_after_rerun or o.temp_folder_left]
    if failed:
        harness.exit_status = 1
    return {"reference_s": reference_s, "kill": args.kill, "ray_address": args.ray_address,
            "outcomes": [o.__dict__ for o in outcomes], "failed": len(failed)}
