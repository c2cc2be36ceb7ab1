"""Mooncake hidden-state transport vs an in-process memory copy of the same bytes, in one interleaved run.

One realistic sample (default 2048 tokens x (3 aux layers of 576 + the last hidden 576) bf16, plus int32 ids and
uint8 mask: 9.45 MB) goes through every path once per repetition, the cases rotating (A B C .., B C .. A) so that
machine load hits all alike; medians.  A master and segment servers run on 127.0.0.1 for the run.

  memcpy            torch .clone() of the sample's four tensors (a fresh destination)
  memcpy.warm       .copy_() of the same tensors into tensors allocated once (a resident destination)
  local             MooncakeHiddenStore.put then .get through the node's segment server (shared memory: one memcpy
                    in the server each way; the get hands back views of the shared memory it landed in)
  local.inplace     as local, but the producer writes the sample into MooncakeHiddenStore.alloc_sample tensors
                    (registered memory laid out as the object; the extraction worker decodes its rows this way),
                    so the put copies nothing in the writer.  That fill is timed apart ("fill"), not in put
  local.batch       put_many / get_many of --batch samples per call (per-sample time reported)
  local.inplace.batch  both: --batch samples written into alloc_sample tensors, put_many, get_many - the path of
                    the extraction worker (decodes rows into alloc_sample, puts each batch) and a training worker
                    (get_many of a step's samples)
  remote            written through one segment server, read through ANOTHER (two simulated nodes): the get is
                    pulled between the servers by the transfer engine over loopback TCP
  cold              as local, but into a segment that was never pre-faulted (every put lands on fresh pages)
  tcp               a full client with no segment server (every put and get crosses loopback TCP)
  raw               the bare binding: batch_put_from + batch_get_into of one registered shared-memory buffer

Every get is checked bit-exact against the sample (outside the timed part).  Rates are bytes / median seconds
(1 GB = 1e9 bytes); put+get is bytes / median(t_put + t_get): the rate at which a sample goes writer -> store ->
reader.  Ratios are to the FASTER of the two in-process copies; the goal line checks put+get >= 0.3x and
get >= 0.5x for the `local` path.

    python -m jobs.bench mooncake                       # defaults: 2048 tokens, 9 repetitions
    python -m jobs.bench mooncake --tokens 512 --reps 15 --cases memcpy,memcpy.warm,local,raw
"""
from __future__ import annotations

import os
import statistics
import time

NAME = "mooncake"
HELP = "Mooncake hidden-state put/get (same node, across nodes, TCP, raw binding) vs memcpy of the same sample"

CASES = ("memcpy", "memcpy.warm", "local", "local.inplace", "local.batch", "local.inplace.batch", "remote", "cold",
         "tcp", "raw")
GOAL_PUT_GET, GOAL_GET = 0.3, 0.5


def add_arguments(ap) -> None:
    ap.add_argument("--tokens", type=int, default=2048, help="tokens per sample (default 2048)")
    ap.add_argument("--hidden", type=int, default=576, help="target hidden size (default 576, SmolLM2-135M)")
    ap.add_argument("--aux-layers", type=int, default=3, help="aux layers concatenated in aux_hidden (default 3)")
    ap.add_argument("--reps", type=int, default=9, help="interleaved repetitions; medians are reported (default 9)")
    ap.add_argument("--batch", type=int, default=8, help="samples per call of the local.batch case (default 8)")
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma-separated subset of {','.join(CASES)}")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads (default 1: a copy is memory-bound; the segment server copies "
                         "with one thread too)")


def make_sample(T: int, d: int, n_aux: int, seed: int = 0) -> dict:
    import torch

    g = torch.Generator().manual_seed(seed)
    return {"input_ids": torch.randint(0, 49152, (T,), generator=g, dtype=torch.int32),
            "loss_mask": torch.randint(0, 2, (T,), generator=g, dtype=torch.int32).to(torch.uint8),
            "aux_hidden": torch.randn(T, n_aux * d, generator=g).to(torch.bfloat16),
            "last_hidden": torch.randn(T, d, generator=g).to(torch.bfloat16)}


def bit_equal(a: dict, b: dict) -> bool:
    import torch

    def bits(t):
        return t.view(torch.int16) if t.dtype == torch.bfloat16 else t

    return set(a) == set(b) and all(torch.equal(bits(a[k]), bits(b[k])) for k in b)


