"""MooncakeHiddenStore against a real mooncake_master (+ segment server) on 127.0.0.1.

Cross-process checks run this file as a script (``python tests/test_mooncake_store.py <role> <json>``) in fresh
interpreters; they print JSON (per-sample SHA-256 of the raw tensor bytes) which the test compares with the
expected data, regenerated from seeds -- so bf16 equality is bit-for-bit, NaN payloads included.
"""
from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from pipeline.core.runtime import apply_env

apply_env()

import torch  # noqa: E402

from pipeline.stores.base import TENSOR_FIELDS, StoreError  # noqa: E402
from pipeline.stores.mooncake import MooncakeHiddenStore  # noqa: E402

AUX, HID = 3 * 64, 64


def make_sample(seed: int, T: int) -> dict[str, torch.Tensor]:
    """Random tensors; bf16 from random 16-bit patterns (every pattern class: NaN payloads, inf, subnormals)."""
    g = torch.Generator().manual_seed(seed)
    return {
        "input_ids": torch.randint(-2**31, 2**31 - 1, (T,), generator=g, dtype=torch.int32),
        "loss_mask": torch.randint(0, 256, (T,), generator=g, dtype=torch.int32).to(torch.uint8),
        "aux_hidden": torch.randint(-2**15, 2**15, (T, AUX), generator=g, dtype=torch.int32).to(torch.int16)
        .view(torch.bfloat16),
        "last_hidden": torch.randint(-2**15, 2**15, (T, HID), generator=g, dtype=torch.int32).to(torch.int16)
        .view(torch.bfloat16),
        # the optional field on every other sample (random bit patterns, viewed as fp32)
        **({"target_lse": torch.randint(-2**31, 2**31 - 1, (T,), generator=g, dtype=torch.int32).view(torch.float32)}
           if seed % 2 == 0 else {}),
    }


def digest(tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    out = {}
    for name, t in tensors.items():
        raw = t.view(torch.int16) if t.dtype == torch.bfloat16 else t
        out[name] = f"{t.dtype}|{tuple(t.shape)}|" + hashlib.sha256(raw.contiguous().numpy().tobytes()).hexdigest()
    return out


def assert_bit_exact(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]):
    assert set(a) == set(b) and set(TENSOR_FIELDS) <= set(a)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        ra, rb = (t.view(torch.int16) if t.dtype == torch.bfloat16 else t.view(torch.int32)
                  if t.dtype == torch.float32 else t for t in (a[k], b[k]))  # bit patterns (NaN != NaN)
        assert torch.equal(ra, rb), k


SPECS = [("s0", 0, 1), ("s1", 1, 37), ("s2", 2, 300), ("x/with/slash", 3, 5), ("empty", 4, 0)]  # (id, seed, T)


# ---------------------------------------------------------------------------------------------------------------------
# child-process roles (run as a script)
def _role_write(args: dict) -> dict:
    s = MooncakeHiddenStore(args["prefix"], index_every=args.get("index_every", 64))
    for sid, seed, T in args["samples"]:
        s.put(sid, make_sample(seed, T))
    if args.get("partial"):  # stray field objects under a sample's name, no sample object: they must stay invisible
        sid, seed, T = args["partial"]
        t = make_sample(seed, T)
        from pipeline.stores.base import tensor_to_bytes
        rc = s._store.upsert_batch([f"{s._key(sid)}/{n}" for n in t], [tensor_to_bytes(v) for v in t.values()],
                                   s._cfg)
        assert rc == 0, rc
    if args.get("crash"):
        sys.stdout.write(json.dumps({"ok": True}) + "\n")
        sys.stdout.flush()
        os._exit(3)  # no flush, no close
    if args.get("commit"):
        s.commit({"target": "test"})
    s.close()
    return {"ok": True}


def _role_read(args: dict) -> dict:
    s = MooncakeHiddenStore(args["prefix"], zero_copy=args.get("zero_copy", True))
    ids = s.manifest()["sample_ids"] if args.get("use_manifest") else args["ids"]
    out = {}
    for _ in range(args.get("repeat", 1)):
        for sid, t in s.iter_samples(ids):
            d = digest(t)
            assert out.setdefault(sid, d) == d
    s.close()
    return {"digests": out, "pid": os.getpid()}


