"""Ray Serve application on a real local Ray cluster and real HTTP on 127.0.0.1: two engine replicas (real SmolLM2
target + a random-weight 1-layer DSpark drafter with a reduced vocabulary), the load-aware router and the
OpenAI-compatible ingress.

Checks: completions + chat, non-streaming and SSE streaming; the unchanged `openai` client; concurrent greedy requests
equal the target's own greedy output (same dtype, no drafter); >= 20 malformed requests get OpenAI-style 4xx errors
and the server keeps answering; with one replica busy the router keeps sending new requests to the idle one (not
round-robin); a client disconnect aborts the engine request; /metrics; the vLLM (GPU) config builder; jobs.serve
--help.  Plus unit checks of the cluster-load-aware scheduler and the router's ranking."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent

GAMMA = 3
PROMPTS = ["What is 3 + 4?", "Name a colour.", "Say hello.", "Write a haiku about the sea.",
           "What is the capital of Italy?", "Count to five."]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------------------------------------ unit (no Ray)
def test_cluster_load_makes_verification_shallower():
    """Algorithm 1 on hardware shared with other replicas' work (B_0, τ_0): a heavier cluster admits fewer draft
    tokens; the token budget caps B."""
    from pipeline.engine.cost_table import CostTable
    from pipeline.engine.scheduler import greedy_prefix_search, survival
    from pipeline.engine.scheduler import make_load_aware_scheduler

    # the measured fp32 curve of docs/environment.md (seconds for B tokens)
    table = CostTable({1: 0.0426, 2: 0.0508, 4: 0.0805, 8: 0.0921, 16: 0.0995, 32: 0.1327, 64: 0.1894})
    for c in (0.9, 0.7):
        conf = torch.logit(torch.tensor([[c, c - 0.05, c - 0.1, c - 0.2, c - 0.3, c - 0.4, c - 0.5]] * 4,
                                        dtype=torch.float64))
        a = survival(torch.sigmoid(conf), [7] * 4)
        sched = make_load_aware_scheduler("hardware", table)
        light = sum(sched.schedule(conf, [7] * 4))
        sched.set_load(64, 48.0)  # other replicas: 64 target tokens / 48 emitted tokens per round
        heavy = sum(sched.schedule(conf, [7] * 4))
        assert heavy < light, (c, light, heavy)
        # the naive variant -- shift SPS by B_0 but ignore the others' tokens -- goes the WRONG way on this curve
        assert sum(greedy_prefix_search(a, table, base_tokens=64)[0]) >= light
    capped = make_load_aware_scheduler("hardware", table, budget=6)
    assert sum(capped.schedule(conf, [7] * 4)) + 4 <= 6
    asy = make_load_aware_scheduler("async", table)
    for _ in range(3):
        d = asy.schedule(conf, [7] * 4)
    assert asy.last_capacity is not None and sum(d) + 4 <= asy.last_capacity


def test_router_ranks_by_expected_work():
    from serve_app.router import LoadAwareRouter

    now = time.time()

    from collections import namedtuple

    RID = namedtuple("RID", "unique_id")

    def rep(uid, stats):
        return SimpleNamespace(replica_id=RID(uid), routing_stats=stats, max_ongoing_requests=8)

    r = LoadAwareRouter.__new__(LoadAwareRouter)  # no Serve internals: scoring only
    r._use_replica_queue_len_cache = False
    r.initialize_state()
    busy = rep("busy", {"ts": now, "active": 3, "queued": 0, "step_s": 0.05, "max_batch": 4, "tokens_last_round": 9})
    idle = rep("idle", {"ts": now, "active": 0, "queued": 0, "step_s": 0.05, "max_batch": 4, "tokens_last_round": 0})
    slow = rep("slow", {"ts": now, "active": 1, "queued": 0, "step_s": 0.5, "max_batch": 4, "tokens_last_round": 2})
    stale = rep("stale", {"ts": now - 60, "active": 0, "queued": 0, "step_s": 0.05, "max_batch": 4})
    assert [x["id"] for x in r.score([busy, slow, idle])] == ["idle", "busy", "slow"]
    assert r.score([busy])[0]["load"] == 3  # 3 requests of other routers
    for _ in range(5):  # this router's own in-flight requests count at once, before any stats report them
        r.on_send_request(idle.replica_id)
    assert [x["id"] for x in r.score([busy, idle])][0] == "busy"
    assert r.score([stale])[0]["load"] == 0
    # stats taken while 3 of OUR requests ran on "busy" do not resurrect them once they completed
    for _ in range(3):
        r.on_send_request(busy.replica_id)
    busy.routing_stats = dict(busy.routing_stats, ts=time.time() + 1e-3)
    time.sleep(0.01)
    for _ in range(3):
        r.on_request_completed(busy.replica_id, "x")
    assert r.score([busy])[0]["load"] == 0


# ------------------------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def serve_drafter(target_dir, tmp_path_factory):
    from toy_drafter import export_random_drafter

    return export_random_drafter(target_dir, tmp_path_factory.mktemp("drafter") / "drafter")


@pytest.fixture(scope="module")
def server(ray_session, target_dir, serve_drafter):
    import requests
    from ray import serve

    from serve_app.app import ServeConfig, build_app

    port = _free_port()
    cfg = ServeConfig(drafter=str(serve_drafter), target=str(target_dir), replicas=2, port=port,
                      scheduler="hardware", num_speculative_tokens=GAMMA, max_batch=4, threads=1, routing_stats_period_s=0.5,
                      profile_batch_sizes=[1, 2, 4, 8, 16], default_max_tokens=32)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_app(cfg), name="dspark-test", route_prefix="/", blocking=False)
    base = f"http://127.0.0.1:{port}"
    assert requests.get(base + "/health", timeout=30).json()["status"] == "ok"
    try:
        yield SimpleNamespace(base=base, url=base + "/v1", model=cfg.served_model_name(str(target_dir)))
    finally:
        serve.shutdown()


@pytest.fixture(scope="module")
def reference(target_dir):
    """The target's own greedy continuation (no drafter, same dtype and EOS set as the replicas)."""
    from transformers import AutoTokenizer

    from pipeline.engine.engine import SpeculativeEngine
    from pipeline.data.prompts import chat_prompt_ids, end_of_turn_ids
    from pipeline.ops.sampling import SamplingParams
    from pipeline.engine.target_runner import TargetRunner, auto_precision

    tok = AutoTokenizer.from_pretrained(str(target_dir))
    # the replicas' --dtype auto: bfloat16:invariant where its kernels run (whose linears may round their inputs to
    # bf16: the native dot products), else float32
    runner = TargetRunner.from_pretrained(str(target_dir), dtype=auto_precision("cpu"))
    eos = set(runner.config.eos_token_ids) | set(end_of_turn_ids(tok))
    eng = SpeculativeEngine(runner, None, None, tokenizer=tok, eos_token_ids=eos)

    def greedy(prompt_ids, max_tokens):
        return eng.generate([prompt_ids], SamplingParams(temperature=0.0), max_tokens=max_tokens)[0].output_ids

    return SimpleNamespace(tok=tok, greedy=greedy, chat_ids=lambda text: chat_prompt_ids(tok, text))


