"""End to end: hidden states from actors on the inference nodes to a training worker on the training node.

The 3-node loopback topology of tests/test_topology.py (ray.cluster_utils.Cluster: the head is the training node,
two inference nodes, separate raylets, all on 127.0.0.1; actors placed by the ``training`` / ``inference`` node
resources of pipeline/launch/placement.py).  One Mooncake segment server per node: a producer puts through its own node's
server (its samples stay in that node's segment), the training worker gets through the training node's server,
which pulls each sample from the inference node's segment over the transfer engine (loopback TCP) - the crossing a
real cluster has.  Modes:

  disk      producers (one per inference node) write realistic samples into Parquet stores (DiskHiddenStore, one
            folder per producer: a shared file system in a real cluster), flushing after every batch; the training
            worker reads each batch as soon as its producer hands the ids over
  mooncake  the same producers put into Mooncake (put_many of a batch) and hand over the keys
  online    the extraction service (actors/extraction_service.py, the transformers or vLLM extractor on the
            target) extracts real hidden states for requests and hands out the keys; the worker fetches them

The training worker touches every sample (checks its loss mask against what was sent, counts tokens and supervised
positions = loss-mask ones) and keeps the time it spent fetching.  Reported per mode: samples/s, tokens/s and
supervised positions/s delivered (wall time from the first request to the last sample in the worker), the
fetch-only rate (what the transport alone sustains at the worker), and both as multiples of the trainer's
consumption: ~1,166 supervised positions/s for the CPU trainer (the measured median in training runs on a 2-core
CPU) and 175,000 supervised positions/s measured on an H200.

    python -m jobs.bench mooncake_e2e                              # 32 samples x 2048 tokens, online 8 x 256
    python -m jobs.bench mooncake_e2e --modes mooncake --samples 96 --tokens 1024
"""
from __future__ import annotations

import os
import time

NAME = "mooncake_e2e"
HELP = "hidden states inference nodes -> training worker on the 3-node loopback topology: disk vs Mooncake vs online"

MODES = ("disk", "mooncake", "online")
CPU_TRAINER_SUPERVISED_PER_S = 1166  # median supervised positions/s in training runs on a 2-core CPU (AMD EPYC)
GPU_TRAINER_SUPERVISED_PER_S = 175_000  # supervised positions/s measured on an H200


def add_arguments(ap) -> None:
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {','.join(MODES)}")
    ap.add_argument("--samples", type=int, default=32, help="samples per transport mode (default 32)")
    ap.add_argument("--tokens", type=int, default=2048, help="tokens per transport sample (default 2048)")
    ap.add_argument("--supervised", type=float, default=0.5,
                    help="fraction of a transport sample's tokens under the loss mask (default 0.5)")
    ap.add_argument("--batch", type=int, default=8, help="samples per producer call (default 8)")
    ap.add_argument("--hidden", type=int, default=576, help="hidden size of the transport samples (SmolLM2-135M)")
    ap.add_argument("--aux-layers", type=int, default=3, help="aux layers of the transport samples (default 3)")
    ap.add_argument("--online-requests", type=int, default=8, help="requests through the extraction service")
    ap.add_argument("--online-tokens", type=int, default=256, help="tokens per online request (1/4 prompt)")
    ap.add_argument("--extractor", choices=["hf", "vllm"], default="hf",
                    help="the online extraction service's extractor (default hf: the transformers forward)")
    ap.add_argument("--target", default=None, help="HF folder (default: the prepared SmolLM2-135M-Instruct)")
    ap.add_argument("--layer-ids", default="2,15,28", help="target layers the online mode extracts")