def run_child(role: str, args: dict, endpoint, wait: bool = True, timeout: float = 120):
    from actors.mooncake_master import loopback_preload_env

    env = dict(os.environ, **endpoint.to_env(), PYTHONPATH=str(ROOT))
    env.update(loopback_preload_env(env))
    p = subprocess.Popen([sys.executable, __file__, role, json.dumps(args)], env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    if not wait:
        return p
    return finish_child(p, timeout)


def finish_child(p: subprocess.Popen, timeout: float = 120, expect_rc: int = 0) -> dict:
    out, err = p.communicate(timeout=timeout)
    assert p.returncode == expect_rc, f"child rc={p.returncode}\n{err[-3000:]}"
    return json.loads(out.strip().splitlines()[-1])


if __name__ == "__main__":
    _role, _args = sys.argv[1], json.loads(sys.argv[2])
    print(json.dumps({"write": _role_write, "read": _role_read}[_role](_args)), flush=True)
    sys.exit(0)

# ---------------------------------------------------------------------------------------------------------------------
import pytest  # noqa: E402

from actors.mooncake_master import (MooncakeEndpoint, MooncakeLaunchError, MooncakeMaster, free_port,  # noqa: E402
                                    loopback_shim, tcp_reachable)

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def master():
    with MooncakeMaster(segment_bytes="128M") as m:
        yield m


@pytest.fixture
def store_factory(master, request):
    opened = []

    def make(prefix=None, **kw):
        s = MooncakeHiddenStore(prefix or f"t/{request.node.name}", master.endpoint, **kw)
        opened.append(s)
        return s

    yield make
    for s in opened:
        try:
            s.drop()
        finally:
            s.close()


@pytest.mark.parametrize("zero_copy", [True, False])
def test_roundtrip_bit_exact_in_process(store_factory, zero_copy):
    s = store_factory(zero_copy=zero_copy)
    for sid, seed, T in SPECS:
        s.put(sid, make_sample(seed, T))
    for sid, seed, T in SPECS:
        assert_bit_exact(s.get(sid), make_sample(seed, T))
    # the other transfer path reads the same bytes
    other = store_factory(s.prefix, zero_copy=not zero_copy)
    got = other.get_many([sid for sid, _, _ in SPECS])
    for (sid, seed, T), t in zip(SPECS, got):
        assert_bit_exact(t, make_sample(seed, T))


def test_put_existing_is_noop_and_validation(store_factory):
    s = store_factory()
    s.put("a", make_sample(1, 10))
    s.put("a", make_sample(2, 20))  # same id, other data: ignored
    assert_bit_exact(s.get("a"), make_sample(1, 10))
    bad = make_sample(3, 4)
    bad["aux_hidden"] = bad["aux_hidden"].float()
    with pytest.raises(StoreError):
        s.put("b", bad)
    with pytest.raises(StoreError):
        s.put("manifest", make_sample(3, 4))


def test_unknown_id_raises_keyerror(store_factory):
    s = store_factory()
    s.put("a", make_sample(1, 3))
    with pytest.raises(KeyError):
        s.get("nope")
    with pytest.raises(KeyError):
        s.get_many(["a", "nope"])
    with pytest.raises(KeyError):
        s.get("")


def test_manifest_absent_until_commit(store_factory):
    s = store_factory()
    with pytest.raises(StoreError, match="no manifest"):
        s.manifest()
    s.put("a", make_sample(1, 5))
    s.put("b", make_sample(2, 7))
    reader = store_factory(s.prefix)
    with pytest.raises(StoreError):
        reader.manifest()
    m = s.commit({"target": "t", "layer_ids": [1, 2, 3]})
    assert m == reader.manifest()
    assert m["sample_ids"] == ["a", "b"] and m["num_rows"] == 2 and m["num_tokens"] == 12
    assert m["backend"] == "mooncake" and m["layer_ids"] == [1, 2, 3]
    assert [sid for sid, _ in reader.iter_samples()] == ["a", "b"]
    # a later put makes the store incomplete again (as a new disk shard does), until the next commit
    s.put("c", make_sample(3, 1))
    with pytest.raises(StoreError):
        reader.manifest()
    assert s.commit({"target": "t"})["sample_ids"] == ["a", "b", "c"]


def test_done_ids_and_resume_after_crash(master, store_factory):
    prefix = "t/resume"
    specs = [(f"r{i}", 10 + i, 8 + i) for i in range(5)]
    res = run_child("write", {"prefix": prefix, "samples": specs, "index_every": 2, "crash": True,
                              "partial": ["r9", 99, 6]}, master.endpoint, wait=False)
    assert finish_child(res, expect_rc=3)["ok"]
    s = store_factory(prefix, index_every=2)
    # the crashed writer indexed r0..r3 (every 2 puts); r4 was put after its last index write; r9 has no header
    assert s.done_ids() == {"r0", "r1", "r2", "r3"}
    with pytest.raises(KeyError):
        s.get("r9")
    assert_bit_exact(s.get("r4"), make_sample(14, 12))  # visible (header exists), just not yet indexed
    # resume: put everything not done; existing ids are no-ops, r9's leftovers are overwritten
    for sid, seed, T in specs + [("r9", 109, 6)]:
        if sid not in s.done_ids():
            s.put(sid, make_sample(seed, T))
    s.flush()
    fresh = store_factory(prefix)
    assert fresh.done_ids() == {f"r{i}" for i in range(5)} | {"r9"}
    assert_bit_exact(fresh.get("r9"), make_sample(109, 6))
    for sid, seed, T in specs:
        assert_bit_exact(fresh.get(sid), make_sample(seed, T))
    m = fresh.commit({"target": "t"})
    assert m["num_rows"] == 6


@pytest.fixture(scope="module")
def written(master):
    """A store written and committed by another process that has exited."""
    prefix = "t/xproc"
    run_child("write", {"prefix": prefix, "samples": SPECS, "commit": True}, master.endpoint)
    yield prefix
    with MooncakeHiddenStore(prefix, master.endpoint) as s:
        s.drop()


def test_cross_process_roundtrip(master, written):
    expected = {sid: digest(make_sample(seed, T)) for sid, seed, T in SPECS}
    got = run_child("read", {"prefix": written, "use_manifest": True, "zero_copy": False}, master.endpoint)
    assert got["digests"] == expected  # reader process != writer process (which is gone)
    with MooncakeHiddenStore(written, master.endpoint) as s:  # and this process
        assert s.manifest()["sample_ids"] == sorted(expected)
        assert s.done_ids() == set(expected)
        for sid, seed, T in SPECS:
            assert_bit_exact(s.get(sid), make_sample(seed, T))


def test_two_consumers_in_separate_processes(master, written):
    expected = {sid: digest(make_sample(seed, T)) for sid, seed, T in SPECS}
    ids = [sid for sid, _, _ in SPECS]
    procs = [run_child("read", {"prefix": written, "ids": ids, "repeat": 5}, master.endpoint, wait=False)
             for _ in range(2)]
    results = [finish_child(p) for p in procs]
    assert results[0]["pid"] != results[1]["pid"]
    for r in results:
        assert r["digests"] == expected


def test_unreachable_master_fails_fast():
    port = free_port()
    t0 = time.monotonic()
    with pytest.raises(StoreError, match="unreachable"):
        MooncakeHiddenStore("t/x", master_addr=f"127.0.0.1:{port}",
                            metadata_url=f"http://127.0.0.1:{free_port()}/metadata", connect_timeout_s=1.0)
    assert time.monotonic() - t0 < 10
    with pytest.raises(MooncakeLaunchError):
        MooncakeMaster.connect(f"127.0.0.1:{port}", "http://127.0.0.1:1/metadata", timeout=1.0)
    with pytest.raises(MooncakeLaunchError, match="loopback"):
        MooncakeMaster.connect("10.0.0.1:50051", "http://10.0.0.1:8080/metadata", timeout=1.0)


def test_store_full_is_a_clear_error_and_nothing_is_evicted():
    with MooncakeMaster(segment_bytes="32M") as small:
        s = MooncakeHiddenStore("t/full", small.endpoint)
        try:
            T = 2048  # ~1.3 MB per sample
            put = []
            with pytest.raises(StoreError, match="FULL"):
                for i in range(100):
                    s.put(f"f{i}", make_sample(i, T))
                    put.append(i)
            assert 10 <= len(put) < 100
            for i in put:  # hard-pinned: every sample put before the error is still there, bit-exact
                assert_bit_exact(s.get(f"f{i}"), make_sample(i, T))
            s.drop()  # frees the space
            s.put("again", make_sample(7, T))
        finally:
            s.close()


def test_master_lifecycle_connect_and_stop():
    m = MooncakeMaster(segment_bytes="16M")
    ep = m.start()
    try:
        assert m.is_running()
        assert ep.master_addr.startswith("127.0.0.1:") and ep.metadata_url.startswith("http://127.0.0.1:")
        assert MooncakeMaster.connect(ep.master_addr, ep.metadata_url) == MooncakeEndpoint(ep.master_addr,
                                                                                           ep.metadata_url)
        assert pickle.loads(pickle.dumps(ep)) == ep
        assert MooncakeEndpoint.from_dict(json.loads(json.dumps(ep.to_dict()))) == ep
        assert m.capacity()["total"] >= 16 << 20
        if loopback_shim() is not None and shutil.which("ss"):
            listeners = m.listen_report()
            assert listeners and all(ln.startswith(("127.0.0.1:", "[::ffff:127.0.0.1]:", "[::1]:"))
                                     for ln in listeners), listeners
    finally:
        m.stop()
    assert m.master_proc.returncode is not None and m.segment_proc.returncode is not None
    for p in (m.master_proc, m.segment_proc):  # reaped: no zombie left
        with pytest.raises(ChildProcessError):
            os.waitpid(p.pid, os.WNOHANG)
    host, port = ep.master_addr.rsplit(":", 1)
    assert not tcp_reachable(host, int(port), timeout=0.5)
    m.stop()  # idempotent


def test_zero_copy_get_views_reused_memory_and_held_tensors_stay_intact(store_factory):
    """A zero-copy get hands out views of leased shared memory: held tensors keep their lease (later gets land
    elsewhere, the pool grows), dropped ones give the memory back for reuse."""
    s = store_factory(read_pool_bytes=1 << 20)
    specs = [(f"z{i}", 20 + i, 700) for i in range(6)]  # ~0.4 MB each
    for sid, seed, T in specs:
        s.put(sid, make_sample(seed, T))
    held = [s.get(sid) for sid, _, _ in specs]  # more than the first 1 MiB arena holds
    assert s._pool.capacity > 1 << 20
    for _ in range(3):  # churn: these gets must not overwrite the held ones
        for sid, seed, T in specs:
            assert_bit_exact(s.get(sid), make_sample(seed, T))
    for (sid, seed, T), t in zip(specs, held):
        assert_bit_exact(t, make_sample(seed, T))
    cap = s._pool.capacity
    view = held[0]["aux_hidden"][1:]  # a view keeps the lease alive after the dict is gone
    del held, t
    assert_bit_exact({**make_sample(20, 700), "aux_hidden": torch.cat([make_sample(20, 700)["aux_hidden"][:1], view])},
                     make_sample(20, 700))
    del view
    for _ in range(3):  # everything released: the pool serves these without growing
        for sid, seed, T in specs:
            assert_bit_exact(s.get(sid), make_sample(seed, T))
    assert s._pool.capacity == cap
    assert s._pool.free_bytes() == cap


def test_full_client_without_segment_server(master, store_factory):
    """No segment server address: the store is a full Mooncake client (every transfer over loopback TCP) and reads
    the same objects bit-exact."""
    s = store_factory()
    tcp = store_factory(s.prefix, segment_server="")
    assert s.via_segment_server and not tcp.via_segment_server
    for sid, seed, T in SPECS[:3]:
        s.put(sid, make_sample(seed, T))
    tcp.put("tcp-written", make_sample(9, 33))
    for sid, seed, T in SPECS[:3]:
        assert_bit_exact(tcp.get(sid), make_sample(seed, T))
    assert_bit_exact(s.get("tcp-written"), make_sample(9, 33))


def test_two_nodes_writer_segment_and_remote_reader():
    """One segment server per (simulated) node: the writer's samples are placed in ITS node's segment, a reader
    working through the other node's server gets them over the transfer engine, bit-exact, in another process."""
    with MooncakeMaster(segment_bytes="64M") as m:
        other = m.add_segment_server("64M")
        writer_ep, reader_ep = m.endpoint, m.endpoint.on_server(other)
        assert writer_ep.segment_name != reader_ep.segment_name
        before = m.capacity()["allocated"]
        w = MooncakeHiddenStore("t/nodes", writer_ep)
        specs = [(f"n{i}", 40 + i, 900) for i in range(4)]
        for sid, seed, T in specs:
            w.put(sid, make_sample(seed, T))
        w.commit({"target": "t"})
        assert m.capacity()["allocated"] > before
        got = run_child("read", {"prefix": "t/nodes", "use_manifest": True}, reader_ep)
        assert got["digests"] == {sid: digest(make_sample(seed, T)) for sid, seed, T in specs}
        w.drop()
        w.close()


def test_master_killed_while_open_is_a_clear_error():
    """The master dies under an open store: the next put / flush fails with a StoreError within seconds."""
    m = MooncakeMaster(segment_bytes="32M")
    m.start()
    try:
        s = MooncakeHiddenStore("t/down", m.endpoint)
        s.put("a", make_sample(1, 10))
        m.master_proc.kill()
        m.master_proc.wait(10)
        t0 = time.monotonic()
        with pytest.raises(StoreError, match="Mooncake error"):
            s.put("b", make_sample(2, 10))
        with pytest.raises(StoreError):
            s.flush()
        assert time.monotonic() - t0 < 10  # both errors come at once (measured: < 0.1 s)
        t0 = time.monotonic()
        with pytest.raises(StoreError):  # its index cannot be written; the client is closed all the same
            s.close()
        assert time.monotonic() - t0 < 30  # Mooncake's client teardown gives up on the dead peers (~5 s)
    finally:
        m.stop()


def test_alloc_sample_puts_in_place_and_other_tensors_are_copied(store_factory):
    """Tensors from alloc_sample, filled in place, are put straight from their registered memory; a sample that
    is not laid out as its object (a slice of one, ordinary tensors) is copied - both read back bit-exact."""
    from pipeline.stores.mooncake import tensor_bytes_view

    s = store_factory()
    ref = make_sample(6, 50)  # with target_lse
    t = s.alloc_sample(50, AUX, HID, with_lse=True)
    assert set(t) == set(ref)
    for name, v in ref.items():
        tensor_bytes_view(t[name])[:] = tensor_bytes_view(v.contiguous())
    staging_before = s._staging
    s.put("inplace", t)
    assert s._staging is staging_before  # nothing went through the staging buffer
    assert_bit_exact(s.get("inplace"), ref)
    sliced = {k: v[:20] for k, v in t.items()}  # views of the same lease, but not its object's layout
    s.put("sliced", sliced)
    assert_bit_exact(s.get("sliced"), {k: v[:20] for k, v in ref.items()})
    with pytest.raises(StoreError):
        store_factory(zero_copy=False).alloc_sample(4, AUX, HID)


def test_master_addresses_alone_find_the_segment_server(master, store_factory):
    """A store opened with only the master's two addresses (what --mooncake-master gives a job) finds the segment
    server the launcher published and works through it; what it wrote reads back bit-exact elsewhere."""
    ep = master.endpoint
    s = MooncakeHiddenStore("t/discover", master_addr=ep.master_addr, metadata_url=ep.metadata_url)
    try:
        assert s.via_segment_server and s.segment_server == ep.segment_server
        assert s.segment_name == ep.segment_name
        s.put("a", make_sample(3, 40))
        assert_bit_exact(store_factory("t/discover").get("a"), make_sample(3, 40))
        s.drop()
    finally:
        s.close()