def _sse_events(resp):
    out = []
    for line in resp.iter_lines():
        if not line:
            continue
        line = line.decode()
        assert line.startswith("data: "), line
        out.append(line[6:])
    assert out[-1] == "[DONE]"
    return [json.loads(x) for x in out[:-1]]


# ------------------------------------------------------------------------------------------------ HTTP
def test_models_health(server):
    import requests

    m = requests.get(server.url + "/models").json()
    assert m["object"] == "list" and m["data"][0]["id"] == server.model
    h = requests.get(server.base + "/health")
    assert h.status_code == 200 and h.json()["status"] == "ok"
    assert h.json()["ready_replicas"] == h.json()["wanted_replicas"] == 2  # serve.run waited for both
    assert requests.get(server.base + "/livez").json()["status"] == "alive"


def test_completions_plain_and_streaming(server, reference):
    import requests

    body = {"model": server.model, "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0,
            "return_token_ids": True}
    r = requests.post(server.url + "/completions", json=body)
    assert r.status_code == 200, r.text
    d = r.json()
    ch = d["choices"][0]
    assert d["object"] == "text_completion" and ch["finish_reason"] in ("stop", "length")
    assert d["usage"]["completion_tokens"] == len(ch["token_ids"]) and d["usage"]["prompt_tokens"] > 0
    assert ch["token_ids"] == reference.greedy(ch["prompt_token_ids"], 8)
    ds = d["dspark"]
    assert ds["replica"] and ds["rounds"] >= 1 and ds["scheduler"] == "hardware"
    assert 0 <= ds["mean_verified_depth"] <= GAMMA and ds["acceptance_length"] >= 1.0
    assert r.headers["x-dspark-replica"] == ds["replica"]

    rs = requests.post(server.url + "/completions", stream=True,
                       json=dict(body, stream=True, stream_options={"include_usage": True}))
    assert rs.status_code == 200 and rs.headers["content-type"].startswith("text/event-stream")
    evs = _sse_events(rs)
    assert evs[0]["dspark"]["replica"]
    text = "".join(e["choices"][0]["text"] for e in evs if e["choices"])
    assert text == ch["text"]
    assert [t for e in evs if e["choices"] for t in e["choices"][0]["token_ids"]] == ch["token_ids"]
    fin = [e for e in evs if e["choices"] and e["choices"][0]["finish_reason"]]
    assert len(fin) == 1 and fin[0]["dspark"]["rounds"] >= 1
    assert evs[-1]["choices"] == [] and evs[-1]["usage"]["completion_tokens"] == len(ch["token_ids"])


