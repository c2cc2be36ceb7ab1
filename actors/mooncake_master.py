"""Lifecycle of a Mooncake store on loopback: the ``mooncake_master`` process plus the memory it serves.

A Mooncake store keeps objects in *segments* that clients mount; when a client exits, its segment and every object
in it disappear.  A writer process that puts hidden states and exits would therefore take its data with it.  So
:class:`MooncakeMaster` starts, next to the master, a long-lived *segment server* (the ``mooncake_client`` binary
shipped in the same wheel) that mounts ``segment_bytes`` of memory; writers and readers then open stores that
contribute no memory of their own and work THROUGH that server (:class:`pipeline.stores.mooncake.MooncakeHiddenStore`
with the endpoint's ``segment_server``): their transfer buffers are shared memory the server maps, so a put or a
get is one memcpy inside the server, and their data outlives them.  One segment server per node is the deployment
shape (:meth:`MooncakeMaster.add_segment_server` starts more, e.g. one per simulated node): a writer's objects
stay in its node's segment (``segment_name``), and only a reader on another node pulls them over the transfer
engine (TCP).

The segment's memory is pre-faulted when the server starts (``prefault=True``): the server allocates it lazily, and
a put into never-touched memory pays a first-touch fault for every 4 KiB page it writes, which can cost many times
the copy itself (measurements: docs/results/mooncake.md).

    with MooncakeMaster(segment_bytes=2 << 30) as master:       # free loopback ports, waits until ready
        ep = master.endpoint                                    # MooncakeEndpoint: plain strings, picklable
        store = MooncakeHiddenStore("hs/run1", ep)             # in this or any other process / Ray actor

    ep = MooncakeMaster.connect("127.0.0.1:50051", "http://127.0.0.1:8080/metadata")   # an existing master

``python -m actors.mooncake_master --segment-bytes 1G`` runs one in the foreground and prints its endpoint.

Loopback: every address handed out is 127.0.0.1, but Mooncake 0.3.13 binds some listeners to the wildcard address
whatever the flags say (the master's HTTP metadata server ignores --http_metadata_server_host; every transfer
engine -- segment server and each store client -- listens on 0.0.0.0 / [::], MC_TCP_BIND_ADDRESS only sets the
address it advertises).  Traffic still flows over 127.0.0.1 only.  To also keep the *listeners* on loopback, the
processes started here run with a tiny LD_PRELOAD shim (compiled once with the system C compiler into the work
folder) that rewrites wildcard bind() calls to 127.0.0.1; :func:`loopback_preload_env` gives the same environment to
other processes that open stores (it must be in place when the process starts: Ray ``runtime_env={"env_vars":
...}``, subprocess ``env=``).  :meth:`MooncakeMaster.listen_report` shows what is actually bound.
"""
from __future__ import annotations

import argparse
import atexit
import contextlib
import hashlib
import logging
import ctypes
import importlib.util
import json
import os
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from pipeline.stores.mooncake import (ENV_MASTER_ADDR, ENV_METADATA_URL, ENV_SEGMENT_NAME, ENV_SEGMENT_SERVER,
                                      SEGMENT_SERVER_KEY, split_host_port, tcp_reachable)
from pipeline.core.runtime import LOOPBACK, apply_env, work_dir

MIN_SEGMENT_BYTES = 16 << 20  # mooncake_client refuses smaller segments
# pre-fault at most this much of a segment (memory made resident at start; a bigger segment faults the rest lazily)
PREFAULT_MAX_BYTES = 1 << 30
log = logging.getLogger(__name__)


class MooncakeLaunchError(RuntimeError):
    pass


