"""The forward-corrected loss (paper eq. (12), docs/FEDEFC.md §4.5)."""

import numpy as np
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
        expected = -np.log(q.numpy()[label] @ p + 1e-12)
        got = forward_corrected_loss(logits, torch.tensor([label]), q)
        assert abs(float(got) - expected) < 1e-9


def test_gradient_finite_when_noisy_probability_is_zero():
    logits = torch.randn(4, 3, requires_grad=True)
    q = torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 1.0]])  # row 1 all zero
    loss = forward_corrected_loss(logits, torch.tensor([1, 1, 0, 2]), q)
    loss.backward()
    assert torch.isfinite(loss)
    assert torch.isfinite(logits.grad).all()