def test_chat_with_openai_client(server, reference):
    import openai

    client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=120)
    msgs = [{"role": "user", "content": "Say hello."}]
    r = client.chat.completions.create(model=server.model, messages=msgs, max_tokens=10, temperature=0,
                                       extra_body={"return_token_ids": True})
    assert r.choices[0].message.role == "assistant" and r.usage.completion_tokens >= 1
    ids = r.choices[0].model_extra["token_ids"]
    assert ids == reference.greedy(reference.chat_ids("Say hello."), 10)
    assert r.model_extra["dspark"]["replica"]
    parts = []
    stream = client.chat.completions.create(model=server.model, messages=msgs, max_tokens=10, temperature=0,
                                            stream=True)
    finish = None
    for c in stream:
        if c.choices:
            parts.append(c.choices[0].delta.content or "")
            finish = c.choices[0].finish_reason or finish
    assert "".join(parts) == r.choices[0].message.content and finish in ("stop", "length")
    # multi-message conversation through apply_chat_template; legacy completions through the client
    conv = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello."}, {"role": "user", "content": [{"type": "text", "text": "Bye"}]}]
    r2 = client.chat.completions.create(model=server.model, messages=conv, max_tokens=6, temperature=0)
    assert r2.usage.prompt_tokens > r.usage.prompt_tokens
    c = client.completions.create(model=server.model, prompt="1, 2, 3,", max_tokens=5, temperature=0)
    assert c.choices[0].text and c.usage.completion_tokens <= 5


def test_logprobs_are_the_targets(server, target_dir):
    """chat logprobs / top_logprobs and completions logprobs: the target's log-probabilities of the emitted tokens
    (the replicas' precision, one full forward over prompt + output), streaming or not, with speculation on."""
    import requests
    import torch

    from pipeline.engine.target_runner import TargetRunner, auto_precision

    runner = TargetRunner.from_pretrained(str(target_dir), dtype=auto_precision("cpu"))

    def reference(prompt_ids, out_ids):
        slot = runner.alloc()
        try:
            o = runner.forward([slot], [list(prompt_ids) + list(out_ids[:-1])], logits_last=[len(out_ids)])
            return torch.log_softmax(o.logits.float(), dim=-1)
        finally:
            runner.free(slot)

    msgs = [{"role": "user", "content": "Count from one to ten in words."}]
    for temperature in (0, 0.8):
        body = {"model": server.model, "messages": msgs, "max_tokens": 12, "temperature": temperature, "seed": 3,
                "logprobs": True, "top_logprobs": 3, "return_token_ids": True, "ignore_eos": True}
        d = requests.post(server.url + "/chat/completions", json=body).json()
        ch = d["choices"][0]
        content, ids = ch["logprobs"]["content"], ch["token_ids"]
        assert len(content) == len(ids) == d["usage"]["completion_tokens"] == 12
        ref = reference(ch["prompt_token_ids"], ids)
        for k, (entry, t) in enumerate(zip(content, ids)):
            assert abs(entry["logprob"] - float(ref[k, t])) < 1e-4, (temperature, k, entry, float(ref[k, t]))
            assert entry["bytes"] == list(entry["token"].encode())
            tops = entry["top_logprobs"]
            assert len(tops) == 3 and [x["logprob"] for x in tops] == sorted((x["logprob"] for x in tops),
                                                                             reverse=True)
            assert abs(tops[0]["logprob"] - float(ref[k].max())) < 1e-4
        if temperature == 0:
            assert [x["top_logprobs"][0]["token"] for x in content] == [x["token"] for x in content]
            streamed = _sse_events(requests.post(server.url + "/chat/completions", stream=True,
                                                 json=dict(body, stream=True)))
            got = [x for e in streamed if e["choices"] and e["choices"][0].get("logprobs")
                   for x in e["choices"][0]["logprobs"]["content"]]
            assert [x["logprob"] for x in got] == [x["logprob"] for x in content]
    # legacy completions: tokens, token_logprobs, top_logprobs ({token: logprob}), text_offset
    body = {"model": server.model, "prompt": "The capital of France is", "max_tokens": 6, "temperature": 0,
            "logprobs": 2, "return_token_ids": True, "ignore_eos": True}
    ch = requests.post(server.url + "/completions", json=body).json()["choices"][0]
    lp, ids = ch["logprobs"], ch["token_ids"]
    ref = reference(ch["prompt_token_ids"], ids)
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(ids) == 6
    assert all(abs(v - float(ref[k, t])) < 1e-4 for k, (v, t) in enumerate(zip(lp["token_logprobs"], ids)))
    assert all(len(x) <= 2 for x in lp["top_logprobs"]) and lp["text_offset"][0] == 0
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:k]) for k in range(6)]
    streamed = [e["choices"][0]["logprobs"] for e in _sse_events(requests.post(
        server.url + "/completions", stream=True, json=dict(body, stream=True)))
        if e["choices"] and e["choices"][0].get("logprobs")]
    assert sum((x["token_logprobs"] for x in streamed), []) == lp["token_logprobs"]
    assert sum((x["text_offset"] for x in streamed), []) == lp["text_offset"]  # offsets run on across chunks
    assert requests.post(server.url + "/completions", json=dict(body, logprobs=None)).json()["choices"][0][
        "logprobs"] is None