@dataclass(frozen=True)
class MooncakeEndpoint:
    """Where a Mooncake store lives; plain strings, so it pickles to other processes and Ray actors.

    ``master_addr`` "127.0.0.1:PORT" (master RPC), ``metadata_url`` "http://127.0.0.1:PORT/metadata" (transfer-engine
    metadata), ``metrics_url`` "http://127.0.0.1:PORT" (master health/metrics; optional)."""

    master_addr: str
    metadata_url: str
    metrics_url: str = ""
    segment_server: str = ""  # "127.0.0.1:PORT": the segment server stores work through ("" = none)
    segment_name: str = ""  # that server's segment, where new objects are placed ("" = the master chooses)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "MooncakeEndpoint":
        return cls(d["master_addr"], d["metadata_url"], d.get("metrics_url", ""), d.get("segment_server", ""),
                   d.get("segment_name", ""))

    def on_server(self, server: "SegmentServer") -> "MooncakeEndpoint":
        """The same master, working through ``server`` (another node's segment server)."""
        return replace(self, segment_server=server.address, segment_name=server.segment_name)

    def to_env(self) -> dict[str, str]:
        """Environment for child processes: MooncakeHiddenStore(prefix) with no endpoint reads these."""
        env = {ENV_MASTER_ADDR: self.master_addr, ENV_METADATA_URL: self.metadata_url}
        if self.segment_server:
            env[ENV_SEGMENT_SERVER] = self.segment_server
        if self.segment_name:
            env[ENV_SEGMENT_NAME] = self.segment_name
        return env

    @classmethod
    def from_env(cls) -> "MooncakeEndpoint":
        try:
            return cls(os.environ[ENV_MASTER_ADDR], os.environ[ENV_METADATA_URL], "",
                       os.environ.get(ENV_SEGMENT_SERVER, ""), os.environ.get(ENV_SEGMENT_NAME, ""))
        except KeyError as e:
            raise MooncakeLaunchError(f"environment variable {e.args[0]} is not set") from None


@dataclass
class SegmentServer:
    """One running ``mooncake_client`` serving a segment: its RPC address, segment name, process and log."""

    address: str  # "127.0.0.1:PORT" (RPC; shared-memory clients also find its IPC socket by this port)
    segment_name: str  # "127.0.0.1:PORT2" (its transfer-engine name = the segment's name at the master)
    segment_bytes: int
    proc: subprocess.Popen
    log: Path


