"""The closure convention every asyncpipe optimizer follows: inside `step` (no-grad) the closure runs with
gradients enabled and its loss is returned."""

import torch

from asyncpipe.optim.closure import evaluate_closure


def test_closure_runs_with_grad_and_returns_its_loss() -> None:
    w = torch.nn.Parameter(torch.tensor([2.0]))

    def closure() -> torch.Tensor:
        loss = (w * w).sum()
        loss.backward()
        return loss

    with torch.no_grad():
        loss = evaluate_closure(closure)
        assert evaluate_closure(None) is None
    assert float(loss.detach()) == 4.0
    assert float(w.grad) == 4.0  # d(w^2)/dw at 2: the closure's backward ran with gradients on