def test_an_8000_token_prompt_is_served(server, reference):
    """The target's whole context: a prompt of 8,000 tokens is prefilled (in chunks) and answered (chunked prefill
    gives the unchunked greedy output: tests/test_paged_engine.py)."""
    import requests

    words = "The quick brown fox jumps over the lazy dog. " * 900
    ids = reference.tok.encode(words)[:8000]
    r = requests.post(server.url + "/completions", json={"model": server.model, "prompt": ids, "max_tokens": 4,
                                                         "temperature": 0, "return_token_ids": True}, timeout=600)
    assert r.status_code == 200, r.text[:300]
    d = r.json()
    assert d["usage"]["prompt_tokens"] == 8000 and 1 <= d["usage"]["completion_tokens"] <= 4


def test_n_choices_are_independent_and_reproducible(server):
    import requests

    body = {"model": server.model, "prompt": "Once upon a time", "max_tokens": 8, "temperature": 1.0, "seed": 11,
            "n": 3, "ignore_eos": True, "return_token_ids": True}
    a = requests.post(server.url + "/completions", json=body).json()
    b = requests.post(server.url + "/completions", json=body).json()
    assert [c["index"] for c in a["choices"]] == [0, 1, 2]
    ids = [c["token_ids"] for c in a["choices"]]
    assert ids == [c["token_ids"] for c in b["choices"]]  # the same seed, the same choices
    assert len({tuple(x) for x in ids}) > 1  # independent samples (seed + i per choice)
    assert a["usage"]["completion_tokens"] == 24 and a["usage"]["prompt_tokens"] == len(a["choices"][0][
        "prompt_token_ids"])
    one = requests.post(server.url + "/completions", json=dict(body, n=1, seed=12)).json()
    assert one["choices"][0]["token_ids"] == ids[1]  # choice 1 samples with seed + 1
    # streamed chat: every choice streams under its index, finishes once, usage sums the choices
    chat = {"model": server.model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5, "n": 2,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
    evs = _sse_events(requests.post(server.url + "/chat/completions", json=chat, stream=True))
    text = {0: "", 1: ""}
    fin = {0: 0, 1: 0}
    for e in evs:
        for c in e["choices"]:
            text[c["index"]] += c["delta"].get("content") or ""
            fin[c["index"]] += c["finish_reason"] is not None
    assert fin == {0: 1, 1: 1} and text[0] == text[1] and text[0]  # greedy: both choices alike
    assert evs[-1]["usage"]["completion_tokens"] == 10


def test_concurrent_greedy_equals_target(server, reference):
    import openai

    def one(i):
        client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=180)
        p = PROMPTS[i]
        if i % 2:
            r = client.completions.create(model=server.model, prompt=p, max_tokens=12, temperature=0,
                                          extra_body={"return_token_ids": True})
        else:
            r = client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": p}],
                                               max_tokens=12, temperature=0, extra_body={"return_token_ids": True})
        ch = r.choices[0].model_extra
        return i, ch["prompt_token_ids"], ch["token_ids"], r.model_extra["dspark"]["replica"]

    with ThreadPoolExecutor(len(PROMPTS)) as ex:
        results = list(ex.map(one, range(len(PROMPTS))))
    for i, prompt_ids, out_ids, _ in results:
        if i % 2 == 0:
            assert prompt_ids == reference.chat_ids(PROMPTS[i])
        assert out_ids == reference.greedy(prompt_ids, 12), f"prompt {i} differs from the target's greedy output"
    assert len({rep for *_, rep in results}) == 2, "both replicas should have served some of the requests"