# ---------------------------------------------------------------------------------------------------------------------
# helpers
def find_binary(name: str) -> Path:
    """A binary shipped in the mooncake wheel (``mooncake_master`` / ``mooncake_client``).

    Order: $MOONCAKE_<NAME>_BIN, the ``mooncake`` package folder of this interpreter (found without importing it),
    then the interpreter's bin/ and PATH (the wheel's console scripts exec the same binary)."""
    env = os.environ.get(f"{name.upper()}_BIN")
    candidates: list[Path] = [Path(env)] if env else []
    spec = importlib.util.find_spec("mooncake")
    if spec is not None and spec.submodule_search_locations:
        candidates += [Path(p) / name for p in spec.submodule_search_locations]
    candidates.append(Path(sys.executable).parent / name)
    which = shutil.which(name)
    if which:
        candidates.append(Path(which))
    for c in candidates:
        if c.is_file():
            if not os.access(c, os.X_OK):  # wheels sometimes lose the executable bit
                with contextlib.suppress(OSError):
                    c.chmod(c.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
            if os.access(c, os.X_OK):
                return c
    raise MooncakeLaunchError(
        f"cannot find the {name} binary (looked in {[str(c) for c in candidates]}); install "
        "mooncake-transfer-engine-non-cuda (scripts/setup.sh) or set " f"{name.upper()}_BIN")


def free_port(host: str = LOOPBACK) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):  # hold all of them open at once so the n ports are distinct
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((LOOPBACK, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: never through a proxy


def _http_get(url: str, timeout: float = 2.0) -> tuple[int, bytes]:
    try:
        with _NO_PROXY.open(url, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read() or b""


def parse_size(v) -> int:
    """int bytes or strings like '512M', '2G', '1.5GiB'."""
    if isinstance(v, int):
        return v
    m = re.fullmatch(r"\s*([0-9.]+)\s*([kKmMgGtT]?)(i?[bB])?\s*", str(v))
    if not m:
        raise ValueError(f"cannot parse size {v!r}")
    return int(float(m.group(1)) * {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}[m.group(2).lower()])


_SHIM_C = r"""
/* LD_PRELOAD shim: bind() to the wildcard address goes to loopback instead (0.0.0.0 -> 127.0.0.1;
   :: -> ::ffff:127.0.0.1 on dual-stack sockets so IPv4 127.0.0.1 still connects, ::1 on v6-only ones). */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <netinet/in.h>
#include <string.h>
#include <sys/socket.h>
typedef int (*bind_fn)(int, const struct sockaddr *, socklen_t);
int bind(int fd, const struct sockaddr *addr, socklen_t len) {
    static bind_fn real_bind = 0;
    if (!real_bind) real_bind = (bind_fn)dlsym(RTLD_NEXT, "bind");
    if (addr && addr->sa_family == AF_INET && len >= (socklen_t)sizeof(struct sockaddr_in)) {
        struct sockaddr_in a;
        memcpy(&a, addr, sizeof a);
        if (a.sin_addr.s_addr == htonl(INADDR_ANY)) {
            a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
            return real_bind(fd, (const struct sockaddr *)&a, sizeof a);
        }
    } else if (addr && addr->sa_family == AF_INET6 && len >= (socklen_t)sizeof(struct sockaddr_in6)) {
        struct sockaddr_in6 a;
        memcpy(&a, addr, sizeof a);
        if (IN6_IS_ADDR_UNSPECIFIED(&a.sin6_addr)) {
            int v6only = 0;
            socklen_t sl = sizeof v6only;
            getsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &v6only, &sl);
            if (v6only) {
                a.sin6_addr = in6addr_loopback;
            } else {
                memset(&a.sin6_addr, 0, sizeof a.sin6_addr);
                a.sin6_addr.s6_addr[10] = 0xff; a.sin6_addr.s6_addr[11] = 0xff;
                a.sin6_addr.s6_addr[12] = 127; a.sin6_addr.s6_addr[15] = 1;
            }
            return real_bind(fd, (const struct sockaddr *)&a, sizeof a);
        }
    }
    return real_bind(fd, addr, len);
}
"""


def loopback_shim() -> Path | None:
    """Path of the compiled bind-to-loopback shim (built once into <work>/cache/mooncake), None if no C compiler."""
    digest = hashlib.sha1(_SHIM_C.encode()).hexdigest()[:10]
    out = work_dir() / "cache" / "mooncake" / f"loopback_bind-{digest}.so"
    if out.is_file():
        return out
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        log.warning("no C compiler: Mooncake listeners will bind the wildcard address (traffic stays on loopback)")
        return None
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    src = tmp.with_suffix(".c")
    src.write_text(_SHIM_C)
    try:
        r = subprocess.run([cc, "-O2", "-shared", "-fPIC", "-o", str(tmp), str(src), "-ldl"], capture_output=True,
                           text=True, timeout=120)
        if r.returncode != 0:
            log.warning("building the loopback shim failed: %s", r.stderr[-500:])
            return None
        os.replace(tmp, out)  # atomic: concurrent builders are fine
        return out
    finally:
        src.unlink(missing_ok=True)
        tmp.unlink(missing_ok=True)


def loopback_preload_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """{'LD_PRELOAD': ...} (merged with ``base``'s LD_PRELOAD) for a process that should bind only loopback; {} if
    the shim is unavailable.  Must be set when that process starts."""
    shim = loopback_shim()
    if shim is None:
        return {}
    prev = (base if base is not None else os.environ).get("LD_PRELOAD", "")
    if str(shim) in prev.split():
        return {"LD_PRELOAD": prev}
    return {"LD_PRELOAD": f"{shim} {prev}".strip()}


def _die_with_parent():  # runs in the child between fork and exec
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _stop_process(p: subprocess.Popen | None, timeout: float) -> int | None:
    """SIGTERM, then SIGKILL after ``timeout``; always reaps (no zombie)."""
    if p is None:
        return None
    if p.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            p.terminate()
        try:
            p.wait(timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                p.kill()
            p.wait(10)
    return p.returncode


def _tail(path: Path | None, n: int = 15) -> str:
    if path is None or not path.is_file():
        return ""
    lines = path.read_text(errors="replace").splitlines()[-n:]
    return "\n".join("    " + ln for ln in lines)


# ---------------------------------------------------------------------------------------------------------------------
class MooncakeMaster:
    """Start / stop a ``mooncake_master`` (+ a segment server) on loopback.  Also a context manager.

    segment_bytes   memory served by the segment server (the store's capacity); 0 = no segment server (then every
                    client must contribute ``global_segment_size`` and data dies with the client that holds it).
    rpc_port, http_port, metrics_port   None = free ports chosen at start.
    log_dir         where master/segment-server logs go (default <work>/logs/mooncake).
    extra_master_args   more ``--flag=value`` for the master.
    die_with_parent     the children get SIGTERM if the process (thread) that started them dies.
    loopback_only       run the children with the bind-to-loopback shim (see module doc).
    prefault            touch the pages of a new segment once at start (see module doc; the first
                        PREFAULT_MAX_BYTES of it), so puts into that memory never fault.
    """

    def __init__(self, segment_bytes: int | str = 1 << 30, *, rpc_port: int | None = None,
                 http_port: int | None = None, metrics_port: int | None = None, log_dir: str | Path | None = None,
                 extra_master_args: tuple[str, ...] = (), die_with_parent: bool = True,
                 loopback_only: bool = True, prefault: bool = True):
        self.prefault = prefault
        self.segment_servers: list[SegmentServer] = []
        self.segment_bytes = parse_size(segment_bytes)
        if 0 < self.segment_bytes < MIN_SEGMENT_BYTES:
            raise ValueError(f"segment_bytes must be 0 or >= {MIN_SEGMENT_BYTES} (mooncake_client minimum)")
        self._ports = (rpc_port, http_port, metrics_port)
        self.log_dir = Path(log_dir) if log_dir else None
        self.extra_master_args = tuple(extra_master_args)
        self.die_with_parent = die_with_parent
        self.loopback_only = loopback_only
        self.master_proc: subprocess.Popen | None = None
        self.master_log: Path | None = None
        self._endpoint: MooncakeEndpoint | None = None
        self._files: list = []

    # ---- lifecycle ----------------------------------------------------------------------------------------------
    @property
    def endpoint(self) -> MooncakeEndpoint:
        if self._endpoint is None:
            raise MooncakeLaunchError("master not started")
        return self._endpoint

    @property
    def segment_proc(self) -> subprocess.Popen | None:
        """The first segment server's process (the one the endpoint names)."""
        return self.segment_servers[0].proc if self.segment_servers else None

    @property
    def segment_log(self) -> Path | None:
        return self.segment_servers[0].log if self.segment_servers else None

    def is_running(self) -> bool:
        return self.master_proc is not None and self.master_proc.poll() is None and (
            self.segment_bytes == 0 or (bool(self.segment_servers)
                                        and all(s.proc.poll() is None for s in self.segment_servers)))

    def start(self, timeout: float = 60.0, attempts: int = 3) -> MooncakeEndpoint:
        """Start both processes and wait until the master serves and the segment is mounted."""
        if self.is_running():
            return self.endpoint
        apply_env()  # MC_TCP_BIND_ADDRESS etc. for the children
        err: Exception | None = None
        for _ in range(attempts):  # a chosen free port can be taken before the master binds it: retry
            try:
                self.segment_servers = []
                self._start_master(timeout)
                if self.segment_bytes:
                    server = self.add_segment_server(self.segment_bytes, timeout)
                    self._endpoint = self._endpoint.on_server(server)
                    self._advertise(server)
                atexit.register(self.stop)
                return self.endpoint
            except MooncakeLaunchError as e:
                err = e
                self.stop()
                if any(self._ports):  # fixed ports: retrying cannot help
                    break
        raise err  # type: ignore[misc]

    def _popen(self, argv: list[str], log: Path) -> subprocess.Popen:
        log.parent.mkdir(parents=True, exist_ok=True)
        f = open(log, "ab")
        self._files.append(f)
        env = os.environ.copy()
        if self.loopback_only:
            env.update(loopback_preload_env(env))
        return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT,
                                preexec_fn=_die_with_parent if self.die_with_parent else None, env=env)

    def _start_master(self, timeout: float):
        rpc, http, met = self._ports
        free = iter(_free_ports(3))
        rpc, http, met = rpc or next(free), http or next(free), met or next(free)
        log_dir = self.log_dir or work_dir() / "logs" / "mooncake"
        self.master_log = log_dir / f"master-{rpc}.log"
        argv = [str(find_binary("mooncake_master")),
                f"--rpc_port={rpc}", f"--rpc_address={LOOPBACK}",
                "--enable_http_metadata_server=true", f"--http_metadata_server_host={LOOPBACK}",
                f"--http_metadata_server_port={http}",
                f"--metrics_host={LOOPBACK}", f"--metrics_port={met}",
                # hidden states must never be evicted silently: the store puts hard-pinned objects (a full store
                # then fails the put with a clear error); soft-pinned ones are protected too.
                "--allow_evict_soft_pinned_objects=false",
                "--logtostderr", *self.extra_master_args]
        self.master_proc = self._popen(argv, self.master_log)
        ep = MooncakeEndpoint(f"{LOOPBACK}:{rpc}", f"http://{LOOPBACK}:{http}/metadata", f"http://{LOOPBACK}:{met}")
        deadline = time.monotonic() + timeout
        while True:
            if self.master_proc.poll() is not None:
                raise MooncakeLaunchError(f"mooncake_master exited with {self.master_proc.returncode} "
                                          f"(log {self.master_log}):\n{_tail(self.master_log)}")
            if self._master_ready(ep):
                break
            if time.monotonic() > deadline:
                raise MooncakeLaunchError(f"mooncake_master not ready after {timeout:.0f}s "
                                          f"(log {self.master_log}):\n{_tail(self.master_log)}")
            time.sleep(0.1)
        self._endpoint = ep

    @staticmethod
    def _master_ready(ep: MooncakeEndpoint) -> bool:
        try:
            code, body = _http_get(ep.metrics_url + "/health", timeout=1.0)
            if code != 200 or not json.loads(body or b"{}").get("service_ready", True):
                return False
            code, _ = _http_get(ep.metadata_url + "?key=__probe__", timeout=1.0)  # 404 = serving
        except (OSError, ValueError):
            return False
        return code in (200, 404) and tcp_reachable(*split_host_port(ep.master_addr), timeout=1.0)

    def _advertise(self, server: SegmentServer) -> None:
        """Publish the first segment server at the metadata server, so that stores opened with only the master's
        addresses (``--mooncake-master``) find it (pipeline.stores.mooncake.SEGMENT_SERVER_KEY)."""
        body = json.dumps({"segment_server": server.address, "segment_name": server.segment_name}).encode()
        req = urllib.request.Request(f"{self.endpoint.metadata_url}?key={SEGMENT_SERVER_KEY}", data=body,
                                     method="PUT")
        try:
            with _NO_PROXY.open(req, timeout=5.0) as r:
                ok = r.status == 200
        except OSError as e:
            ok, _ = False, e
        if not ok:
            raise MooncakeLaunchError(f"could not publish the segment server at {self.endpoint.metadata_url}")

    def add_segment_server(self, segment_bytes: int | str, timeout: float = 60.0,
                           prefault: bool | None = None) -> SegmentServer:
        """Start one more segment server (e.g. one per simulated node) serving ``segment_bytes``; waits until its
        segment is mounted (and pre-faulted unless ``prefault`` - default: the master's setting - is False).
        ``endpoint.on_server(server)`` is the endpoint that works through it."""
        nbytes = parse_size(segment_bytes)
        if nbytes < MIN_SEGMENT_BYTES:
            raise ValueError(f"segment_bytes must be >= {MIN_SEGMENT_BYTES} (mooncake_client minimum)")
        ep = self.endpoint
        before = self.capacity().get("total", 0)
        port, te_port = _free_ports(2)
        log = self.master_log.with_name(self.master_log.stem.replace("master", f"segment{len(self.segment_servers)}")
                                        + ".log")
        # --host with a port fixes the transfer-engine name, which is the segment's name at the master
        argv = [str(find_binary("mooncake_client")), f"--host={LOOPBACK}:{te_port}", f"--port={port}",
                f"--global_segment_size={nbytes}", "--local_buffer_size=0", "--protocol=tcp",
                f"--master_server_address={ep.master_addr}", f"--metadata_server={ep.metadata_url}",
                "--logtostderr"]
        server = SegmentServer(f"{LOOPBACK}:{port}", f"{LOOPBACK}:{te_port}", nbytes, self._popen(argv, log), log)
        self.segment_servers.append(server)
        deadline = time.monotonic() + timeout
        while self.capacity().get("total", 0) < before + nbytes or not tcp_reachable(LOOPBACK, port, 0.5):
            if server.proc.poll() is not None:
                raise MooncakeLaunchError(f"segment server (mooncake_client) exited with {server.proc.returncode} "
                                          f"(log {log}):\n{_tail(log)}")
            if time.monotonic() > deadline:
                raise MooncakeLaunchError(f"segment of {nbytes} bytes not mounted after {timeout:.0f}s "
                                          f"(log {log}):\n{_tail(log)}")
            time.sleep(0.1)
        if self.prefault if prefault is None else prefault:
            t0 = time.monotonic()
            prefault_segment(ep.on_server(server), min(nbytes, PREFAULT_MAX_BYTES))
            with log.open("a") as f:
                f.write(f"[dspark] segment pre-faulted in {time.monotonic() - t0:.2f} s\n")
        return server

    def stop(self, timeout: float = 10.0) -> None:
        """Segment server first, then the master; SIGTERM, SIGKILL after ``timeout``; reaped.  Idempotent."""
        for server in reversed(self.segment_servers):
            _stop_process(server.proc, timeout)
        _stop_process(self.master_proc, timeout)
        for f in self._files:
            f.close()
        self._files = []
        with contextlib.suppress(Exception):
            atexit.unregister(self.stop)

    def __enter__(self) -> "MooncakeMaster":
        self.start()
        return self

    def __exit__(self, *exc):
        self.stop()

    # ---- introspection ------------------------------------------------------------------------------------------
    def capacity(self) -> dict[str, int]:
        """{'total': bytes mounted, 'allocated': bytes used} from the master's metrics (empty if unavailable)."""
        return read_capacity(self.endpoint)

    def listen_report(self) -> list[str]:
        """The TCP listening sockets of the master and segment server (``ss -ltnp``), for auditing binds."""
        pids = {p.pid for p in (self.master_proc, *(x.proc for x in self.segment_servers)) if p is not None}
        try:
            out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, timeout=5).stdout
        except (OSError, subprocess.SubprocessError):
            return []
        return [ln.split()[3] + "  " + ln.split()[-1] for ln in out.splitlines()
                if any(f"pid={pid}," in ln for pid in pids)]

    # ---- an existing master -------------------------------------------------------------------------------------
    @staticmethod
    def connect(master_addr: str, metadata_url: str, metrics_url: str = "", timeout: float = 10.0,
                allow_non_loopback: bool = False, segment_server: str = "", segment_name: str = ""
                ) -> MooncakeEndpoint:
        """Check that a master runs at these addresses and return its endpoint (nothing is started)."""
        ep = MooncakeEndpoint(master_addr, metadata_url, metrics_url, segment_server, segment_name)
        host, port = split_host_port(master_addr)
        if not allow_non_loopback and host not in (LOOPBACK, "localhost"):
            raise MooncakeLaunchError(f"master {master_addr} is not on loopback (this project keeps all traffic on "
                                      f"{LOOPBACK}; pass allow_non_loopback=True to override)")
        deadline = time.monotonic() + timeout
        while not tcp_reachable(host, port):
            if time.monotonic() > deadline:
                raise MooncakeLaunchError(f"no Mooncake master reachable at {master_addr} (waited {timeout:.0f}s)")
            time.sleep(0.2)
        try:
            code, _ = _http_get(metadata_url + "?key=__probe__", timeout=timeout)
        except OSError as e:
            raise MooncakeLaunchError(f"metadata server {metadata_url} unreachable: {e}") from None
        if code not in (200, 404):
            raise MooncakeLaunchError(f"metadata server {metadata_url} answered HTTP {code}")
        return ep


def prefault_segment(ep: MooncakeEndpoint, nbytes: int, chunk: int = 16 << 20) -> None:
    """Write every page of the segment of ``ep.segment_server`` once (objects of ``chunk`` bytes placed in that
    segment until it is full), then remove them again: later puts land in memory that is already resident."""
    from mooncake.store import MooncakeDistributedStore, ReplicateConfig

    client = MooncakeDistributedStore()
    if client.setup_dummy(1 << 20, 1 << 20, ep.segment_server) != 0:
        raise MooncakeLaunchError(f"cannot attach to segment server {ep.segment_server} to pre-fault it")
    try:
        addr = client.alloc_from_mem_pool(chunk)
        if not addr or client.register_buffer(addr, chunk) != 0:
            raise MooncakeLaunchError("cannot allocate shared memory to pre-fault the segment")
        cfg = ReplicateConfig()
        cfg.replica_num = 1
        cfg.preferred_segment = ep.segment_name
        size, n, placed = chunk, 0, 0
        while placed < nbytes and size >= 1 << 20:
            rc = client.batch_put_from([f"@dspark-prefault/{n}"], [addr], [size], cfg)[0]
            if rc == 0:
                n, placed = n + 1, placed + size
            else:  # full at this size: fill the gaps with smaller objects
                size //= 2
        client.remove_by_regex("^@dspark-prefault/", True)
    finally:
        client.close()


def read_capacity(ep: MooncakeEndpoint) -> dict[str, int]:
    if not ep.metrics_url:
        return {}
    try:
        code, body = _http_get(ep.metrics_url + "/metrics", timeout=2.0)
    except OSError:
        return {}
    out: dict[str, int] = {}
    for line in body.decode(errors="replace").splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0] == "master_total_capacity_bytes":
            out["total"] = int(float(parts[1]))
        elif len(parts) == 2 and parts[0] == "master_allocated_bytes":
            out["allocated"] = int(float(parts[1]))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Run a Mooncake master + segment server on 127.0.0.1 until "
                                             "interrupted; prints the endpoint as JSON and as shell exports.")
    ap.add_argument("--segment-bytes", default="1G", help="store capacity served by the segment server (e.g. 2G)")
    ap.add_argument("--rpc-port", type=int)
    ap.add_argument("--http-port", type=int)
    ap.add_argument("--metrics-port", type=int)
    args = ap.parse_args(argv)
    m = MooncakeMaster(args.segment_bytes, rpc_port=args.rpc_port, http_port=args.http_port,
                       metrics_port=args.metrics_port, die_with_parent=False)
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    with m:
        print(json.dumps(m.endpoint.to_dict()))
        for k, v in m.endpoint.to_env().items():
            print(f"export {k}={v}")
        sys.stdout.flush()
        try:
            while not stop and m.is_running():
                time.sleep(0.5)
        except KeyboardInterrupt:
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
