"""planner._program.bracket: the plain-float evaluation of F(T) for small jobs brackets the same step time, to the
bit, as the vectorized one (capacity) -- with flat pieces, uncapped ranks, loaders with no workers and
infeasible targets among the cases."""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import numpy as np
import pytest

from planner import _program


def _case(rng: np.random.Generator) -> tuple[_program.Pieces, np.ndarray, int, int, tuple[np.ndarray, np.ndarray] | None]:
    W, k = int(rng.integers(1, 12)), int(rng.integers(1, 4))
    envs = []
    for _ in range(W):
        slopes = sorted(rng.uniform(1e-6, 1e-2, size=k))
        if rng.random() < 0.3:
            slopes[0] = 0.0  # a launch-bound floor
        envs.append(SimpleNamespace(slopes=tuple(slopes), intercepts=tuple(rng.uniform(-0.01, 0.05, size=k))))
    caps = rng.integers(1, 500, size=W).astype(float)
    if rng.random() < 0.2:
        caps[0] = np.inf
    loader = None
    if rng.random() < 0.5:
        loader = (rng.uniform(0, 0.01, size=W), rng.integers(0, 8, size=W).astype(float))
    B = int(rng.integers(1, max(2, int(np.sum(np.minimum(caps, 500))))))
    return _program.Pieces.of(envs), caps, B, int(rng.integers(1, 3)), loader  # type: ignore[arg-type]


def _bracket(*args: object) -> object:
    try:
        return _program.bracket(*args)  # type: ignore[arg-type]
    except Exception as e:  # an infeasible target: both paths must refuse it alike
        return repr(e)


def test_the_scalar_bracket_equals_the_vectorized_one(monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(0)
    cases = [_case(rng) for _ in range(400)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # numpy's inf * 0 in an infeasible case
        scalar = [_bracket(*c) for c in cases]
        monkeypatch.setattr(_program, "SCALAR_RANKS", 0)
        vector = [_bracket(*c) for c in cases]
    assert scalar == vector
    assert sum(isinstance(x, tuple) for x in scalar) > 300  # most cases are feasible brackets
