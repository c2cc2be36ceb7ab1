#!/usr/bin/env python
"""Mooncake hidden-state store throughput vs an in-process memory copy of the same bytes.

One realistic sample (default 2048 tokens, 3 aux layers of 576 + the last hidden 576, bf16, plus int32 ids and
uint8 mask: ~9.4 MB) is, in each repetition and interleaved so that machine load hits all alike:

  memcpy   torch .clone() of the sample's four tensors                    (the floor: one copy in RAM)
  numpy    numpy .copy() of the same bytes
  put      MooncakeHiddenStore.put  (-> the segment server process over loopback TCP)
  get      MooncakeHiddenStore.get  (<- idem, into fresh tensors)
  raw      the bare binding: batch_put_from + batch_get_into of one registered buffer (no store layer)

for both store transfer paths (zero-copy staging buffer, and bytes put_batch/get_batch).  Prints medians in GB/s
(1 GB = 1e9 bytes) and each rate as a ratio of the faster in-process copy (put+get: bytes / (t_put + t_get), the
rate at which a sample goes writer -> store -> reader).  A master + segment server is started on
127.0.0.1 for the run unless --master-addr/--metadata-url name an existing one.

    python scripts/bench_mooncake.py                 # defaults: 2048 tokens, 7 repetitions
    python scripts/bench_mooncake.py --tokens 512 --reps 11 --json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pipeline.runtime import apply_env  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=2048, help="tokens per sample (default 2048)")
    ap.add_argument("--hidden", type=int, default=576, help="target hidden size (default 576, SmolLM2-135M)")
    ap.add_argument("--aux-layers", type=int, default=3, help="aux layers concatenated in aux_hidden (default 3)")
    ap.add_argument("--reps", type=int, default=7, help="interleaved repetitions; medians are reported (default 7)")
    ap.add_argument("--segment-bytes", default="512M", help="segment served by the master started here")
    ap.add_argument("--master-addr", help="use an existing master (host:port) instead of starting one")
    ap.add_argument("--metadata-url", help="its metadata URL (http://host:port/metadata)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads (default 1: a copy is memory-bound, and extra OpenMP threads on a "
                         "busy machine only add spin-wait)")
    ap.add_argument("--json", action="store_true", help="also print one JSON line with all medians")
    args = ap.parse_args(argv)

    apply_env()
    import numpy as np
    import torch

    torch.set_num_threads(args.threads)

    from actors.mooncake_master import MooncakeMaster
    from pipeline.stores.mooncake import MooncakeHiddenStore

    T, d, n = args.tokens, args.hidden, args.aux_layers
    g = torch.Generator().manual_seed(0)
    sample = {"input_ids": torch.randint(0, 49152, (T,), generator=g, dtype=torch.int32),
              "loss_mask": torch.randint(0, 2, (T,), generator=g, dtype=torch.int32).to(torch.uint8),
              "aux_hidden": torch.randn(T, n * d, generator=g).to(torch.bfloat16),
              "last_hidden": torch.randn(T, d, generator=g).to(torch.bfloat16)}
    nbytes = sum(t.numel() * t.element_size() for t in sample.values())
    arrays = [(t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy() for t in sample.values()]

    master = None
    if args.master_addr:
        ep = MooncakeMaster.connect(args.master_addr, args.metadata_url)
    else:
        master = MooncakeMaster(segment_bytes=args.segment_bytes)
        ep = master.start()
    try:
        stores = {"zc": MooncakeHiddenStore("bench/zc", ep, zero_copy=True),
                  "bytes": MooncakeHiddenStore("bench/bytes", ep, zero_copy=False)}
        raw = stores["zc"]._store
        src = torch.empty(nbytes, dtype=torch.uint8)
        dst = torch.empty(nbytes, dtype=torch.uint8)
        src.copy_(torch.from_numpy(np.concatenate([a.reshape(-1).view(np.uint8) for a in arrays])))
        for b in (src, dst):
            assert raw.register_buffer(b.data_ptr(), nbytes) == 0
        cfg = stores["zc"]._cfg

        def timed(fn):
            t0 = time.perf_counter()
            fn()
            return time.perf_counter() - t0

        times: dict[str, list[float]] = {}

        def rec(name, dt):
            times.setdefault(name, []).append(dt)

        for s in stores.values():  # warm-up: connections, staging buffers
            s.put("warm", sample)
            s.get("warm")
        for r in range(args.reps):
            rec("memcpy", timed(lambda: [t.clone() for t in sample.values()]))
            rec("numpy", timed(lambda: [a.copy() for a in arrays]))
            for name, s in stores.items():
                rec(f"{name}.put", timed(lambda: s.put(f"r{r}", sample)))
                out = {}
                rec(f"{name}.get", timed(lambda: out.update(s.get(f"r{r}"))))
                assert all(torch.equal(out[k].view(torch.int16) if out[k].dtype == torch.bfloat16 else out[k],
                                       v.view(torch.int16) if v.dtype == torch.bfloat16 else v)
                           for k, v in sample.items()), "round trip not bit-exact"
            key = f"bench/raw/r{r}"
            rec("raw.put", timed(lambda: raw.batch_put_from([key], [src.data_ptr()], [nbytes], cfg)))
            rec("raw.get", timed(lambda: raw.batch_get_into([key], [dst.data_ptr()], [nbytes])))
            assert torch.equal(src, dst)

        med = {k: statistics.median(v) for k, v in times.items()}
        for p in ("zc", "bytes", "raw"):
            med[f"{p}.put+get"] = med[f"{p}.put"] + med[f"{p}.get"]
        gbps = {k: nbytes / v / 1e9 for k, v in med.items()}
        base_name = max(("memcpy", "numpy"), key=lambda k: gbps[k])  # the faster in-process copy is the floor
        base = gbps[base_name]
        print(f"sample: {T} tokens x ({n}*{d} + {d}) bf16 + ids + mask = {nbytes / 1e6:.2f} MB; "
              f"{args.reps} interleaved reps, medians; torch threads {torch.get_num_threads()}; master {ep.master_addr}")
        print(f"{'path':<16}{'median ms':>10}{'GB/s':>9}{'/ ' + base_name:>10}")
        rows = ["memcpy", "numpy", "zc.put", "zc.get", "zc.put+get", "bytes.put", "bytes.get", "bytes.put+get",
                "raw.put", "raw.get", "raw.put+get"]
        for k in rows:
            print(f"{k:<16}{med[k] * 1e3:>10.2f}{gbps[k]:>9.3f}{gbps[k] / base:>10.3f}")
        print(f"in-process copy ({base_name}) is {base / gbps['zc.put']:.0f}x faster than a Mooncake put, "
              f"{base / gbps['zc.get']:.0f}x faster than a get, {base / gbps['zc.put+get']:.0f}x faster than put+get "
              "(zero-copy path)")
        if args.json:
            print(json.dumps({"bytes": nbytes, "reps": args.reps, "gbps": {k: round(gbps[k], 4) for k in rows},
                              "baseline": base_name, "ratio_to_baseline": {k: round(gbps[k] / base, 4) for k in rows}}))
        for s in stores.values():
            s.drop()
            s.close()
    finally:
        if master is not None:
            master.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
