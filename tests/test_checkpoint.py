"""Checkpoint export (speculators format) -> load_drafter round trip, and clear errors on bad / mismatched input."""
import json
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from pipeline.dspark.checkpoint import CheckpointError, export_checkpoint, load_drafter
from pipeline.dspark.target_weights import load_target_weights
from pipeline.dspark.drafter import DSparkDrafter
from pipeline.dspark.config import DrafterConfig
from pipeline.ops.sampling import SamplingParams

torch.set_num_threads(1)

V, D, G = 256, 64, 4

from tiny_target import tiny_target  # noqa: E402


@pytest.fixture(scope="module")
def target():
    return tiny_target()


def make_drafter(target, nd=V, head="vanilla", **kw):
    if kw.get("kind") != "dflash":
        kw.setdefault("markov_rank", 16)
    cfg = DrafterConfig.from_target_config(target.config, num_hidden_layers=2, block_size=G, draft_vocab_size=nd,
                                           markov_head_type=head, **kw)
    ids = None
    if nd < V:
        ids = torch.randperm(V, generator=torch.Generator().manual_seed(1))[:nd].sort().values
    m = DSparkDrafter.from_target(cfg, target, draft_ids=ids)
    torch.manual_seed(3)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if p.requires_grad and p.dim() > 0 and "norm" not in n:
                p.normal_(0, 0.1)
    return m.eval()


def outputs(m, seed=0):
    torch.manual_seed(seed)
    st = m.new_state()
    m.extend_context(st, torch.randn(9, m.cfg.num_aux_layers * D))
    return m.propose([st], torch.tensor([7]), SamplingParams(temperature=1.0), torch.Generator().manual_seed(0))


