"""profiler.workloads.lm: the tiny_lm decoder and fake_text token data behind --model / --dataset."""

from __future__ import annotations

import pytest
import torch

from planner.errors import ValidationError
from profiler.workloads.lm import IGNORE_INDEX, FakeText, TinyLM, count_tokens, lm_config, lm_loss, parse_text_spec
from profiler.workloads.specs import build_workload, synthetic_batch


def test_sizes_and_the_specs() -> None:
    w = build_workload("tiny_lm", "fake_text", num_samples=32)
    assert w.vocab_size == 2048 and w.sample_shape == (64,) and not w.has_batchnorm
    assert w.name == "tiny_lm@fake_text" and len(w.dataset) == 32
    assert 0.5e6 < sum(p.numel() for p in w.model_fn().parameters()) < 1e6
    assert build_workload("tiny_lm:small", "fake", num_samples=4).sample_shape == (256,)  # fake means fake_text
    assert build_workload("tiny_lm", "fake_text:8-32", num_samples=4).sample_shape == (32,)
    cfg = lm_config("tiny_lm:125m")  # the GPU benchmark's size, counted without building 110M parameters
    d, v, layers = cfg.d_model, cfg.vocab_size, cfg.num_layers
    assert 100e6 < v * d + 1024 * d + layers * (12 * d * d + 13 * d) < 120e6


@pytest.mark.parametrize(("model", "dataset", "match"), [
    ("tiny_lm:huge", "fake_text", "unknown tiny_lm size"),
    ("tiny_lm", "cifar10:/x", "token data"),
    ("mlp", "fake_text", "token data for --model tiny_lm"),
    ("tiny_lm", "fake_text:9-3", "2 <= MIN <= MAX"),
    ("tiny_lm", "fake_text:abc", "fake_text:MIN-MAX"),
])
def test_bad_specs_are_one_clear_error(model: str, dataset: str, match: str) -> None:
    with pytest.raises(ValidationError, match=match):
        build_workload(model, dataset, num_samples=4)


def test_fake_text_is_next_token_data_padded_past_each_length() -> None:
    assert parse_text_spec("fake_text", 64) == (64, 64) and parse_text_spec("fake_text:5-9", 64) == (5, 9)
    data = FakeText(50, 16, 100, min_len=4, seed=2)
    lengths = [data.length_of(i) for i in range(50)]
    assert min(lengths) >= 4 and max(lengths) <= 16 and len(set(lengths)) > 3
    for i in (0, 7):
        ids, targets = data[i]
        n = lengths[i]
        assert int(count_tokens(targets)) == n and (targets[n:] == IGNORE_INDEX).all() and (ids[n:] == 0).all()
        assert torch.equal(targets[: n - 1], ids[1:n])  # target t is input t+1
        assert torch.equal(data[i][0], ids)  # seeded per index: the same on every rank
    packed = FakeText(3, 8, 100)
    assert all(int(count_tokens(packed[i][1])) == 8 for i in range(3))
    with pytest.raises(IndexError):
        packed[3]


def test_the_decoder_is_causal_so_padding_never_changes_real_positions() -> None:
    torch.manual_seed(0)
    model = TinyLM(lm_config("tiny_lm"), 12).double()
    ids = torch.randint(1, 2048, (1, 12))
    other = ids.clone()
    other[0, 7:] = 0  # different tokens after position 6
    torch.testing.assert_close(model(ids)[0, :7], model(other)[0, :7], rtol=0, atol=1e-12)
    with pytest.raises(ValidationError, match="exceeds"):
        model(torch.zeros(1, 13, dtype=torch.long))


def test_lm_loss_is_the_mean_over_counted_tokens() -> None:
    logits = torch.randn(2, 4, 10, dtype=torch.float64)
    targets = torch.tensor([[1, 2, IGNORE_INDEX, IGNORE_INDEX], [3, 4, 5, 6]])
    per_token = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none",
                                                  ignore_index=IGNORE_INDEX)
    torch.testing.assert_close(lm_loss(logits, targets), per_token.sum() / 6)
    assert int(count_tokens(targets)) == 6


def test_synthetic_batches_are_full_length_token_ids() -> None:
    w = build_workload("tiny_lm", "fake_text:8-32", num_samples=4)
    x, y = synthetic_batch(w, 3, "cpu", dtype=torch.float64)  # the profiler passes the model's float dtype
    assert x.shape == y.shape == (3, 32) and x.dtype == y.dtype == torch.long
    assert int(x.min()) >= 1 and int(x.max()) < 2048
    loss = w.loss_fn(w.model_fn()(x), y)
    assert 6.0 < float(loss.detach()) < 9.0  # ~log(2048) at initialization: GPT-2's embedding init
