"""Confidence calibration: ECE / AUROC / Brier and Sequential Temperature Scaling (docs/dspark.md §4)."""
import pytest
import torch

from pipeline.dspark.calibration import apply_sts, auroc, brier, calibration_report, ece, fit_sts
from pipeline.dspark.confidence_head import ConfidenceHead, soft_label

torch.set_num_threads(1)


def test_metrics_basic_values():
    p = torch.tensor([0.1, 0.1, 0.9, 0.9])
    y = torch.tensor([0, 0, 1, 1])
    assert ece(p, y) == pytest.approx(0.1)
    assert ece(torch.tensor([0.5, 0.5]), torch.tensor([0, 1])) == pytest.approx(0.0)
    assert auroc(p, y) == pytest.approx(1.0)
    assert auroc(torch.tensor([0.3, 0.3, 0.3]), torch.tensor([0, 1, 1])) == pytest.approx(0.5)  # ties
    assert auroc(torch.tensor([0.9, 0.1]), torch.tensor([0, 1])) == pytest.approx(0.0)
    assert auroc(p, torch.ones(4)) != auroc(p, torch.ones(4))  # nan with one class
    assert brier(p, y) == pytest.approx(0.01)


def test_soft_label_and_head():
    torch.testing.assert_close(soft_label(torch.tensor([0.0, 1.0, 2.0, 2.5])), torch.tensor([1.0, 0.5, 0.0, 0.0]))
    head = ConfidenceHead(8, 4).to(torch.bfloat16)
    assert head.proj.weight.dtype == torch.float32  # stays fp32
    out = head(torch.randn(3, 8, dtype=torch.bfloat16), torch.randn(3, 4))
    assert out.shape == (3,) and out.dtype == torch.float32


def _synthetic(n=4000, G=5, seed=0):
    """True per-step acceptance probabilities c_k; the model reports overconfident logits 3*logit(c_k) + 0.5."""
    g = torch.Generator().manual_seed(seed)
    true_logit = torch.randn(n, G, generator=g, dtype=torch.float64) * 1.2 + 1.0
    accept = torch.rand(n, G, generator=g, dtype=torch.float64) < torch.sigmoid(true_logit)
    prefix = accept.long().cumprod(-1)
    return 3.0 * true_logit + 0.5, prefix


def test_fit_sts_lowers_ece_per_position():
    z, y = _synthetic()
    before = calibration_report(z, y)
    temps = fit_sts(z, y)
    after = calibration_report(z, y, temps)
    assert len(temps) == 5 and all(t > 1.5 for t in temps)  # overconfident -> T > 1
    for k in range(5):
        assert after.ece[k] < before.ece[k]
        assert after.ece[k] < 0.03
    # monotone in z: per-position AUROC of the *per-step* confidence is unchanged
    z2 = apply_sts(z, temps)
    for k in range(5):
        assert auroc(torch.sigmoid(z2[:, k]), y[:, k]) == pytest.approx(auroc(torch.sigmoid(z[:, k]), y[:, k]))
    # held-out data: the fitted temperatures still help
    zt, yt = _synthetic(seed=1)
    assert sum(calibration_report(zt, yt, temps).ece) < 0.5 * sum(calibration_report(zt, yt).ece)


def test_fit_sts_brier_objective():
    z, y = _synthetic()
    temps = fit_sts(z, y, objective="brier")
    assert all(2.0 < t < 4.5 for t in temps)  # the true miscalibration is a factor 3 (plus a shift)
    before, after = calibration_report(z, y), calibration_report(z, y, temps)
    assert all(a < b for a, b in zip(after.brier, before.brier))
    g = torch.Generator().manual_seed(0)
    z = torch.randn(30000, 3, generator=g, dtype=torch.float64)
    acc = torch.rand(30000, 3, generator=g, dtype=torch.float64) < torch.sigmoid(z)
    temps = fit_sts(z, acc.long().cumprod(-1), objective="brier")  # already calibrated: T ~ 1
    assert all(0.75 < t < 1.33 for t in temps), temps


def test_fit_sts_validates():
    z = torch.randn(10, 3)
    acc = torch.ones(10, 3)
    with pytest.raises(ValueError):
        fit_sts(z, acc[:, :2])
    with pytest.raises(ValueError):
        fit_sts(z, acc, grid=[0.0, 1.0])
    with pytest.raises(ValueError):
        fit_sts(z, acc, objective="nll")
