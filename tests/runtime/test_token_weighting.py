"""Token weighting: DDP over uneven ranks of padded LM sequences equals one process's token-mean gradient (fp64).

The one-process reference is the loss of all 10 sequences at once -- cross-entropy summed over every counted
target token, divided by their number. Two gloo ranks on a [7, 3] split reach it to 1e-9 with the loss scale
w_i * W / N and with the hook (per_batch_weights), also when a rank runs its share as 2 micro-batches; weighting
by sample counts (n_i * W / n) on the same data is measurably wrong.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from profiler.workloads.lm import FakeText, TinyLM, count_tokens, lm_config, lm_loss
from runtime.sampler import HeteroBatchSampler
from runtime.weighting import StepWeights, register_weighted_hook, step_weights
from tests._dist import run_distributed

SPLIT = [7, 3]
N = sum(SPLIT)


def make_model() -> TinyLM:
    torch.manual_seed(0)
    return TinyLM(lm_config("tiny_lm"), 16).double()


def make_data() -> tuple[torch.Tensor, torch.Tensor]:
    # Lengths 3..16 padded to 16: ranks hold very different token counts per sample.
    data = FakeText(N, 16, lm_config("tiny_lm").vocab_size, min_len=3, seed=1)
    ids, targets = zip(*(data[i] for i in range(N)), strict=True)
    return torch.stack(ids), torch.stack(targets)


def flat_grad(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])


def reference_grad() -> torch.Tensor:
    model = make_model()
    ids, targets = make_data()
    lm_loss(model(ids), targets).backward()  # the token mean over all 10 sequences
    return flat_grad(model)


def rank_rows(rank: int) -> list[int]:
    return list(range(0, SPLIT[0])) if rank == 0 else list(range(SPLIT[0], N))


def _ranks_grad(rank: int, world: int, mode: str, micro: int, out: str) -> None:
    model = make_model()
    ddp = DDP(model, bucket_cap_mb=1e-6)  # several buckets: the hook sees more than one per backward
    ids, targets = make_data()
    rows = rank_rows(rank)
    chunks = [rows[j::micro] for j in range(micro)]  # this rank's micro-batches of the one optimizer step
    state = None
    if mode == "hook":
        sampler = HeteroBatchSampler(N, SPLIT, rank, shuffle=False)
        state = register_weighted_hook(ddp, sampler, per_batch_weights=True)
    counts = [count_tokens(targets[c]) for c in chunks]
    weights = step_weights(counts)  # the step's one scalar all-reduce
    if state is not None:
        state.set_step_weights(weights)
    for j, c in enumerate(chunks):
        sync = j == len(chunks) - 1
        with contextlib.nullcontext() if sync else ddp.no_sync():
            loss = lm_loss(ddp(ids[c]), targets[c])
            if mode == "tokens":
                scale = weights.loss_scale(j)
            elif mode == "hook":
                scale = weights.accumulation_weight(j)
            else:  # what sample-count weighting does: n_ij * W / n
                scale = len(c) * world / N
            (loss * scale).backward()
    if rank == 0:
        torch.save(flat_grad(model), out)


@pytest.mark.distributed
@pytest.mark.parametrize(("mode", "micro"), [("tokens", 1), ("tokens", 2), ("hook", 1), ("hook", 2)])
def test_token_weighting_gives_the_one_process_token_mean_gradient(tmp_path, mode: str, micro: int) -> None:
    out = str(tmp_path / "g.pt")
    run_distributed(_ranks_grad, 2, mode, micro, out)
    got, want = torch.load(out), reference_grad()
    assert (got - want).abs().max().item() <= 1e-9 * max(1.0, want.abs().max().item())


@pytest.mark.distributed
def test_sample_count_weighting_is_wrong_on_the_same_data(tmp_path) -> None:
    out = str(tmp_path / "g.pt")
    run_distributed(_ranks_grad, 2, "samples", 1, out)
    got, want = torch.load(out), reference_grad()
    assert (got - want).norm().item() > 1e-3 * want.norm().item()  # far outside rounding: a biased gradient


def test_step_weights_single_process_and_errors() -> None:
    w = step_weights([torch.tensor(30), 10])  # no process group: the local sum is the total
    assert (w.local, w.total, w.world_size) == (40.0, 40.0, 1)
    assert w.loss_scale(0) == pytest.approx(0.75) and w.accumulation_weight(1) == pytest.approx(0.25)
    assert StepWeights(micro=(0.0,), total=5.0, world_size=2).accumulation_weight() == 0.0
    with pytest.raises(ValueError, match="sum to 0"):
        StepWeights(micro=(0.0,), total=0.0, world_size=2)
    with pytest.raises(ValueError, match=">= 0"):
        StepWeights(micro=(-1.0,), total=5.0, world_size=2)