class _Producer:
    """On an inference node: puts realistic samples (two random templates, fresh ids) into its node's store."""

    def __init__(self, mode: str, node_endpoints: dict, folders: dict, tokens: int, hidden: int, aux_layers: int,
                 supervised: float, seed: int):
        import ray
        import torch

        self.node_id = ray.get_runtime_context().get_node_id()
        self.mode = mode
        g = torch.Generator().manual_seed(seed)
        self.templates = []
        for _ in range(2):
            mask = (torch.rand(tokens, generator=g) < supervised).to(torch.uint8)
            self.templates.append({
                "input_ids": torch.randint(0, 49152, (tokens,), generator=g, dtype=torch.int32), "loss_mask": mask,
                "aux_hidden": torch.randn(tokens, aux_layers * hidden, generator=g).to(torch.bfloat16),
                "last_hidden": torch.randn(tokens, hidden, generator=g).to(torch.bfloat16)})
        if mode == "mooncake":
            from pipeline.stores.mooncake import MooncakeHiddenStore

            self.store = MooncakeHiddenStore("e2e/transport", node_endpoints[self.node_id])
            self.where = self.store.segment_server
        else:
            from pipeline.stores.disk import DiskHiddenStore

            self.where = folders[self.node_id]
            self.store = DiskHiddenStore(self.where)
        self.put_s = 0.0

    def produce(self, keys: list[str]) -> list[tuple[str, str, int]]:
        """Put one batch; returns (key, where it is, supervised positions) per sample."""
        t0 = time.perf_counter()
        samples = [(k, self.templates[i % 2]) for i, k in enumerate(keys)]
        if self.mode == "mooncake":
            self.store.put_many(samples)
        else:
            for k, t in samples:
                self.store.put(k, t)
        self.store.flush()
        self.put_s += time.perf_counter() - t0
        return [(k, self.where, int(t["loss_mask"].sum())) for k, t in samples]

    def info(self) -> dict:
        return {"node_id": self.node_id, "where": self.where, "put_s": self.put_s}

    def close(self) -> None:
        if self.mode == "mooncake":
            self.store.drop()
        self.store.close()


class _Trainer:
    """On the training node: fetches every handed-over sample, checks it, counts what it got."""

    def __init__(self, endpoint: dict | None):
        import ray

        self.node_id = ray.get_runtime_context().get_node_id()
        self.endpoint = endpoint
        self.stores: dict = {}

    def _store(self, mode: str, where: str, prefix: str):
        if (mode, where, prefix) not in self.stores:
            if mode == "disk":
                from pipeline.stores.disk import DiskHiddenStore

                self.stores[mode, where, prefix] = DiskHiddenStore(where)
            else:
                from pipeline.stores.mooncake import MooncakeHiddenStore

                self.stores[mode, where, prefix] = MooncakeHiddenStore(prefix, self.endpoint)
        return self.stores[mode, where, prefix]

    def consume(self, mode: str, prefix: str, boxed_refs: list) -> dict:
        """``boxed_refs``: [ObjectRef of a batch's items] in hand-over order; an item is (key, where, supervised)
        or a bare key (online mode)."""
        import ray

        fetch_s, n, tokens, supervised, bad = 0.0, 0, 0, 0, []
        for ref in boxed_refs:
            items = [(it, "", -1) if isinstance(it, str) else tuple(it) for it in ray.get(ref)]
            t0 = time.perf_counter()
            if mode == "disk":
                got = [self._store(mode, where, prefix).get(k) for k, where, _ in items]
            else:
                got = self._store(mode, "", prefix).get_many([k for k, _, _ in items])
            fetch_s += time.perf_counter() - t0
            for (k, _, sup), t in zip(items, got):
                s = int(t["loss_mask"].sum())
                if sup >= 0 and s != sup:
                    bad.append(k)
                n, tokens, supervised = n + 1, tokens + int(t["input_ids"].shape[0]), supervised + s
            del got
        return {"node_id": self.node_id, "samples": n, "tokens": tokens, "supervised": supervised,
                "fetch_s": fetch_s, "bad": bad, "t_done": time.time()}

    def close(self) -> None:
        for s in self.stores.values():
            s.close()


def _rates(name: str, wall: float, r: dict) -> dict:
    out = dict(r, mode=name, wall_s=wall)
    for what, secs in (("delivered", wall), ("fetch", r["fetch_s"])):
        out[f"{what}_samples_per_s"] = r["samples"] / secs
        out[f"{what}_tokens_per_s"] = r["tokens"] / secs
        out[f"{what}_supervised_per_s"] = r["supervised"] / secs
    return out


