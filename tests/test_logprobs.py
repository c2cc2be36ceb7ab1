"""The engine's log-probabilities: for every emitted token (an accepted draft, the bonus or a corrected token, a
plain decoding step) they are the target's own log-softmax at that position, what one full forward over the prompt
and the output gives, with or without speculation and at any temperature; the top alternatives are that row's
best, in order."""
from __future__ import annotations

import pytest
import torch

from pipeline.engine.engine import SpecConfig, SpeculativeEngine
from pipeline.engine.target_runner import TargetRunner
from pipeline.ops.sampling import SamplingParams
from toy_drafter import make_toy_drafter, tiny_llama


def _tiny():
    return tiny_llama(vocab=96, hidden=128, layers=2, heads=2, kv_heads=1, inter=256, max_pos=1024)


def _full_forward_logprobs(runner: TargetRunner, prompt: list, output: list) -> torch.Tensor:
    """[len(output), V] log-softmax of the rows that predicted each output token, in one forward."""
    slot = runner.alloc()
    try:
        out = runner.forward([slot], [prompt + output[:-1]], logits_last=[len(output)])
        return torch.log_softmax(out.logits.float(), dim=-1)
    finally:
        runner.free(slot)


@pytest.mark.parametrize("drafted", [False, True])
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_logprobs_are_the_targets_own(drafted, temperature):
    model = _tiny()
    runner = TargetRunner(model, "float32")
    drafter = make_toy_drafter(model, noise=0.05, block_size=5) if drafted else None
    spec = SpecConfig(method="dspark", scheduler="fixed", seed=1) if drafted else SpecConfig()
    eng = SpeculativeEngine(runner, drafter, spec)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 96, (n,), generator=g).tolist() for n in (5, 17, 33)]
    ids = [eng.add_request(p, SamplingParams(temperature=temperature, seed=i), max_tokens=24, ignore_eos=True,
                           logprobs=3) for i, p in enumerate(prompts)]
    got = {i: [] for i in ids}
    while eng.has_unfinished():
        for o in eng.step():
            assert o.new_logprobs is not None and len(o.new_logprobs) == len(o.new_ids)
            got[o.request_id].extend(zip(o.new_ids, o.new_logprobs))
    if drafted:
        assert eng.finished_stats.accepted > 20  # accepted drafts carry logprobs too
    ref_runner = TargetRunner(model, "float32")
    for rid, p in zip(ids, prompts):
        out = [t for t, _ in got[rid]]
        ref = _full_forward_logprobs(ref_runner, p, out)
        for k, (t, (lp, alts)) in enumerate(got[rid]):
            assert abs(lp - float(ref[k, t])) < 1e-4, (rid, k, lp, float(ref[k, t]))
            top_v, top_i = ref[k].topk(3)
            assert [i for i, _ in alts] == top_i.tolist()
            assert all(abs(v - float(rv)) < 1e-4 for (_, v), rv in zip(alts, top_v))
            if temperature == 0.0:
                assert alts[0][0] == t  # greedy: the emitted token is the best one


def test_logprobs_off_by_default_and_bounded():
    model = _tiny()
    eng = SpeculativeEngine(TargetRunner(model, "float32"), None, SpecConfig())
    out = eng.generate([[1, 2, 3]], SamplingParams(), max_tokens=3)[0]
    assert out.new_logprobs is None
    with pytest.raises(ValueError, match="logprobs must be in"):
        eng.add_request([1, 2, 3], SamplingParams(), logprobs=21)
    rid = eng.add_request([1, 2, 3], SamplingParams(), max_tokens=2, logprobs=0)
    outs = []
    while eng.has_unfinished():
        outs += [o for o in eng.step() if o.request_id == rid]
    assert all(alts == [] for o in outs for _, alts in o.new_logprobs)
