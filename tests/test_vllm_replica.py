"""The vLLM replica (serve_app/vllm_replica.py) on the CPU build of vLLM, without speculation (vLLM's dspark method
needs its GPU model runner): the real AsyncLLM streams the native replica's events -- token ids, text, the final
event's counts -- greedy output equals transformers' greedy output, concurrent requests are counted in the routing
stats the router reads, a closed stream aborts its request, and a bad request is a 400 event."""
from __future__ import annotations

import asyncio
import gc

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from pipeline.launch.launch_plan import EngineLayout, vllm_engine_env, vllm_engine_kwargs
from pipeline.data.prompts import chat_prompt_ids
from serve_app.vllm_replica import VLLMEngineReplica

pytestmark = pytest.mark.slow
PROMPT = "Name three colors."
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def loop():
    """One event loop for the module, as in a Serve replica (AsyncLLM's output handler lives on it)."""
    lp = asyncio.new_event_loop()
    yield lp
    # the engine is shut down by now: let its output handler's task end on this loop before the loop closes
    pending = [t for t in asyncio.all_tasks(lp) if not t.done()]
    for t in pending:
        t.cancel()
    lp.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
    lp.close()


@pytest.fixture(scope="module")
def replica(target_dir, loop):
    layout = EngineLayout(max_num_seqs=4)
    env = vllm_engine_env(layout)
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING")  # AsyncLLM runs its engine core in its own process
    r = VLLMEngineReplica({"engine_kwargs": vllm_engine_kwargs(str(target_dir), 256, 0, "float32", layout),
                           "engine_env": env, "model_name": "m", "max_batch": 4, "scheduler": "none"})
    yield r
    r.engine.shutdown()
    r.engine = None  # AsyncLLM's own __del__ (another shutdown) runs now, not at interpreter exit
    gc.collect()


@pytest.fixture(scope="module")
def prompt_ids(target_dir):
    return chat_prompt_ids(AutoTokenizer.from_pretrained(target_dir), PROMPT)


async def _collect(replica, request):
    return [ev async for ev in replica.generate(request)]


def test_stream_events_and_greedy_output(replica, loop, prompt_ids, target_dir):
    req = {"prompt_ids": prompt_ids, "max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True}

    async def run():
        tasks = [asyncio.create_task(_collect(replica, dict(req, request_id=f"r{i}"))) for i in range(2)]
        busy = None
        while not all(t.done() for t in tasks):
            st = await replica.record_routing_stats()
            busy = st if st["active"] == 2 else busy
            await asyncio.sleep(0.01)
        return [t.result() for t in tasks], busy, await replica.record_routing_stats()

    (a, b), busy, idle = loop.run_until_complete(run())
    ids = [sum((ev["token_ids"] for ev in evs), []) for evs in (a, b)]
    assert ids[0] == ids[1] and len(ids[0]) == MAX_TOKENS
    last = a[-1]
    assert last["finished"] and not any(ev["finished"] for ev in a[:-1])
    assert last["completion_tokens"] == MAX_TOKENS and last["prompt_tokens"] == len(prompt_ids)
    assert last["finish_reason"] == "length" and last["scheduler"] == "none"
    assert last["stats"]["rounds"] == 0 and last["stats"]["emitted_tokens"] == MAX_TOKENS
    tok = AutoTokenizer.from_pretrained(target_dir)
    assert "".join(ev["text"] for ev in a) == tok.decode(ids[0], skip_special_tokens=True)
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = model.generate(torch.tensor([prompt_ids]), max_new_tokens=MAX_TOKENS, do_sample=False,
                             min_new_tokens=MAX_TOKENS)[0, len(prompt_ids):].tolist()
    assert ids[0] == ref
    assert busy is not None and busy["queued"] == 0 and busy["max_batch"] == 4  # both in flight, seen by the router
    assert idle["active"] == 0 and idle["step_s"] is not None and idle["step_s"] > 0
    assert idle["totals"]["finished"] >= 2 and idle["totals"]["output_tokens"] >= 2 * MAX_TOKENS


def test_closed_stream_aborts_and_bad_request(replica, loop, prompt_ids):
    async def run():
        gen = replica.generate({"prompt_ids": prompt_ids, "max_tokens": 200, "ignore_eos": True})
        first = await gen.__anext__()
        await gen.aclose()  # the client went away
        bad = await _collect(replica, {"prompt_ids": prompt_ids, "max_tokens": 8, "temperature": -1.0})
        return first, bad, await replica.record_routing_stats()

    before = dict(loop.run_until_complete(replica.record_routing_stats())["totals"])
    first, bad, st = loop.run_until_complete(run())
    assert not first["finished"]
    assert st["active"] == 0 and st["totals"].get("aborted", 0) == before.get("aborted", 0) + 1
    assert len(bad) == 1 and bad[0]["status"] == 400 and bad[0]["finished"] and "temperature" in bad[0]["error"]


def test_logprobs_are_the_targets(replica, loop, prompt_ids, target_dir):
    """logprobs=k through vLLM: every event carries (logprob, k best) per token id, transformers' log-softmax."""
    req = {"prompt_ids": prompt_ids, "max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True,
           "logprobs": 2, "request_id": "lp"}
    evs = loop.run_until_complete(_collect(replica, req))
    ids = sum((ev["token_ids"] for ev in evs), [])
    lps = sum((ev["logprobs"] for ev in evs), [])
    assert len(lps) == len(ids) == MAX_TOKENS
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + ids[:-1]])).logits[0, len(prompt_ids) - 1:]
    ref = torch.log_softmax(logits.float(), dim=-1)
    for k, (t, (lp, alts)) in enumerate(zip(ids, lps)):
        assert abs(lp - float(ref[k, t])) < 1e-3, (k, lp, float(ref[k, t]))
        assert len(alts) == 2 and alts[0][0] == t  # greedy: the chosen token is the best
