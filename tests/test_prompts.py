import json

import pytest

from pipeline.data.prompts import DEFAULT_PROMPTS, read_prompt_files
from pipeline.dspark.config import dflash_layer_ids, parse_layer_ids


def test_shipped_prompts_readable():
    rows, skips = read_prompt_files([DEFAULT_PROMPTS])
    assert len(rows) >= 30 and not skips


def test_bad_input_becomes_recorded_skips(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text("\n".join([json.dumps({"turns": ["hello"]}), "{not json", json.dumps({"turns": ["  "]}),
                            json.dumps({"prompt": "p2"}), json.dumps({"other": 1}), ""]) + "\n")
    rows, skips = read_prompt_files([f])
    assert [r.text for r in rows] == ["hello", "p2"]
    reasons = {s.line: s.reason for s in skips}
    assert "malformed JSON" in reasons[2] and reasons[3] == "empty prompt" and "no usable prompt" in reasons[5]
    assert [r.request_id for r in rows] == ["p:1", "p:4"]


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="prompt file not found: .*nope.jsonl"):
        read_prompt_files([tmp_path / "nope.jsonl"])


def test_limit_and_duplicate_stems(tmp_path):
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    for d in "ab":
        (tmp_path / d / "x.jsonl").write_text("".join(json.dumps({"prompt": f"{d}{i}"}) + "\n" for i in range(3)))
    rows, _ = read_prompt_files([tmp_path / "a" / "x.jsonl", tmp_path / "b" / "x.jsonl"], limit=4)
    assert len(rows) == 4 and len({r.request_id for r in rows}) == 4
    rows, _ = read_prompt_files([tmp_path / "a" / "x.jsonl", tmp_path / "b" / "x.jsonl"], limit_per_file=2)
    assert [r.text for r in rows] == ["a0", "a1", "b0", "b1"]


def test_layer_id_rule():
    # DeepSpec's 0-based ids for Qwen3-8B (L=36, n=5) are [1, 9, 17, 25, 33]; ours are +1
    assert dflash_layer_ids(36, 5) == [2, 10, 18, 26, 34]
    assert dflash_layer_ids(30, 3) == [2, 15, 28]
    with pytest.raises(ValueError, match="strictly increasing"):
        parse_layer_ids("3,2", 30)
    with pytest.raises(ValueError, match=r"\[0, 30\]"):
        parse_layer_ids("1,31", 30)
