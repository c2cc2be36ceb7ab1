"""Online mode: a vLLM extraction service writes into a real Mooncake store; two consumers in separate processes
fetch by key and get bit-identical tensors (also identical to the same sample put through the disk backend)."""
import hashlib
import json
import subprocess
import sys
import textwrap

import pytest
import torch

from actors.extraction_service import ExtractionService
from actors.mooncake_master import MooncakeMaster, loopback_preload_env
from pipeline.stores.disk import DiskHiddenStore
from pipeline.stores.mooncake import MooncakeHiddenStore

pytestmark = pytest.mark.slow

CONSUMER = textwrap.dedent("""
    import hashlib, json, sys
    from pipeline.core.runtime import apply_env; apply_env()
    from pipeline.stores.mooncake import MooncakeHiddenStore
    ep, prefix, keys = json.loads(sys.argv[1]), sys.argv[2], json.loads(sys.argv[3])
    store = MooncakeHiddenStore(prefix, ep)
    out = {}
    for k in keys:
        s = store.get(k)
        h = hashlib.sha256()
        for name in sorted(s):
            t = s[name]
            h.update(name.encode()); h.update(str(tuple(t.shape)).encode()); h.update(str(t.dtype).encode())
            h.update((t.view(__import__("torch").int16) if t.dtype == __import__("torch").bfloat16 else t).numpy().tobytes())
        out[k] = h.hexdigest()
    store.close()
    print("RESULT" + json.dumps(out))
""")


def _digest(s):
    h = hashlib.sha256()
    for name in sorted(s):
        t = s[name]
        h.update(name.encode()); h.update(str(tuple(t.shape)).encode()); h.update(str(t.dtype).encode())
        h.update((t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy().tobytes())
    return h.hexdigest()


def test_online_extraction_two_consumers(ray_session, target_dir, tmp_path):
    from transformers import AutoTokenizer

    from pipeline.data.prompts import chat_prompt_ids

    tok = AutoTokenizer.from_pretrained(target_dir)
    reqs = []
    for i, (q, a) in enumerate([("What is 2+2?", "2+2 is 4."), ("Say hi.", "Hi there! How are you?"),
                                ("Name a fruit.", "An apple.")]):
        p = chat_prompt_ids(tok, q)
        r = tok(a, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        reqs.append({"request_id": f"s{i}", "input_ids": p + r, "loss_mask": [0] * len(p) + [1] * len(r)})
    with MooncakeMaster(segment_bytes="256M") as master:
        svc = ExtractionService(target_dir, [2, 15, 28], master.endpoint, prefix="online/t", num_workers=1,
                                max_model_len=256)
        try:
            keys = svc.extract(reqs, batch_size=2)
        finally:
            svc.shutdown()
        assert keys == ["s0", "s1", "s2"]
        env = dict(__import__("os").environ, **loopback_preload_env())
        procs = [subprocess.Popen([sys.executable, "-c", CONSUMER, json.dumps(master.endpoint.to_dict()), "online/t",
                                   json.dumps(keys)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                  env=env) for _ in range(2)]
        results = []
        for p in procs:
            out, err = p.communicate(timeout=180)
            assert p.returncode == 0, err[-2000:]
            results.append(json.loads(out.split("RESULT", 1)[1]))
        assert results[0] == results[1] and set(results[0]) == set(keys)
        # the same samples through the disk backend read back bit-identical
        store = MooncakeHiddenStore("online/t", master.endpoint)
        disk = DiskHiddenStore(tmp_path / "disk")
        for k in keys:
            s = store.get(k)
            assert s["input_ids"].tolist() == next(r["input_ids"] for r in reqs if r["request_id"] == k)
            assert s["aux_hidden"].shape == (len(s["input_ids"]), 3 * 576)
            disk.put(k, s)
        disk.commit({})
        for k in keys:
            assert _digest(DiskHiddenStore(tmp_path / "disk").get(k)) == results[0][k]
        store.close()