BAD = [
    # (path, raw body or json-able, expected status)
    ("/completions", b"{not json", 400),
    ("/completions", b"", 400),
    ("/completions", b"[1, 2]", 400),
    ("/completions", {"prompt": "hi"}, 400),  # missing model
    ("/completions", {"model": "no-such-model", "prompt": "hi"}, 404),
    ("/completions", {"model": 123, "prompt": "hi"}, 400),
    ("/completions", {"model": "M"}, 400),  # missing prompt
    ("/completions", {"model": "M", "prompt": ""}, 400),
    ("/completions", {"model": "M", "prompt": []}, 400),
    ("/completions", {"model": "M", "prompt": [10 ** 9]}, 400),
    ("/completions", {"model": "M", "prompt": {"a": 1}}, 400),
    ("/completions", {"model": "M", "prompt": "hi", "max_tokens": -5}, 400),
    ("/completions", {"model": "M", "prompt": "hi", "max_tokens": 0}, 400),
    ("/completions", {"model": "M", "prompt": "hi", "max_tokens": 10 ** 9}, 400),
    ("/completions", {"model": "M", "prompt": "hi", "max_tokens": "ten"}, 400),
    ("/completions", {"model": "M", "prompt": "hi", "max_tokens": 3.5}, 400),
    ("/completions", {"model": "M", "prompt": "hi", "max_tokens": True}, 400),
    ("/completions", {"model": "M", "prompt": "hi", "temperature": 3.0}, 400),
    ("/completions", {"model": "M", "prompt": "hi", "temperature": -0.1}, 400),
    ("/completions", {"model": "M", "prompt": "hi", "temperature": "hot"}, 400),
    ("/completions", b'{"model": "M", "prompt": "hi", "temperature": NaN}', 400),
    ("/completions", {"model": "M", "prompt": "hi", "top_p": 0}, 400),
    ("/completions", {"model": "M", "prompt": "hi", "top_p": 1.5}, 400),
    ("/completions", {"model": "M", "prompt": "hi", "top_k": "x"}, 400),
    ("/completions", {"model": "M", "prompt": "hi", "stream": "yes"}, 400),
    ("/completions", {"model": "M", "prompt": "hi", "n": 17}, 400),
    ("/completions", {"model": "M", "prompt": "hi", "n": 0}, 400),
    ("/completions", {"model": "M", "prompt": "hi", "stop": 5}, 400),
    ("/completions", {"model": "M", "prompt": "hi", "logprobs": 21}, 400),
    ("/completions", {"model": "M", "prompt": "hi", "logprobs": True}, 400),
    ("/completions", {"model": "M", "prompt": "hi", "stream_options": {"include_usage": True}}, 400),
    ("/completions", {"model": "M", "prompt": "word " * 9000, "max_tokens": 4}, 400),  # over the 8,192 context
    ("/chat/completions", {"model": "M"}, 400),  # missing messages
    ("/chat/completions", {"model": "M", "messages": []}, 400),
    ("/chat/completions", {"model": "M", "messages": "hi"}, 400),
    ("/chat/completions", {"model": "M", "messages": [{"content": "hi"}]}, 400),
    ("/chat/completions", {"model": "M", "messages": [{"role": "wizard", "content": "hi"}]}, 400),
    ("/chat/completions", {"model": "M", "messages": [{"role": "user", "content": 42}]}, 400),
    ("/chat/completions", {"model": "M", "messages": ["hi"]}, 400),
    ("/chat/completions", {"model": "M", "messages": [{"role": "user", "content": "hi"}], "max_tokens": -1}, 400),
    ("/chat/completions", {"model": "M", "messages": [{"role": "user", "content": "hi"}],
                           "max_completion_tokens": 10 ** 7}, 400),
]


