"""The CUDA path (skipped without a GPU; run on a GPU machine): the engine with the real DSparkDrafter on cuda is
lossless - greedy output equals the target's own greedy output in the same precision, batched and single, under
each scheduler, eager and with CUDA graphs (pipeline/engine/cuda_graphs.py) - at T > 0 the emitted distribution equals the
target's (chi-square), with and without graphs, and one micro-batched training step on cuda gives the CPU step's
loss and gradients."""
from __future__ import annotations

import pytest
import torch

from pipeline.engine.cuda_graphs import StaticShapes
from pipeline.dspark.anchors import make_blocks
from pipeline.dspark.drafter import DSparkDrafter
from pipeline.dspark.config import DrafterConfig
from pipeline.engine.engine import SpecConfig, SpeculativeEngine
from pipeline.ops.sampling import SamplingParams
from pipeline.engine.cost_table import CostTable
from pipeline.engine.target_runner import TargetRunner
from test_engine import _exact_joint
from toy_drafter import chi2_pvalue, joint_counts, tiny_llama

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

PROMPTS = [[1, 2, 3], [5, 6, 7, 8, 9, 10, 11], [12], [40, 41, 42, 43, 44]]
COST = CostTable({1: 0.040, 2: 0.043, 4: 0.047, 8: 0.055, 12: 0.07, 16: 0.09, 32: 0.15})


def _drafter(target, gamma=4, rank=8):
    cfg = DrafterConfig.from_target_config(target.config, num_hidden_layers=1, aux_layer_ids=[1, 2], mask_token_id=0,
                                           markov_rank=rank, block_size=gamma)
    return DSparkDrafter.from_target(cfg, target).to("cuda").eval()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("scheduler,method", [("fixed", "standard"), ("hardware", "standard"), ("async", "block")])
def test_greedy_on_cuda_equals_target_greedy(dtype, scheduler, method):
    target = tiny_llama(vocab=64, seed=0)
    base = SpeculativeEngine(TargetRunner(target, dtype, device="cuda", max_seq_len=128), None, SpecConfig())
    refs = [o.output_ids for o in base.generate(PROMPTS, SamplingParams(), max_tokens=24)]
    eng = SpeculativeEngine(TargetRunner(target, dtype, device="cuda", max_seq_len=128), _drafter(target),
                            SpecConfig(method="dspark", scheduler=scheduler, rejection_sample_method=method,
                                       cost_table=COST))
    outs = eng.generate(PROMPTS, SamplingParams(), max_tokens=24)
    assert [o.output_ids for o in outs] == refs
    singles = [eng.generate([p], SamplingParams(), max_tokens=24)[0].output_ids for p in PROMPTS]
    assert singles == refs
    assert sum(o.stats.rounds for o in outs) > 0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("speculative", [False, True])
def test_cuda_graphs_greedy_equals_eager(dtype, speculative):
    """SpecConfig(cuda_graphs=True): every decode round's target forward (and drafting round) is a replayed graph;
    the greedy output is the eager plain decoding's, batched and single, and stays so when the graphs are replayed
    for a second batch."""
    target = tiny_llama(vocab=64, seed=0)
    base = SpeculativeEngine(TargetRunner(target, dtype, device="cuda", max_seq_len=128), None, SpecConfig())
    refs = [o.output_ids for o in base.generate(PROMPTS, SamplingParams(), max_tokens=24)]
    eng = SpeculativeEngine(TargetRunner(target, dtype, device="cuda", max_seq_len=128),
                            _drafter(target) if speculative else None,
                            SpecConfig(method="dspark" if speculative else None, scheduler="hardware",
                                       cost_table=COST, cuda_graphs=True))
    assert [o.output_ids for o in eng.generate(PROMPTS, SamplingParams(), max_tokens=24)] == refs
    static = eng.target.static_forward
    recorded = static.recorded
    assert recorded > 0 and static.replays > recorded
    assert [o.output_ids for o in eng.generate(PROMPTS, SamplingParams(), max_tokens=24)] == refs
    assert [eng.generate([p], SamplingParams(), max_tokens=24)[0].output_ids for p in PROMPTS] == refs
    assert static.replays > 2 * recorded
    if speculative:
        assert eng.static_draft.recorded > 0 and eng.static_draft.replays > eng.static_draft.recorded