@pytest.mark.parametrize("nd", [V, 200])
def test_export_format(tmp_path, target, nd):
    m = make_drafter(target, nd)
    p = export_checkpoint(m, tmp_path / "ckpt", verifier_name_or_path="tiny/llama",
                          verifier_architectures=["LlamaForCausalLM"])
    cfg = json.loads((p / "config.json").read_text())
    assert "model_type" not in cfg and cfg["speculators_model_type"] == "dspark"
    sc = cfg["speculators_config"]
    assert sc["algorithm"] == "dspark" and sc["default_proposal_method"] == "greedy"
    assert sc["proposal_methods"][0] == {"proposal_type": "greedy", "speculative_tokens": G, "verifier_accept_k": 1,
                                         "accept_tolerance": 0.0}
    assert sc["verifier"] == {"name_or_path": "tiny/llama", "architectures": ["LlamaForCausalLM"]}
    assert cfg["aux_hidden_state_layer_ids"] == m.cfg.aux_layer_ids and cfg["block_size"] == G
    assert cfg["sample_from_anchor"] is True and cfg["markov_rank"] == 16 and cfg["markov_head_type"] == "vanilla"
    assert cfg["enable_confidence_head"] and cfg["confidence_head_with_markov"]
    assert cfg["draft_vocab_size"] == nd and cfg["target_hidden_size"] == D
    L = cfg["transformer_layer_config"]
    assert (L["hidden_size"], L["num_attention_heads"], L["num_key_value_heads"], L["head_dim"]) == (D, 4, 2, 16)
    assert L["vocab_size"] == V and L["layer_types"] == ["full_attention"] * 2
    assert cfg["dspark_ray"]["kind"] == "dspark"
    with safe_open(str(p / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        assert f.get_tensor("confidence_head.proj.weight").dtype == torch.float32
        assert f.get_tensor("fc.weight").dtype == torch.bfloat16
        assert tuple(f.get_tensor("fc.weight").shape) == (D, 3 * D)
        assert tuple(f.get_tensor("markov_head.markov_w1.weight").shape) == (V, 16)
        assert tuple(f.get_tensor("markov_head.markov_w2.weight").shape) == (nd, 16)
        assert tuple(f.get_tensor("confidence_head.proj.weight").shape) == (1, D + 16)
    expected = {"fc.weight", "hidden_norm.weight", "norm.weight", "markov_head.markov_w1.weight",
                "markov_head.markov_w2.weight", "confidence_head.proj.weight", "confidence_head.proj.bias"}
    for i in range(2):
        expected |= {f"layers.{i}.{n}.weight" for n in (
            "input_layernorm", "post_attention_layernorm", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
            "self_attn.o_proj", "self_attn.q_norm", "self_attn.k_norm", "mlp.gate_proj", "mlp.up_proj",
            "mlp.down_proj")}
    if nd < V:
        expected |= {"lm_head.weight", "d2t", "t2d"}
        d2t = load_file(str(p / "model.safetensors"))["d2t"]
        assert d2t.dtype == torch.int64 and torch.equal(torch.arange(nd) + d2t, m.draft_ids)
    assert names == expected
    assert not any(x.name.startswith(".") for x in tmp_path.iterdir())  # no temp leftovers


@pytest.mark.filterwarnings("ignore:export_checkpoint")
@pytest.mark.parametrize("nd,head", [(V, "vanilla"), (200, "vanilla"), (200, "rnn")])
def test_round_trip_identical_outputs(tmp_path, target, nd, head):
    m = make_drafter(target, nd, head, sts_temperatures=[1.0, 1.5, 2.0, 0.5])
    ref = outputs(m)
    export_checkpoint(m, tmp_path / "c", dtype=torch.float32)
    export_checkpoint(m, tmp_path / "c", dtype=torch.float32)  # overwrite atomically
    m2 = load_drafter(tmp_path / "c", target)
    assert m2.cfg == m.cfg
    got = outputs(m2)
    assert torch.equal(got.tokens, ref.tokens)
    assert torch.equal(got.logits, ref.logits) and torch.equal(got.q, ref.q)
    assert torch.equal(got.conf_logits, ref.conf_logits)
    assert not m2.embed_tokens.weight.requires_grad and not m2.lm_head.weight.requires_grad
    # default bf16 export loads and matches a bf16-rounded drafter closely
    export_checkpoint(m, tmp_path / "b")
    m3 = load_drafter(tmp_path / "b", target)
    torch.testing.assert_close(outputs(m3).logits, ref.logits, atol=0.05, rtol=0.05)


def test_export_sweeps_what_a_killed_export_left(tmp_path, target):
    """An export killed half-way leaves its temporary folder (named with its pid); the next export to the same path
    removes it, and keeps one whose writer is still alive."""
    import subprocess
    import sys

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    left = tmp_path / f"c.tmp-{dead}-0badc0de"
    left.mkdir()
    (left / "model.safetensors").write_bytes(b"half")
    live = tmp_path / f"c.tmp-{os.getppid()}-0badc0de"
    live.mkdir()
    export_checkpoint(make_drafter(target), tmp_path / "c", dtype=torch.float32)
    assert not left.exists() and live.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["c", live.name])


def test_dflash_round_trip(tmp_path, target):
    m = make_drafter(target, 200, kind="dflash")
    with pytest.warns(UserWarning, match="markov_rank=0"):
        export_checkpoint(m, tmp_path / "d", dtype=torch.float32)
    cfg = json.loads((tmp_path / "d" / "config.json").read_text())
    assert cfg["markov_rank"] == 0 and not cfg["enable_confidence_head"] and cfg["dspark_ray"]["kind"] == "dflash"
    m2 = load_drafter(tmp_path / "d", target)
    assert m2.cfg.kind == "dflash" and m2.confidence_head is None
    a, b = outputs(m), outputs(m2)
    assert torch.equal(a.logits, b.logits) and a.conf_logits is None and b.conf_logits is None


def test_load_with_target_folder_and_tied_target(tmp_path):
    t = tiny_target(tied=True)
    t.save_pretrained(tmp_path / "target")
    tw = load_target_weights(tmp_path / "target")
    assert torch.equal(tw.embed, t.model.embed_tokens.weight) and torch.equal(tw.lm_head, tw.embed)
    m = make_drafter(t, 200)
    export_checkpoint(m, tmp_path / "c", dtype=torch.float32)
    m2 = load_drafter(tmp_path / "c", tmp_path / "target")
    assert torch.equal(outputs(m2).logits, outputs(m).logits)


def test_gated_head_exports_with_a_clear_vllm_note(tmp_path, target, capsys):
    m = make_drafter(target, V, "gated")
    with pytest.warns(UserWarning, match="vanilla"):
        export_checkpoint(m, tmp_path / "g", dtype=torch.float32)
    assert "vLLM" in capsys.readouterr().out
    cfg = json.loads((tmp_path / "g" / "config.json").read_text())
    assert cfg["dspark_ray"]["vllm_compatible"] is False
    assert torch.equal(outputs(load_drafter(tmp_path / "g", target)).logits, outputs(m).logits)


def test_mismatched_target_errors(tmp_path, target):
    export_checkpoint(make_drafter(target, 200), tmp_path / "c")
    with pytest.raises(CheckpointError, match="hidden size 64.*hidden size 128"):
        load_drafter(tmp_path / "c", tiny_target(hidden=128))
    with pytest.raises(CheckpointError, match="vocabulary of 256.*has 300"):
        load_drafter(tmp_path / "c", tiny_target(vocab=300))
    with pytest.raises(CheckpointError, match="layers"):
        load_drafter(tmp_path / "c", tiny_target(layers=2))
    other = tiny_target()
    with torch.no_grad():
        other.lm_head.weight.mul_(-1)
    with pytest.raises(CheckpointError, match="lm_head"):
        load_drafter(tmp_path / "c", other)


def test_corrupt_and_incomplete_checkpoints(tmp_path, target):
    src = export_checkpoint(make_drafter(target, 200), tmp_path / "c")
    data = (src / "model.safetensors").read_bytes()
    (src / "model.safetensors").write_bytes(data[: len(data) // 2])  # truncated
    with pytest.raises(CheckpointError, match="corrupt or truncated"):
        load_drafter(src, target)
    (src / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="corrupt or truncated"):
        load_drafter(src, target)

    src = export_checkpoint(make_drafter(target, 200), tmp_path / "c")
    t = load_file(str(src / "model.safetensors"))

    def save_changed(drop=(), replace=None):  # the exported tensors with some left out or replaced
        t2 = {k: v for k, v in t.items() if k not in drop}
        t2.update(replace or {})
        save_file(t2, str(src / "model.safetensors"))

    save_changed(drop=["layers.1.mlp.down_proj.weight"])
    with pytest.raises(CheckpointError, match="missing: \\['layers.1.mlp.down_proj.weight'\\]"):
        load_drafter(src, target)
    save_changed(replace={"fc.weight": torch.zeros(D, 2 * D, dtype=torch.bfloat16)})
    with pytest.raises(CheckpointError, match="wrong shape.*fc.weight"):
        load_drafter(src, target)
    save_changed(drop=["d2t"])
    with pytest.raises(CheckpointError, match="d2t"):
        load_drafter(src, target)
    save_changed(replace={"markov_head.gate_proj.weight": torch.zeros(1)})
    with pytest.raises(CheckpointError, match="unexpected"):
        load_drafter(src, target)

    (src / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="JSON"):
        load_drafter(src, target)
    (src / "config.json").unlink()
    with pytest.raises(CheckpointError, match="config.json"):
        load_drafter(src, target)


def test_w1_from_embedding_trains_shared_projection_and_exports_as_table(tmp_path, target):
    """markov_w1_source='embedding': W1 = rmsnorm(E) P^T + R while training; the checkpoint holds the folded [V, r]
    table, and the loaded ('table') drafter gives the same outputs."""
    from pipeline.dspark.config import DrafterConfigError

    with pytest.raises(DrafterConfigError, match="markov_w1_source"):
        make_drafter(target, 200, markov_w1_source="rows")
    fresh = DSparkDrafter(DrafterConfig.from_target_config(target.config, block_size=G, markov_rank=16,
                                                           markov_w1_source="embedding"))
    assert not fresh.markov_head.markov_w1.weight.any()  # R starts at zero: W1 = the embedding's projection
    m = make_drafter(target, 200, markov_w1_source="embedding")  # P and R randomised
    head = m.markov_head
    ids = torch.tensor([[3, 9, 9, 250]])
    w1 = head.materialize_w1()
    assert w1.shape == (V, 16)
    torch.testing.assert_close(head.prev_embed(ids), w1[ids])
    # gradients: the per-token rows only where used, the shared projection (so every token's latent) always
    m.train()
    head.prev_embed(ids).pow(2).sum().backward()
    touched = head.markov_w1.weight.grad.abs().sum(-1).nonzero().flatten().tolist()
    assert touched == [3, 9, 250] and head.markov_w1_proj.weight.grad.abs().sum() > 0
    assert m.embed_tokens.weight.grad is None  # the target embedding stays frozen
    m.zero_grad(set_to_none=True)
    m.eval()
    ref = outputs(m)
    export_checkpoint(m, tmp_path / "e", dtype=torch.float32)
    names = set(load_file(str(tmp_path / "e" / "model.safetensors")))
    assert "markov_head.markov_w1.weight" in names and not any("w1_proj" in n for n in names)
    m2 = load_drafter(tmp_path / "e", target)
    assert m2.cfg.markov_w1_source == "table" and not hasattr(m2.markov_head, "markov_w1_proj")
    torch.testing.assert_close(m2.markov_head.markov_w1.weight, w1)
    got = outputs(m2)
    torch.testing.assert_close(got.logits, ref.logits, rtol=1e-5, atol=1e-5)
    assert torch.equal(got.tokens, ref.tokens)
