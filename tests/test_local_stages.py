"""Stage 1 in one process (pipeline/train/local_stages.py): greedy responses in batches of similar-length prompts, and the
wall-clock cap that leaves whole batches out."""
import torch
from transformers import AutoTokenizer

from pipeline.train.local_stages import generate_responses
from tests.tiny_target import tiny_target


def _requests(n):
    return [dict(request_id=f"r{i}", source_file="toy.jsonl", prompt_ids=list(range(5, 8 + i % 7))) for i in range(n)]


def test_generate_responses_answers_every_prompt_and_caps_by_time(target_dir):
    tok = AutoTokenizer.from_pretrained(str(target_dir))
    model = tiny_target(vocab=len(tok))
    reqs = _requests(10)
    rows = generate_responses(model, tok, reqs, max_new_tokens=6, batch=3, device=torch.device("cpu"), seed=1)
    assert sorted(r["request_id"] for r in rows) == sorted(r["request_id"] for r in reqs)
    by_id = {r["request_id"]: r for r in reqs}
    for row in rows:  # each row is its own prompt's greedy continuation, whatever batch it ran in
        p = by_id[row["request_id"]]["prompt_ids"]
        assert row["prompt_ids"] == p and 1 <= len(row["response_ids"]) <= 6
        alone = model.generate(torch.tensor([p]), max_new_tokens=len(row["response_ids"]), do_sample=False,
                               eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
        assert row["response_ids"] == alone
        assert len(row["loss_mask"]) == len(p) + len(row["response_ids"]) and sum(row["loss_mask"]) == len(alone)

    capped = generate_responses(model, tok, reqs, max_new_tokens=6, batch=3, device=torch.device("cpu"), seed=1,
                                max_seconds=1e-9)
    assert 1 <= len(capped) <= 3  # the first batch (3 prompts, or the remainder's 1) runs; none after the cap
    assert capped == rows[:len(capped)]  # the same seeded batch order, the same responses