def run(args, harness) -> dict:
    import shutil

    import ray
    from ray.cluster_utils import Cluster

    from actors.mooncake_master import MooncakeMaster, loopback_preload_env
    from pipeline.launch.placement import INFERENCE, TRAINING
    from pipeline.core.runtime import LOOPBACK, apply_env, work_dir

    modes = [m for m in args.modes.split(",") if m]
    if set(modes) - set(MODES) or not modes:
        raise SystemExit(f"--modes: choose from {','.join(MODES)}, got {args.modes!r}")
    if min(args.samples, args.batch, args.tokens, args.online_requests, args.online_tokens) < 1:
        raise SystemExit("--samples, --batch, --tokens, --online-requests and --online-tokens must be >= 1")
    apply_env()
    os.environ.setdefault("GLOG_minloglevel", "1")  # Mooncake's per-call INFO lines would drown the tables
    sample_bytes = args.tokens * (5 + 2 * (args.aux_layers + 1) * args.hidden)
    per_node = (args.samples + 1) // 2 * sample_bytes + (64 << 20) if "mooncake" in modes else 64 << 20
    results: dict = {"modes": {}, "sample_bytes": sample_bytes}
    t0 = time.monotonic()
    node = dict(node_ip_address=LOOPBACK, object_store_memory=256 * 2**20)
    cluster = Cluster(initialize_head=True, shutdown_at_exit=True,
                      head_node_args=dict(node, num_cpus=2, resources={TRAINING: 1}, include_dashboard=False))
    master = MooncakeMaster(segment_bytes="64M")  # the training node's segment server
    scratch = work_dir() / "tmp" / f"e2e-{int(time.time())}"
    try:
        for _ in range(2):
            cluster.add_node(**node, num_cpus=2, resources={INFERENCE: 1})
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=True)
        nodes = {n["NodeID"]: n["Resources"] for n in ray.nodes() if n["Alive"]}
        train_node = next(k for k, r in nodes.items() if r.get(TRAINING))
        infer_nodes = sorted(k for k, r in nodes.items() if r.get(INFERENCE))
        results["cluster_start_s"] = time.monotonic() - t0
        t0 = time.monotonic()
        ep = master.start()
        node_eps = {train_node: ep.to_dict()}
        for k in infer_nodes:
            node_eps[k] = ep.on_server(master.add_segment_server(per_node)).to_dict()
        results["mooncake_start_s"] = time.monotonic() - t0
        env = {"env_vars": {**loopback_preload_env({}), "GLOG_minloglevel": os.environ["GLOG_minloglevel"]}}
        Trainer = ray.remote(num_cpus=1, resources={TRAINING: 1}, runtime_env=env)(_Trainer)
        Producer = ray.remote(num_cpus=1, resources={INFERENCE: 1}, runtime_env=env)(_Producer)
        trainer = Trainer.remote(node_eps[train_node])
        folders = {k: str(scratch / f"node{i}") for i, k in enumerate(infer_nodes)}
        rows = []

        for mode in [m for m in modes if m != "online"]:
            producers = [Producer.remote(mode, node_eps, folders, args.tokens, args.hidden, args.aux_layers,
                                         args.supervised, seed=i) for i in range(2)]
            info = ray.get([p.info.remote() for p in producers])
            ray.get(producers[0].produce.remote([f"warm{mode}0"]))  # imports, first allocation
            ray.get(producers[1].produce.remote([f"warm{mode}1"]))
            keys = [f"{mode}/s{i}" for i in range(args.samples)]
            batches = [keys[i:i + args.batch] for i in range(0, len(keys), args.batch)]
            start = time.time()
            refs = [producers[j % 2].produce.remote(b) for j, b in enumerate(batches)]
            r = ray.get(trainer.consume.remote(mode, "e2e/transport", refs))
            wall = r["t_done"] - start
            if r["bad"]:
                raise SystemExit(f"{mode}: samples arrived altered: {r['bad'][:5]}")
            put_s = [i["put_s"] for i in ray.get([p.info.remote() for p in producers])]
            out = _rates(mode, wall, r)
            out.update(producer_nodes=[i["node_id"] for i in info], producer_put_s=put_s,
                       trainer_node=r["node_id"])
            results["modes"][mode] = out
            ray.get([p.close.remote() for p in producers])
            for p in producers:
                ray.kill(p)
            rows.append(out)

        if "online" in modes:
            rows.append(_online(args, trainer, ep, node_eps, results))

        hdr = ["mode", "samples", "tokens", "wall s", "samples/s", "tokens/s", "superv./s", "x CPU trainer",
               "x H200 trainer", "fetch tokens/s", "fetch superv./s", "fetch x H200"]
        table = []
        for o in rows:
            table.append([o["mode"], o["samples"], o["tokens"], f"{o['wall_s']:.2f}",
                          f"{o['delivered_samples_per_s']:.1f}", f"{o['delivered_tokens_per_s']:.0f}",
                          f"{o['delivered_supervised_per_s']:.0f}",
                          f"{o['delivered_supervised_per_s'] / CPU_TRAINER_SUPERVISED_PER_S:.1f}",
                          f"{o['delivered_supervised_per_s'] / GPU_TRAINER_SUPERVISED_PER_S:.3f}",
                          f"{o['fetch_tokens_per_s']:.0f}", f"{o['fetch_supervised_per_s']:.0f}",
                          f"{o['fetch_supervised_per_s'] / GPU_TRAINER_SUPERVISED_PER_S:.3f}"])
        harness.table("delivered to the training worker (3-node loopback topology); trainer consumption: CPU "
                      f"{CPU_TRAINER_SUPERVISED_PER_S} supervised positions/s, H200 {GPU_TRAINER_SUPERVISED_PER_S}",
                      hdr, table)
        results.update(cpu_trainer_supervised_per_s=CPU_TRAINER_SUPERVISED_PER_S,
                       gpu_trainer_supervised_per_s=GPU_TRAINER_SUPERVISED_PER_S,
                       node_endpoints=node_eps, train_node=train_node, inference_nodes=infer_nodes)
        ray.get(trainer.close.remote())
        return results
    finally:
        if ray.is_initialized():
            ray.shutdown()
        cluster.shutdown()
        master.stop()
        shutil.rmtree(scratch, ignore_errors=True)


