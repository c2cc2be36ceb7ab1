"""A process killed at any moment never blocks the next start: OS locks that die with their holder, bounded waits
with a named error, temporaries swept, and the small-M kernel loaded without a build lock."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline.ops import extensions, small_m_linear
from pipeline.core.file_lock import LockTimeout, atomic_write_text, file_lock, sweep_temporaries

ROOT = Path(__file__).resolve().parent.parent
HOLD = ("import sys, time; from pipeline.core.file_lock import file_lock\n"
        "with file_lock(sys.argv[1], timeout_s=5):\n"
        "    print('held', flush=True); time.sleep(600)\n")


def _holder(path: Path) -> subprocess.Popen:
    """A live process holding the lock at ``path`` (returns once it holds it)."""
    p = subprocess.Popen([sys.executable, "-c", HOLD, str(path)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "held"
    return p


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_lock_of_a_killed_holder_is_free_at_once(tmp_path, sig):
    lock = tmp_path / "x.lock"
    p = _holder(lock)
    with pytest.raises(LockTimeout, match=rf"guarded thing: {lock} is held by another live process \(pid {p.pid}\)"):
        with file_lock(lock, timeout_s=0.3, what="guarded thing"):
            pass
    p.send_signal(sig)
    p.wait()
    assert lock.exists()  # the file stays behind; it means nothing
    t0 = time.monotonic()
    with file_lock(lock, timeout_s=5):
        assert time.monotonic() - t0 < 1.0
    with file_lock(lock, timeout_s=0):  # released on exit of the block
        pass


def test_atomic_write_and_sweep(tmp_path):
    target = tmp_path / "table.json"
    atomic_write_text(target, "{}")
    assert target.read_text() == "{}" and [p.name for p in tmp_path.iterdir()] == ["table.json"]
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)
    left = tmp_path / f"table.json.tmp-{dead_pid}-abcd"  # what a killed writer leaves
    left.write_text("half")
    folder = tmp_path / f"table.json.tmp-{dead_pid}-ef01"
    folder.mkdir()
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        in_flight = tmp_path / f"table.json.tmp-{other.pid}-0000"
        in_flight.write_text("someone else's")
        removed = sweep_temporaries(tmp_path, "table.json")
        assert sorted(removed) == sorted([left, folder]) and in_flight.exists()  # a live writer's stays
    finally:
        other.kill()
        other.wait()


# ------------------------------------------------------------------------------------------- the small-M kernel
pytestmark_kernel = pytest.mark.skipif(not small_m_linear.available(),
                                       reason=f"no small-M kernel here: {small_m_linear.unavailable_reason()}")
PROBE = ("import time; t = time.monotonic(); from pipeline.ops import small_m_linear as k; ok = k.ensure(); "
         "print(ok, round(time.monotonic() - t, 2), k.unavailable_reason(), flush=True)")


def _probe(ext_dir: Path, timeout: float, **env) -> tuple[bool, float, str]:
    e = dict(os.environ, DSPARK_EXTENSIONS_DIR=str(ext_dir), **env)
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, env=e, capture_output=True, text=True,
                         timeout=timeout)
    assert out.returncode == 0, out.stderr[-2000:]
    ok, secs, reason = out.stdout.strip().split(" ", 2)
    return ok == "True", float(secs), reason


def _finished_copy(tmp_path: Path) -> tuple[Path, Path]:
    """A copy of this machine's finished kernel build in a folder of the test's own."""
    name, folder = small_m_linear.EXT.build_paths()
    assert small_m_linear.EXT.finished(folder, name) is not None
    ext = tmp_path / "ext"
    shutil.copytree(folder, ext / folder.name)
    return ext, ext / folder.name


@pytestmark_kernel
def test_stale_lock_files_do_not_block_loading(tmp_path):
    """torch's build lock file and the project's lock file left by a killed start: the next load takes ~a second."""
    ext, folder = _finished_copy(tmp_path)
    (folder / "lock").write_text("")  # torch's FileBaton file, as a build killed in `load` leaves it
    (folder.with_name(folder.name + ".lock")).write_text("12345\n")
    ok, secs, reason = _probe(ext, timeout=60)
    assert ok and reason == "None" and secs < 20


@pytestmark_kernel
def test_live_build_lock_gives_a_named_error_within_the_bound(tmp_path):
    """A build that another live process holds longer than DSPARK_KERNEL_LOCK_TIMEOUT_S: the kernel is reported
    unavailable with the reason (the other back ends stay usable), never an open-ended wait."""
    ext, folder = _finished_copy(tmp_path)
    (folder / extensions.BUILT).unlink()  # not finished: this process would have to build it
    p = _holder(folder.with_name(folder.name + ".lock"))
    try:
        ok, secs, reason = _probe(ext, timeout=60, DSPARK_KERNEL_LOCK_TIMEOUT_S="1")
    finally:
        p.kill()
        p.wait()
    assert not ok and secs < 10
    assert "build of the small-M linear kernel" in reason and "held by another live process" in reason and str(p.pid) in reason


@pytestmark_kernel
def test_half_written_build_under_a_killed_holder_is_rebuilt(tmp_path):
    """The issue's case: a start killed while building leaves torch's ``lock`` and a build folder without
    ``built.json`` (and its holder of the project lock dies).  The next start rebuilds and loads the kernel."""
    ext, folder = _finished_copy(tmp_path)
    (folder / extensions.BUILT).unlink()
    (folder / "lock").write_text("")
    for so in folder.glob("*.so"):
        so.write_bytes(so.read_bytes()[:1000])  # a library cut short
    p = _holder(folder.with_name(folder.name + ".lock"))
    p.kill()
    p.wait()
    ok, secs, reason = _probe(ext, timeout=600)
    assert ok, reason
    name = small_m_linear.EXT.build_paths()[0]
    assert small_m_linear.EXT.finished(folder, name) is not None and not (folder / "lock").exists()
    assert not list(ext.glob("*.tmp-*"))  # the build's temporary folder was renamed into place
