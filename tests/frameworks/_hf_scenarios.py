"""The HF Trainer with planned_trainer on 2 gloo ranks, float64: one torchrun launch runs every scenario.

    torchrun --standalone --nproc-per-node 2 tests/frameworks/_hf_scenarios.py OUT PLAN73 PLAN88

The exactness scenarios train one optimizer step with SGD (lr 1, no clipping) from the same GPT-2 initialization;
rank 0 saves the parameters to OUT/NAME.pt, and test_hf.py compares them with one process's token-mean step.
``hf_count`` and ``own_step`` each start as a fresh process would, with nothing noted as weighting a gradient yet
(runtime.safety's record is cleared between them): ``hf_count``, a ``compute_loss_func`` with the Trainer's own
global token count, which the adapter keeps and counts as the weighting -> OUT/hf_count.pt; ``own_step``, a Trainer
subclass whose own ``training_step`` computes the loss without ``compute_loss`` -> OUT/own_step_<rank>.json, the
refusal's line.
``replan``: plan [8, 8], rank 1 emulated 3x slower, 3 epochs with re-planning -> OUT/run.jsonl.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
from torch import nn

from tests.frameworks._common import exit_without_teardown

SEQ_LEN = 16


def make_gpt2() -> Any:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=128, n_positions=SEQ_LEN, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(config).double()


class LossOnly(nn.Module):
    """A plain module returning its own mean loss (no loss kwargs): the adapter weights it itself."""

    def __init__(self) -> None:
        super().__init__()
        self.lm = make_gpt2()

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, labels: torch.Tensor) -> dict[str, Any]:
        return {"loss": self.lm(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss}


class Padded(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """n sequences of 3..SEQ_LEN tokens, right-padded (labels -100 on padding)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(100 + i)
        k = int(torch.randint(3, SEQ_LEN + 1, (1,), generator=g))
        ids = torch.zeros(SEQ_LEN, dtype=torch.long)
        ids[:k] = torch.randint(1, 128, (k,), generator=g)
        mask = (torch.arange(SEQ_LEN) < k).long()
        return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


class Logits(nn.Module):
    """GPT-2's logits and no loss: the Trainer's ``compute_loss_func`` makes the loss."""

    def __init__(self) -> None:
        super().__init__()
        self.lm = make_gpt2()

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> dict[str, Any]:
        return {"logits": self.lm(input_ids=input_ids, attention_mask=attention_mask).logits}


def token_sum_over_count(outputs: dict[str, Any], labels: torch.Tensor, num_items_in_batch: Any = None) -> Any:
    """Cross-entropy of position t's logits against label t, summed over the counted labels and divided by the
    Trainer's count of them (every rank's, with average_tokens_across_devices)."""
    logits = outputs["logits"]
    total = nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1), ignore_index=-100,
                                        reduction="sum")
    return total / num_items_in_batch


