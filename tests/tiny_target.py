"""The tiny random Llama target shared by the drafter, loss and checkpoint tests (seeded: identical every call)."""
import torch

V, D = 256, 64


def tiny_target(hidden=D, vocab=V, layers=4, tied=False):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=vocab, tie_word_embeddings=tied, pad_token_id=0,
                      eos_token_id=1)
    return LlamaForCausalLM(cfg).eval()
