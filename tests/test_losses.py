"""The forward-corrected loss (paper eq. (12), docs/FEDEFC.md §4.5)."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from common.losses import forward_corrected_loss


def test_identity_q_equals_cross_entropy():
    torch.manual_seed(0)
    logits = torch.randn(64, 10, dtype=torch.float64)
    y = torch.randint(0, 10, (64,))
    got = forward_corrected_loss(logits, y, torch.eye(10, dtype=torch.float64))
    assert torch.allclose(got, F.cross_entropy(logits, y), atol=1e-9)


def test_matches_hand_computation():
    logits = torch.tensor([[1.0, 0.0, -1.0]], dtype=torch.float64)
    q = torch.tensor([[0.8, 0.1, 0.0], [0.2, 0.9, 0.5], [0.0, 0.0, 0.5]], dtype=torch.float64)
    p = np.exp([1.0, 0.0, -1.0]) / np.exp([1.0, 0.0, -1.0]).sum()
    for label in range(3):
        expected = -np.log(q.numpy()[label] @ p)
        got = forward_corrected_loss(logits, torch.tensor([label]), q)
        assert abs(float(got) - expected) < 1e-9


def test_a_label_no_true_class_produces_gives_a_constant_term():
    """Row 1 of Q is zero: observed label 1 is impossible under Q. Its samples add
    -log(1e-12) and no gradient; the others' terms and gradients are unchanged."""
    logits = torch.randn(4, 3, requires_grad=True)
    q = torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 1.0]])
    loss = forward_corrected_loss(logits, torch.tensor([1, 1, 0, 2]), q)
    loss.backward()
    others = logits.detach()[2:].clone().requires_grad_(True)
    part = forward_corrected_loss(others, torch.tensor([0, 2]), q)
    part.backward()
    assert loss.item() == pytest.approx((2 * -np.log(1e-12) + 2 * part.item()) / 4, rel=1e-6)
    assert torch.isfinite(logits.grad).all() and (logits.grad[:2] == 0).all()
    np.testing.assert_allclose(logits.grad[2:].numpy(), others.grad.numpy() / 2, rtol=1e-6)


def _gradient_ratio(loss_fn, margin: float) -> float:
    """|d loss / d logits| of ``loss_fn`` over cross-entropy's, for one sample whose
    observed label 0 trails class 1 by ``margin`` logits (float32, as in training)."""
    grads = []
    for fn in (loss_fn, F.cross_entropy):
        logits = torch.tensor([[0.0, margin, 0.0]], requires_grad=True)
        fn(logits, torch.tensor([0])).backward()
        grads.append(logits.grad.norm().item())
    return grads[0] / grads[1]


def test_large_margins_keep_cross_entropys_gradient():
    """The linear form -log(q + 1e-12) has 0.086 of cross-entropy's gradient at a margin
    of 30 and none at 120 (q underflows); the log-space form keeps all of it."""
    q = torch.eye(3)

    def linear(logits, targets, q=q):
        picked = (F.softmax(logits, dim=1) @ q.T).gather(1, targets.view(-1, 1)).squeeze(1)
        return -(picked + 1e-12).log().mean()

    assert _gradient_ratio(linear, 30.0) == pytest.approx(0.086, abs=0.01)
    assert _gradient_ratio(linear, 120.0) == 0.0
    for margin in (30.0, 120.0):
        assert _gradient_ratio(lambda x, y: forward_corrected_loss(x, y, q), margin) == \
            pytest.approx(1.0, rel=1e-5)


def test_large_margins_with_a_non_identity_q_match_float64():
    """With Q != I the log-space loss and its gradient match a float64 evaluation of
    -log(sum_j Q[noisy, j] softmax(h)_j) at margins where float32 softmax underflows."""
    q = torch.tensor([[0.7, 0.0, 0.1], [0.3, 0.6, 0.0], [0.0, 0.4, 0.9]])
    logits = torch.tensor([[-150.0, 0.0, -40.0], [0.0, -90.0, 5.0]])
    targets = torch.tensor([0, 1])
    x32 = logits.clone().requires_grad_(True)
    loss32 = forward_corrected_loss(x32, targets, q)
    loss32.backward()
    x64 = logits.double().requires_grad_(True)
    p = torch.exp(x64 - torch.logsumexp(x64, dim=1, keepdim=True))
    ref = -torch.log((p * q.double()[targets]).sum(1)).mean()
    ref.backward()
    assert loss32.item() == pytest.approx(ref.item(), rel=1e-5)
    np.testing.assert_allclose(x32.grad.numpy(), x64.grad.numpy(), rtol=1e-4, atol=1e-7)