def _online(args, trainer, ep, node_eps: dict, results: dict) -> dict:
    """The extraction service on the inference nodes; the training worker fetches the keys it hands out."""
    import ray
    import torch

    from actors.extraction_service import ExtractionService
    from pipeline.data.target_model import resolve_target

    target = str(resolve_target(args.target))
    layer_ids = [int(x) for x in args.layer_ids.split(",")]
    t0 = time.monotonic()
    svc = ExtractionService(target, layer_ids, ep, prefix="e2e/online", num_workers=2, max_model_len=max(
        512, args.online_tokens), kind=args.extractor, node_endpoints=node_eps)
    started = time.monotonic() - t0
    try:
        g = torch.Generator().manual_seed(0)
        L, P = args.online_tokens, max(1, args.online_tokens // 4)
        reqs = [{"request_id": f"o{i}", "input_ids": torch.randint(0, 49152, (L,), generator=g).tolist(),
                 "loss_mask": [0] * P + [1] * (L - P)} for i in range(args.online_requests)]
        ray.get(svc.submit(reqs[:2]))  # warm-up: first forward of each path
        ray.get(svc.submit(reqs[2:4]))
        start = time.time()
        refs = [svc.submit(reqs[i:i + args.batch]) for i in range(0, len(reqs), args.batch)]
        r = ray.get(trainer.consume.remote("online", "e2e/online", refs))
        out = _rates("online", r["t_done"] - start, r)
        out.update(service_start_s=started, placement=svc.placement, extractor=args.extractor,
                   request_tokens=L, prompt_tokens=P)
        if r["supervised"] != len(reqs) * (L - P):
            raise SystemExit(f"online: {r['supervised']} supervised positions arrived, sent {len(reqs) * (L - P)}")
        results["modes"]["online"] = out
        return out
    finally:
        svc.shutdown()
