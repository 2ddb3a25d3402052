"""The convergence benchmark's dataset (benchmarks/comm_breakdown.py, ``learnable_cifar``): each sample made from its
index alone, so two launches with one seed train on the same data, and learnable, so a loss curve means something."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.comm_breakdown import learnable_cifar_tiny


def test_samples_come_from_the_index_alone_and_a_small_model_learns_them() -> None:
    a, b = learnable_cifar_tiny(), learnable_cifar_tiny()
    assert len(a) == 1024 and len(a.classes) == 10
    for i in (0, 5, 1023):
        (xa, ya), (xb, yb) = a[i], b[i]
        assert xa.shape == (3, 32, 32) and torch.equal(xa, xb) and ya == yb
    assert not torch.equal(a[0][0], a[1][0])
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 32 * 32, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x = torch.stack([a[i][0] for i in range(512)])
    y = torch.tensor([a[i][1] for i in range(512)])
    first = torch.nn.functional.cross_entropy(model(x), y).item()
    for _ in range(30):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
    assert loss.item() < 0.8 * first, (first, loss.item())