def shifted_tokens(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return (batch["labels"][..., 1:] != -100).sum()


def train(model: nn.Module, n: int, accumulate: int, plan: str, out: str, **kw: Any) -> list[torch.Tensor]:
    from transformers import TrainingArguments

    from runtime.adapters.hf import planned_trainer

    args = TrainingArguments(output_dir=out, num_train_epochs=1, gradient_accumulation_steps=accumulate,
                             optim="sgd", learning_rate=1.0, lr_scheduler_type="constant", weight_decay=0.0,
                             max_grad_norm=0.0, use_cpu=True, ddp_backend="gloo", report_to="none",
                             save_strategy="no", logging_strategy="no", disable_tqdm=True)
    trainer = planned_trainer(plan, model=model, args=args, train_dataset=Padded(n), **kw)
    trainer.train()
    assert trainer.state.global_step == 1
    return [p.detach().clone() for p in model.parameters()]


def own_step(out: str, plan73: str) -> None:
    """A Trainer whose training_step takes the model's loss itself: planned_trainer's compute_loss never weights
    it.  Saves the first backward's ValidationError line (None: the step trained)."""
    import json

    import torch.distributed as dist
    from transformers import Trainer

    from planner.errors import ValidationError

    class OwnStepTrainer(Trainer):  # type: ignore[misc]
        def training_step(self, model: nn.Module, inputs: dict[str, Any], num_items_in_batch: Any = None) -> Any:
            model.train()
            loss = model(**self._prepare_inputs(inputs)).loss
            self.accelerator.backward(loss)
            return loss.detach()

    try:
        train(make_gpt2(), 10, 1, plan73, out, trainer_cls=OwnStepTrainer)
        error = None
    except ValidationError as e:
        error = str(e)
    (Path(out) / f"own_step_{dist.get_rank()}.json").write_text(json.dumps({"error": error}))


def replan(out: str, plan88: str) -> None:
    """3 epochs of 12 steps, rank 1 doing 3x the forward+backward work (profiler.workloads.emulate.Slowdown)."""
    import torch.distributed as dist
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    from profiler.workloads.emulate import Slowdown
    from runtime.adapters.hf import planned_trainer

    class SlowTrainer(Trainer):  # type: ignore[misc]
        slow = Slowdown(3.0 if dist.get_rank() == 1 else 1.0)

        def compute_loss(self, model: nn.Module, inputs: dict[str, Any], return_outputs: bool = False,
                         num_items_in_batch: Any = None) -> Any:
            if model.training:  # extra passes on the unwrapped module, gradients dropped
                self.slow.apply(getattr(model, "module", model), lambda o, y: o.logits.sum(), inputs["input_ids"],
                                inputs["labels"])
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    torch.manual_seed(0)
    # ~10 ms of compute per step on rank 0: above the scheduling noise of a busy 2-core machine
    model = GPT2LMHeadModel(GPT2Config(vocab_size=128, n_positions=SEQ_LEN, n_embd=128, n_layer=2, n_head=2))
    args = TrainingArguments(output_dir=out, num_train_epochs=3, learning_rate=1e-4, use_cpu=True,
                             ddp_backend="gloo", report_to="none", save_strategy="no", logging_strategy="no",
                             disable_tqdm=True)
    trainer = planned_trainer(plan88, trainer_cls=SlowTrainer, profile=Path(plan88).with_suffix(".profile.json"),
                              replan=True, log_file=Path(out) / "run.jsonl", model=model, args=args,
                              train_dataset=Padded(16 * 12))
    trainer.train()


def calibrate(out: str, plan88: str) -> None:
    """runtime.adapters.hf.measure_trainer_overhead on a scratch stock Trainer at [8, 8] -> OUT/calibrated_<rank>.json
    (the calibrated profile) and OUT/calibrated_<rank>.state.json (steps run, max_steps after the call)."""
    import json

    import torch.distributed as dist
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    from planner import Profile
    from runtime.adapters.hf import measure_trainer_overhead

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=128, n_positions=SEQ_LEN, n_embd=128, n_layer=2, n_head=2))
    args = TrainingArguments(output_dir=out, per_device_train_batch_size=8, num_train_epochs=1, learning_rate=1e-4,
                             use_cpu=True, ddp_backend="gloo", report_to="none", save_strategy="no",
                             logging_strategy="no", disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=Padded(16 * 4))  # 4 steps an epoch: the call runs 6
    profile = Profile.load(Path(plan88).with_suffix(".profile.json"))
    cal = measure_trainer_overhead(profile, trainer, steps=4, warmup=2)
    rank = dist.get_rank()
    cal.save(Path(out) / f"calibrated_{rank}.json")
    (Path(out) / f"calibrated_{rank}.state.json").write_text(json.dumps(
        {"global_step": trainer.state.global_step, "max_steps": trainer.args.max_steps}))


def main(out: str, plan73: str, plan88: str) -> None:
    import torch.distributed as dist

    from runtime import safety

    hf_count = train(Logits(), 10, 1, plan73, out, compute_loss_func=token_sum_over_count)
    safety._WEIGHTING.clear()  # the next scenario starts as a fresh process would: nothing weighted yet
    own_step(out, plan73)
    results = {
        "hf_count": hf_count,
        "gpt2": train(make_gpt2(), 10, 1, plan73, out),  # the adapter counts GPT-2's shifted targets
        "gpt2_accum2": train(make_gpt2(), 20, 2, plan73, out),  # 2 micro-batches per rank, one step
        "loss_only_accum2": train(LossOnly(), 20, 2, plan73, out, count_tokens=shifted_tokens),
        "samples": train(make_gpt2(), 10, 1, plan73, out, count_tokens=lambda b: len(b["labels"])),
    }
    if dist.get_rank() == 0:
        for name, params in results.items():
            torch.save(params, Path(out) / f"{name}.pt")
    replan(out, plan88)
    calibrate(out, plan88)
    dist.barrier()


if __name__ == "__main__":
    main(*sys.argv[1:4])
    exit_without_teardown()
