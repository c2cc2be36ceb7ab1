import pytest
import torch

from pipeline.stores.disk import DiskHiddenStore
from pipeline.stores.base import StoreError, bytes_per_token


def _sample(T, n=3, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"input_ids": torch.randint(0, 1000, (T,), generator=g, dtype=torch.int32),
            "loss_mask": (torch.rand(T, generator=g) > 0.5).to(torch.uint8),
            "aux_hidden": torch.randn(T, n * d, generator=g).to(torch.bfloat16),
            "last_hidden": torch.randn(T, d, generator=g).to(torch.bfloat16),
            **({"target_lse": torch.randn(T, generator=g)} if seed % 2 == 0 else {})}


def test_round_trip_bit_exact_and_resume(tmp_path):
    s = DiskHiddenStore(tmp_path / "h", samples_per_shard=2)
    samples = {f"r{i}": _sample(5 + i, seed=i) for i in range(5)}
    for k, v in list(samples.items())[:3]:
        s.put(k, v)
    s.flush()
    with pytest.raises(StoreError, match="no manifest"):
        DiskHiddenStore(tmp_path / "h").manifest()
    # a "crash" here: a new writer sees exactly the durable ids and re-puts are no-ops
    s2 = DiskHiddenStore(tmp_path / "h", samples_per_shard=2)
    assert s2.done_ids() == {"r0", "r1", "r2"}
    for k, v in samples.items():
        s2.put(k, v)
    m = s2.commit({"note": "x"})
    assert m["sample_ids"] == sorted(samples) and m["num_rows"] == 5
    r = DiskHiddenStore(tmp_path / "h")
    for k, v in samples.items():
        got = r.get(k)
        assert set(got) == set(v)  # the optional target_lse comes back exactly when it was stored
        for name in v:
            assert got[name].dtype == v[name].dtype
            assert torch.equal(got[name].view(torch.uint8) if got[name].dtype != torch.bfloat16 else
                               got[name].view(torch.int16), v[name].view(torch.uint8) if v[name].dtype !=
                               torch.bfloat16 else v[name].view(torch.int16))
    with pytest.raises(KeyError):
        r.get("nope")


def test_bad_sample_rejected(tmp_path):
    s = DiskHiddenStore(tmp_path / "h")
    bad = _sample(4)
    bad["last_hidden"] = bad["last_hidden"][:3]
    with pytest.raises(StoreError, match="last_hidden has 3 tokens"):
        s.put("x", bad)
    bad = _sample(4)
    bad["aux_hidden"] = bad["aux_hidden"].float()
    with pytest.raises(StoreError, match="aux_hidden must be"):
        s.put("x", bad)


def test_bytes_per_token():
    assert bytes_per_token(3, 576, with_lse=False) == 5 + 2 * 3 * 576 + 2 * 576 == 4613
    assert bytes_per_token(3, 576) == 4613 + 4  # + the fp32 full-vocabulary lse