def _post_raw(server, path: str, body):
    """POST a test body as is ("M" stands for the served model's name) -> (the bytes sent, the response)."""
    import requests

    if isinstance(body, dict):
        body = json.dumps({k: (server.model if v == "M" and k == "model" else v) for k, v in body.items()})
    else:
        body = body.replace(b'"M"', json.dumps(server.model).encode())
    return body, requests.post(server.url + path, data=body, headers={"Content-Type": "application/json"})


def test_bad_inputs_get_openai_errors(server):
    import requests

    for path, body, status in BAD:
        body, r = _post_raw(server, path, body)
        assert r.status_code == status, (path, body[:200], r.status_code, r.text[:300])
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"], err
        assert err["type"] == "invalid_request_error"
    r = requests.get(server.url + "/completions")
    assert r.status_code == 405 and "error" in r.json()
    r = requests.post(server.url + "/nothing", json={})
    assert r.status_code == 404 and "error" in r.json()
    assert len(BAD) + 2 >= 20
    # still serving
    r = requests.post(server.url + "/completions", json={"model": server.model, "prompt": "Hi", "max_tokens": 3})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1


DEEP = 5000
NAMED = [
    # (path, raw body or json-able, status, the "param" the error names, a fragment of its message)
    ("/completions", rb'{"model": "M", "prompt": "\ud800", "max_tokens": 3}', 400, None, "surrogate"),
    ("/completions", rb'{"model": "M", "prompt": "x\udc00y", "max_tokens": 3}', 400, None, "surrogate"),
    ("/chat/completions", rb'{"model": "M", "messages": [{"role": "user", "content": "\ud83d"}]}', 400, None,
     "surrogate"),
    ("/completions", b'{"model": "M", "prompt": "\xed\xa0\x80"}', 400, None, "UTF-8"),  # surrogate encoded as UTF-8
    ("/completions", b'{"model": "M", "prompt": ' + b"[" * DEEP + b"]" * DEEP + b"}", 400, None, "nested too deeply"),
    ("/completions", b'{"model": "M", "prompt": "hi", "extra": ' + b'{"a": ' * DEEP + b"1" + b"}" * DEEP + b"}", 400,
     None, "nested too deeply"),
    ("/completions", {"model": "M", "prompt": "hi", "temperature": 3.0}, 400, "temperature", "<= 2"),
    # fields this server does not honour: a 400 naming them, never a silent 200
    ("/chat/completions", {"model": "M", "messages": [{"role": "user", "content": "hi"}], "tools": []}, 400, "tools",
     "tool calling"),
    ("/chat/completions", {"model": "M", "messages": [{"role": "user", "content": "hi"}], "tool_choice": "auto"}, 400,
     "tool_choice", "tool calling"),
    ("/chat/completions", {"model": "M", "messages": [{"role": "user", "content": "hi"}],
                           "response_format": {"type": "json_object"}}, 400, "response_format", "structured output"),
    ("/completions", {"model": "M", "prompt": "hi", "min_p": 0.1}, 400, "min_p", "min-p"),
    ("/completions", {"model": "M", "prompt": "hi", "min_tokens": 4}, 400, "min_tokens", "minimum"),
    ("/completions", {"model": "M", "prompt": "hi", "frobnicate": 1}, 400, "frobnicate", "not a field"),
    ("/completions", {"model": "M", "prompt": "hi", "max_tokens": True}, 400, "max_tokens", "integer"),
    ("/completions", {"model": "M", "prompt": "hi", "stop": ["a", 3]}, 400, "stop[1]", "string"),
    ("/completions", {"model": "M", "prompt": ["a", "b"]}, 400, "prompt", "one prompt per request"),
    ("/completions", {"model": "M", "prompt": "hi", "n": 17}, 400, "n", "<= 16"),
    ("/completions", {"model": "M", "prompt": "hi", "best_of": 2}, 400, "best_of", "not supported"),
    ("/chat/completions", {"model": "M", "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, 400,
     "top_logprobs", "needs 'logprobs'"),
    ("/chat/completions", {"model": "M", "messages": [{"role": "user", "content": "hi"}], "logprobs": True,
                           "top_logprobs": 21}, 400, "top_logprobs", "<= 20"),
    ("/completions", {"model": "no-such-model", "prompt": "hi", "temperature": 9}, 404, "model", "no-such-model"),
    ("/completions", {"prompt": "hi"}, 400, "model", "you must provide a 'model' parameter"),
    ("/completions", {"model": "M", "prompt": "hi", "stream": True, "stream_options": {"include_usage": 1}}, 400,
     "stream_options.include_usage", "boolean"),
    ("/chat/completions", {"model": "M", "messages": [{"role": "user", "content": "hi"}, {"role": "wizard"}]}, 400,
     "messages[1].role", "'wizard'"),
    ("/chat/completions", {"model": "M", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
     "messages[0].content[0].type", "only text parts"),
    ("/chat/completions", {"model": "M", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10 ** 7},
     400, "max_tokens", "maximum context length"),
]


def test_bad_inputs_name_the_field(server):
    """Each problem gets an OpenAI error whose ``param`` and message name it -- including bodies that are not valid
    text (lone UTF-16 surrogates) or nest thousands of levels deep, which must be a 400, not a server error."""
    import requests

    for path, body, status, param, fragment in NAMED:
        body, r = _post_raw(server, path, body)
        assert r.status_code == status, (path, body[:100], r.status_code, r.text[:300])
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error", err
        assert err["param"] == param and fragment in err["message"], (body[:100], err)
        assert len(err["message"]) < 400, err  # the error does not echo a huge body back
    r = requests.post(server.url + "/completions", json={"model": server.model, "prompt": "Hi", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    # the same text as a valid surrogate pair is an ordinary prompt
    pair = b'{"model": %s, "prompt": "\\ud83d\\ude00", "max_tokens": 2}' % json.dumps(server.model).encode()
    r = requests.post(server.url + "/completions", data=pair, headers={"Content-Type": "application/json"})
    assert r.status_code == 200, r.text


def test_router_prefers_idle_replica_and_disconnect_aborts(server):
    import requests
    from prometheus_client.parser import text_string_to_metric_families

    time.sleep(2.0)  # both replicas idle, their load reports fresh (routing_stats_period_s 0.5), before it starts
    long_body = {"model": server.model, "messages": [{"role": "user", "content": "Tell me a long story."}],
                 "max_tokens": 400, "ignore_eos": True, "temperature": 0, "stream": True}
    long = requests.post(server.url + "/chat/completions", json=long_body, stream=True, timeout=120)
    lines = long.iter_lines()
    first = next(x for x in lines if x)
    busy = json.loads(first.decode()[6:])["dspark"]["replica"]
    next(x for x in lines if x)  # a content chunk: the long request is decoding
    picked = []
    for _ in range(3):  # round-robin would alternate; least-expected-work keeps choosing the idle replica
        r = requests.post(server.url + "/completions",
                          json={"model": server.model, "prompt": "Hello", "max_tokens": 3, "temperature": 0})
        assert r.status_code == 200
        picked.append((r.json()["dspark"]["replica"], r.json()["dspark"]["routing"]))
    assert all(p != busy for p, _ in picked), json.dumps([busy, picked])

    long.close()  # client disconnect mid-stream -> the engine request is aborted and its slot freed

    def replica_metrics():
        txt = requests.get(server.base + "/metrics").text
        vals = {}  # (sample name, ((label, value), ...) sorted) -> value, for the busy replica's series
        for fam in text_string_to_metric_families(txt):
            for s in fam.samples:
                if s.name in ("dspark_replica_active_requests", "dspark_replica_total") and \
                        s.labels.get("replica") == busy:
                    vals[(s.name, tuple(sorted(s.labels.items())))] = s.value
        return vals, txt

    deadline = time.time() + 30
    while True:
        vals, txt = replica_metrics()
        aborted = vals.get(("dspark_replica_total", (("counter", "aborted"), ("replica", busy))), 0)
        active = vals.get(("dspark_replica_active_requests", (("replica", busy),)), -1)
        if aborted >= 1 and active == 0:
            break
        assert time.time() < deadline, f"abort not seen: {vals}"
        time.sleep(0.5)
    for name in ("dspark_output_tokens_per_second", "dspark_acceptance_length", "dspark_verified_depth_bucket",
                 "dspark_replica_queue_depth", "dspark_sps{", "dspark_ttft_seconds_bucket",
                 "dspark_draft_round_seconds{", "dspark_replica_cost_scale{"):
        assert name in txt, name


# ------------------------------------------------------------------------------------------------ config / CLI
def test_vllm_engine_config(serve_drafter, target_dir):
    from serve_app.app import ServeConfig, validate_vllm_config, vllm_engine_config, vllm_llm_config

    cfg = ServeConfig(engine="vllm", drafter=str(serve_drafter), target=str(target_dir), num_speculative_tokens=GAMMA, gpu=True)
    d = vllm_engine_config(cfg)
    assert d["model"] == str(target_dir) and d["max_num_seqs"] == cfg.max_batch
    assert d["speculative_config"] == {"method": "dspark", "model": str(serve_drafter), "num_speculative_tokens": GAMMA,
                                       "draft_sample_method": "probabilistic", "rejection_sample_method": "standard",
                                       "enable_adaptive_verification": True}
    assert vllm_llm_config(cfg)["engine_kwargs"]["speculative_config"]["method"] == "dspark"
    assert vllm_engine_config(ServeConfig(engine="vllm", drafter=str(serve_drafter), target=str(target_dir),
                                          scheduler="fixed"))["speculative_config"]["num_speculative_tokens"] == 7
    for bad in ({"num_speculative_tokens": 99}, {"method": "eagle"}, {"bogus_field": 1}):
        with pytest.raises(ValueError):
            validate_vllm_config(dict(d, speculative_config=dict(d["speculative_config"], **bad)))
    with pytest.raises(ValueError):
        validate_vllm_config(dict(d, not_an_engine_arg=1))
    with pytest.raises(ValueError):
        ServeConfig(scheduler="magic")
    with pytest.raises(ValueError):
        ServeConfig(replicas=0)
    if not torch.cuda.is_available():
        from serve_app.app import build_app

        with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
            build_app(cfg)


def test_jobs_serve_help():
    r = subprocess.run([sys.executable, "-m", "jobs.serve", "--help"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    for flag in ("--drafter", "--replicas", "--port", "--scheduler", "--gamma", "--engine", "ray job submit"):
        assert flag in r.stdout, flag


def test_stream_interval_coalesces_events(target_dir, reference):
    """The replica sends the first token at once, then one event per ``stream_interval`` tokens, and the rest with
    the last event; a non-streaming request gets the first and the last event only.  Tokens and text are the same
    in every mode (the target's greedy continuation)."""
    import asyncio

    from serve_app.replica import EngineReplica

    prompt = reference.chat_ids("Count from one to twenty.")
    want = reference.greedy(prompt, 12)

    async def run(interval: int, stream: bool):
        rep = EngineReplica({"target": str(target_dir), "scheduler": "none", "max_batch": 2, "threads": 1,
                             "stream_interval": interval})
        evs = [ev async for ev in rep.generate({"prompt_ids": prompt, "max_tokens": 12, "temperature": 0.0,
                                                "stream": stream})]
        # the engine was built on the thread its rounds run on (one OpenMP pool in the process, see __init__)
        assert rep.built_on_thread == rep._executor.submit(threading.get_ident).result() != threading.get_ident()
        rep.__del__()
        return evs

    for interval, stream, n_events in ((1, True, len(want)), (4, True, 1 + -(-(len(want) - 1) // 4)),
                                       (4, False, 2)):
        evs = asyncio.run(run(interval, stream))
        assert [t for ev in evs for t in ev["token_ids"]] == want, (interval, stream)
        assert len(evs) == n_events, (interval, stream, [len(ev["token_ids"]) for ev in evs])
        assert len(evs[0]["token_ids"]) == 1 and evs[-1]["finished"] and evs[-1]["completion_tokens"] == len(want)
        assert "".join(ev["text"] for ev in evs) == reference.tok.decode(want, skip_special_tokens=True)
    from serve_app.replica import ReplicaOptions
    with pytest.raises(ValueError, match="stream_interval"):
        ReplicaOptions(target=str(target_dir), stream_interval=0)


def test_engine_thread_gets_the_replicas_thread_count():
    """Ray starts a replica with OMP_NUM_THREADS = its CPU reservation (1); the engine's own thread must still run
    OpenMP (and MKL) with the replica's thread count from its first operation on."""
    probe = ("import ctypes, glob, os, torch\n"
             "from serve_app.replica import engine_executor\n"
             "libs = glob.glob(os.path.join(os.path.dirname(torch.__file__), 'lib', 'libgomp*'))\n"
             "if not libs: print('no-libgomp'); raise SystemExit\n"
             "omp = ctypes.CDLL(libs[0]).omp_get_max_threads\n"
             "from concurrent.futures import ThreadPoolExecutor\n"
             "print(ThreadPoolExecutor(1).submit(omp).result(), engine_executor(3).submit(omp).result())\n")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    if out.stdout.strip() == "no-libgomp":
        pytest.skip("this torch build has no bundled libgomp")
    assert out.stdout.split() == ["1", "3"]  # a plain new thread: 1; the engine's thread: the replica's count
