"""The norms (residuals.py RMSNorm, rms_norm_eps; the model's final norm norm_f): RMSNorm's
equation on a hand-worked case, and in every scheme each RMSNorm is called with the eps it
prints (its `eps`), the one a reader sees in `print(model)`."""

import math

import pytest
import torch
import torch.nn.functional as F

from residuals import RESIDUALS, RMSNorm, rms_norm_eps
from small_models import small_model, small_tokens


def test_rmsnorm_on_a_hand_worked_vector():
    # x = (3, 4): mean(x^2) = 12.5; with eps = 0.5 the divisor is sqrt(13)
    norm = RMSNorm(2, eps=0.5)
    with torch.no_grad():
        norm.weight.copy_(torch.tensor([2.0, -1.0]))
    y = norm(torch.tensor([[3.0, 4.0]], dtype=torch.float64))
    want = torch.tensor([[2 * 3 / math.sqrt(13), -4 / math.sqrt(13)]], dtype=torch.float64)
    torch.testing.assert_close(y, want, rtol=1e-12, atol=0)
    assert 'eps=0.5' in repr(norm)


def test_rms_norm_eps_keeps_the_gain_and_changes_only_eps():
    norm = RMSNorm(4, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.tensor([1.0, 2.0, 3.0, 4.0]))
    x = 1e-3 * torch.randn(5, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    y = rms_norm_eps(x, norm, 1e-2)  # eps dominates mean(x^2) ~ 1e-6 here
    want = norm.weight.double() * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-2)
    torch.testing.assert_close(y, want, rtol=1e-12, atol=0)
    assert not torch.allclose(y, norm(x))


@pytest.mark.parametrize('residual', sorted(RESIDUALS))
def test_every_rmsnorm_is_called_with_the_eps_it_prints(residual, monkeypatch):
    """norm_eps 1e-6 and attnres_eps 1e-5 differ, so a norm built with one and called with the
    other (as the AttnRes final norm once was) is caught by the weight it is called with."""
    model = small_model(residual, attnres_eps=1e-5)
    norms = {id(m.weight): (name, m) for name, m in model.named_modules() if isinstance(m, RMSNorm)}
    calls = []
    rms_norm = F.rms_norm

    def recording(x, shape, weight=None, eps=None):
        if weight is not None and id(weight) in norms:
            calls.append((norms[id(weight)], eps))
        return rms_norm(x, shape, weight, eps)

    monkeypatch.setattr(F, 'rms_norm', recording)
    with torch.no_grad():
        model(small_tokens())
    called = {name for (name, _), _ in calls}
    assert 'norm_f' in called, f"the final norm's gain was never used: {sorted(called)}"
    wrong = sorted({(name, m.eps, eps) for (name, m), eps in calls if eps != m.eps})
    assert not wrong, f"(norm, printed eps, eps used): {wrong}"