def run(args, harness) -> dict:
    import numpy as np
    import torch

    from actors.mooncake_master import MooncakeMaster
    from pipeline.stores.mooncake import MooncakeHiddenStore, tensor_bytes_view

    torch.set_num_threads(args.threads)
    os.environ.setdefault("GLOG_minloglevel", "1")  # Mooncake's per-call INFO lines would drown the tables
    cases = [c for c in args.cases.split(",") if c]
    unknown = set(cases) - set(CASES)
    if unknown or not cases:
        raise SystemExit(f"--cases: unknown {sorted(unknown)} (choose from {','.join(CASES)})")
    if args.reps < 1 or args.batch < 1 or args.tokens < 1:
        raise SystemExit("--reps, --batch and --tokens must be >= 1")
    sample = make_sample(args.tokens, args.hidden, args.aux_layers)
    nbytes = sum(t.numel() * t.element_size() for t in sample.values())
    batch = [(f"b{i}", make_sample(args.tokens, args.hidden, args.aux_layers, seed=1 + i)) for i in range(args.batch)]
    per_rep = nbytes * (2 * args.batch if {"local.batch", "local.inplace.batch"} & set(cases) else 1)
    local_bytes = max(256 << 20, 4 * per_rep + (64 << 20))

    master = MooncakeMaster(segment_bytes=local_bytes)
    t0 = time.monotonic()
    ep = master.start()
    started = {"master + local segment (pre-faulted)": time.monotonic() - t0}
    stores: dict[str, MooncakeHiddenStore] = {}
    try:
        if "remote" in cases:
            t0 = time.monotonic()
            other = master.add_segment_server(max(64 << 20, 4 * nbytes + (16 << 20)))
            started["second segment server (pre-faulted)"] = time.monotonic() - t0
            stores["remote.w"] = MooncakeHiddenStore("bench/remote", ep)
            stores["remote.r"] = MooncakeHiddenStore("bench/remote", ep.on_server(other))
        if "cold" in cases:
            t0 = time.monotonic()
            cold = master.add_segment_server((args.reps + 2) * nbytes + (32 << 20), prefault=False)
            started["cold segment server (not pre-faulted)"] = time.monotonic() - t0
            stores["cold"] = MooncakeHiddenStore("bench/cold", ep.on_server(cold))
        if {"local", "local.inplace", "local.batch", "local.inplace.batch"} & set(cases):
            stores["local"] = MooncakeHiddenStore("bench/local", ep)
        if "tcp" in cases:
            stores["tcp"] = MooncakeHiddenStore("bench/tcp", ep, segment_server="")
        raw = MooncakeHiddenStore("bench/raw", ep) if "raw" in cases else None
        if raw is not None:
            stores["raw"] = raw
            src_arena, dst_arena = raw._alloc_arena(nbytes), raw._alloc_arena(nbytes)
            src_arena.view[:] = np.concatenate([(t.view(torch.int16) if t.dtype == torch.bfloat16 else t)
                                                .numpy().reshape(-1).view(np.uint8) for t in sample.values()])
        warm_dst = {k: torch.empty_like(v) for k, v in sample.items()}
        bad: list[str] = []

        def round_trip(writer, reader, key, value) -> tuple[float, float]:
            """writer.put(key, value), then reader.get(key), checked bit-exact against the sample after the clock
            stops -> (put seconds, get seconds)."""
            t0 = time.perf_counter()
            writer.put(key, value)
            t1 = time.perf_counter()
            got = reader.get(key)
            t2 = time.perf_counter()
            if not bit_equal(got, sample):
                bad.append(f"{writer.prefix}/{key}")
            return t1 - t0, t2 - t1

        def forget(store, key):  # frees the object's segment memory for the next repetition
            store._store.remove(store._key(key), True)
            store._mine.pop(key, None)

        def put_get(writer, reader, key_of, remove=True):
            def case(rep):
                key = key_of(rep)
                put_s, get_s = round_trip(writer, reader, key, sample)
                if remove:
                    forget(writer, key)
                return {"put_s": put_s, "get_s": get_s, "s": put_s + get_s}
            return case

        def batch_case(rep, in_place=False):
            s = stores["local"]
            t_start = time.perf_counter()
            items = [(f"r{rep}/{sid}", t) for sid, t in batch]
            if in_place:
                filled = []
                for k, t in items:
                    buf = s.alloc_sample(args.tokens, args.aux_layers * args.hidden, args.hidden)
                    for name, v in t.items():
                        tensor_bytes_view(buf[name])[:] = tensor_bytes_view(v)
                    filled.append((k, buf))
                items_put = filled
            else:
                items_put = items
            t_fill = time.perf_counter()
            t0 = t_fill
            s.put_many(items_put)
            t1 = time.perf_counter()
            got = s.get_many([k for k, _ in items])
            t2 = time.perf_counter()
            if not all(bit_equal(g, t) for g, (_, t) in zip(got, items)):
                bad.append(f"batch r{rep}")
            del got
            for k, _ in items:
                forget(s, k)
            n = len(items)
            del items_put
            out = {"put_s": (t1 - t0) / n, "get_s": (t2 - t1) / n, "s": (t2 - t0) / n}
            if in_place:
                out["fill_s"] = (t_fill - t_start) / n
            return out

        def inplace_case(rep):
            s, key = stores["local"], f"i{rep}"
            t0 = time.perf_counter()
            buf = s.alloc_sample(args.tokens, args.aux_layers * args.hidden, args.hidden)
            for k, v in sample.items():
                tensor_bytes_view(buf[k])[:] = tensor_bytes_view(v)
            t1 = time.perf_counter()
            put_s, get_s = round_trip(s, s, key, buf)
            del buf
            forget(s, key)
            return {"fill_s": t1 - t0, "put_s": put_s, "get_s": get_s, "s": put_s + get_s}

        def memcpy(rep):
            t0 = time.perf_counter()
            out = [t.clone() for t in sample.values()]
            dt = time.perf_counter() - t0
            del out
            return {"s": dt}

        def memcpy_warm(rep):
            t0 = time.perf_counter()
            for k, t in sample.items():
                warm_dst[k].copy_(t)
            return {"s": time.perf_counter() - t0}

        def raw_case(rep):
            key = f"bench/raw/r{rep}"
            t0 = time.perf_counter()
            rp = raw._store.batch_put_from([key], [src_arena.addr], [nbytes], raw._cfg)
            t1 = time.perf_counter()
            rg = raw._store.batch_get_into([key], [dst_arena.addr], [nbytes])
            t2 = time.perf_counter()
            if rp != [0] or rg != [nbytes] or not np.array_equal(src_arena.view, dst_arena.view):
                bad.append(key)
            raw._store.remove(key, True)
            return {"put_s": t1 - t0, "get_s": t2 - t1, "s": t2 - t0}

        fns = {"memcpy": memcpy, "memcpy.warm": memcpy_warm,
               "local": put_get(stores.get("local"), stores.get("local"), lambda r: f"r{r}"),
               "local.inplace": inplace_case, "local.batch": batch_case,
               "local.inplace.batch": lambda rep: batch_case(rep, in_place=True),
               "remote": put_get(stores.get("remote.w"), stores.get("remote.r"), lambda r: f"r{r}"),
               "cold": put_get(stores.get("cold"), stores.get("cold"), lambda r: f"r{r}", remove=False),
               "tcp": put_get(stores.get("tcp"), stores.get("tcp"), lambda r: f"r{r}"),
               "raw": raw_case}
        samples = harness.interleave({c: fns[c] for c in cases}, reps=args.reps, warmup=1, order="rotate",
                                     label="transfer")
        if bad:
            raise SystemExit(f"round trip not bit-exact: {bad[:5]}")

        med = {}
        for c in cases:
            for m in ("fill_s", "put_s", "get_s", "s"):
                if samples.metrics[c].get(m):
                    med[f"{c}.{m[:-2]}" if m != "s" else c] = samples.median(c, m)
            if c != "memcpy" and not c.startswith("memcpy."):  # put+get: the median of per-repetition sums
                med[c] = statistics.median(p + g for p, g in zip(samples.values(c, "put_s"),
                                                                  samples.values(c, "get_s")))
        gbps = {k: nbytes / v / 1e9 for k, v in med.items()}
        copies = [c for c in ("memcpy", "memcpy.warm") if c in gbps]
        base_name = max(copies, key=lambda c: gbps[c]) if copies else None
        base = gbps[base_name] if base_name else float("nan")
        rows = []
        for c in cases:
            names = [c] if c.startswith("memcpy") else [k for k in (f"{c}.fill", f"{c}.put", f"{c}.get", c)
                                                          if k in med]
            for k in names:
                label = k if k != c or c.startswith("memcpy") else f"{c}.put+get"
                rows.append([label, f"{med[k] * 1e3:.2f}", f"{gbps[k]:.3f}", f"{gbps[k] / base:.3f}"])
        harness.table(f"{nbytes / 1e6:.2f} MB sample ({args.tokens} tokens), {args.reps} rotating repetitions, "
                      f"medians; ratio to the faster in-process copy ({base_name})",
                      ["path", "median ms", "GB/s", f"/ {base_name}"], rows)
        harness.table("start-up", ["step", "s"], [[k, f"{v:.2f}"] for k, v in started.items()])
        goal = {}
        for c in ("local", "local.inplace", "local.batch", "local.inplace.batch"):
            if c not in gbps or not base_name:
                continue
            g = {"put_get_ratio": gbps[c] / base, "get_ratio": gbps[f"{c}.get"] / base}
            g["met"] = g["put_get_ratio"] >= GOAL_PUT_GET and g["get_ratio"] >= GOAL_GET
            goal[c] = g
            print(f"[goal] {c}: put+get {g['put_get_ratio']:.3f}x {base_name} (goal >= {GOAL_PUT_GET}), get "
                  f"{g['get_ratio']:.3f}x (goal >= {GOAL_GET}): {'MET' if g['met'] else 'NOT MET'}", flush=True)
        return {"bytes": nbytes, "tokens": args.tokens, "reps": args.reps, "batch": args.batch,
                "median_s": med, "gbps": gbps, "baseline": base_name,
                "ratio_to_baseline": {k: v / base for k, v in gbps.items()}, "goal": goal, "startup_s": started,
                "endpoint": ep.to_dict()}
    finally:
        for s in stores.values():
            try:
                s.drop()
                s.close()
            except Exception as e:  # noqa: BLE001 - report, keep tearing down
                print(f"[bench] closing {s.prefix}: {e}")
        master.stop()