@pytest.mark.parametrize("graphs", [False, True])
def test_sampling_on_cuda_matches_target_distribution(graphs):
    V, n, N = 4, 4, 3000
    model = tiny_llama(vocab=V, hidden=32, seed=5, head_scale=2.0)
    prompt = [0, 1, 2]
    params = SamplingParams(temperature=1.0)
    eng = SpeculativeEngine(TargetRunner(model, "float32", device="cuda", max_seq_len=16, init_len=8),
                            _drafter(model, gamma=3, rank=4), SpecConfig(method="dspark", seed=1))
    if graphs:  # one bucket holds the whole batch
        eng.use_static_shapes(capture=True, shapes=StaticShapes(row_buckets=(N,), max_tokens=4, min_keys=16))
    outs = eng.generate([prompt] * N, params, max_tokens=n)
    if graphs:
        assert eng.target.static_forward.replays > 0 and eng.static_draft.replays > 0
    counts = joint_counts(outs, V, n)
    assert chi2_pvalue(counts, _exact_joint(model, prompt, n, params, V)) > 1e-3


def test_training_step_on_cuda_equals_cpu():
    # the losses and the training loop need pyarrow (their hidden-state stores), which a GPU box running only the
    # engine tests may lack: imported here so the other tests still run there
    from pipeline.dspark.losses import LossConfig, TargetHead, weight_sum
    from pipeline.train.step import accumulate_gradients

    torch.backends.cuda.matmul.allow_tf32 = False
    target = tiny_llama(vocab=64, hidden=32, layers=3, seed=1)
    g = torch.Generator().manual_seed(0)
    samples = []
    for T in (30, 17, 24):
        ids = torch.randint(2, 64, (1, T), generator=g)
        with torch.no_grad():
            hs = target(ids, output_hidden_states=True).hidden_states
        lm = torch.zeros(T, dtype=torch.uint8)
        lm[5:] = 1
        samples.append(dict(input_ids=ids[0].int(), loss_mask=lm, aux_hidden=torch.cat([hs[1], hs[2]], -1)[0],
                            last_hidden=hs[-1][0]))
    cfg = DrafterConfig.from_target_config(target.config, num_hidden_layers=1, aux_layer_ids=[1, 2],
                                           mask_token_id=0, markov_rank=8, block_size=4)
    lcfg = LossConfig()
    results = {}
    for dev in ("cpu", "cuda"):
        torch.manual_seed(0)
        m = DSparkDrafter.from_target(cfg, target).to(dev)
        head = TargetHead(target.lm_head.weight.detach().to(dev), m.draft_ids)
        blocks = [make_blocks(s["input_ids"].long(), s["loss_mask"], 6, 4, torch.Generator().manual_seed(i))
                  for i, s in enumerate(samples)]
        denom = sum(float(weight_sum(b.label_mask)) for b in blocks)
        parts, n_sup, _ = accumulate_gradients(m, head, samples, blocks, lcfg, denom, micro_batch=3)
        results[dev] = (parts, n_sup, {k: p.grad.detach().cpu() for k, p in m.named_parameters()
                                       if p.grad is not None})
    (pc, nc, gc), (pg, ng, gg) = results["cpu"], results["cuda"]
    assert nc == ng > 0
    for k in pc:
        assert pg[k] == pytest.approx(pc[k], rel=1e-4, abs=1e-5)
    for k in gc:
        torch.testing.assert_close(gg[k], gc[k], rtol=1e-3, atol=1e-5)
