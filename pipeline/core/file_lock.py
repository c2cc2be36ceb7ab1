"""Locks and atomic writes that a killed process never leaves behind.

Every lock the project takes on disk is an OS lock (``fcntl.flock``) on an open file: the kernel drops it when
its holder exits, however it exits (Ctrl-C, SIGTERM, SIGKILL, an out-of-memory kill), so a lock FILE left on disk
means nothing and never blocks the next start.  Waiting is bounded: a lock that another LIVE process holds longer
than ``timeout_s`` raises :class:`LockTimeout`, which names the lock, what it guards and the holder's pid.

    with file_lock(cache / "sps-abc.lock", timeout_s=600, what="the SPS profile"):
        ...                                   # one holder at a time on this machine

Writes that must appear whole or not at all go to a temporary name in the same folder and are renamed into place
(``atomic_write_text``); a temporary left by a killed writer is swept by the next holder of the folder's lock
(``sweep_temporaries``).
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import shutil
import time
import uuid
from pathlib import Path

DEFAULT_TIMEOUT_S = 600.0
TMP_MARK = ".tmp-"  # the infix of every temporary name written here: <name>.tmp-<pid>-<random>


class LockTimeout(TimeoutError):
    """A lock another live process holds could not be had within the bound."""


def _holder(fd: int) -> str:
    try:
        text = os.pread(fd, 64, 0).decode(errors="replace").strip()
    except OSError:
        return "unknown"
    return text or "unknown"


@contextlib.contextmanager
def file_lock(path: str | Path, timeout_s: float | None = DEFAULT_TIMEOUT_S, what: str = "",
              poll_s: float = 0.05):
    """Hold an exclusive ``flock`` on ``path`` (created if missing) for the ``with`` block.

    ``timeout_s`` None waits without bound; otherwise :class:`LockTimeout` after that many seconds.  The holder
    writes its pid into the file (diagnostics only: the lock is the kernel's, not the file's contents)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        deadline = None if timeout_s is None else time.monotonic() + float(timeout_s)
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as e:
                if e.errno not in (errno.EAGAIN, errno.EACCES):
                    raise
            if deadline is not None and time.monotonic() >= deadline:
                raise LockTimeout(f"{what or 'lock'}: {path} is held by another live process (pid "
                                  f"{_holder(fd)}) for more than {timeout_s:g} s")
            time.sleep(poll_s)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        try:
            yield path
        finally:
            os.ftruncate(fd, 0)
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def temporary_name(path: str | Path) -> Path:
    """A unique sibling of ``path`` for a write that is renamed into place: ``<name>.tmp-<pid>-<random>``."""
    path = Path(path)
    return path.with_name(f"{path.name}{TMP_MARK}{os.getpid()}-{uuid.uuid4().hex[:8]}")


def atomic_write_text(path: str | Path, text: str) -> Path:
    """Write ``text`` to ``path`` whole or not at all (temporary sibling, fsync, rename)."""
    path = Path(path)
    tmp = temporary_name(path)
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_temporaries(folder: str | Path, name: str) -> list[Path]:
    """Remove ``<name>.tmp-<pid>-*`` files and folders in ``folder`` whose writer (pid) is no longer alive: what a
    killed writer left behind.  Call it while holding the lock that guards ``name``.  Returns what was removed."""
    removed = []
    for p in Path(folder).glob(f"{name}{TMP_MARK}*"):
        pid = p.name[len(name) + len(TMP_MARK):].split("-", 1)[0]
        if pid.isdigit() and _pid_alive(int(pid)) and int(pid) != os.getpid():
            continue
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
        removed.append(p)
    return removed
