"""A Hugging Face Trainer script, stock and planned: a tiny GPT-2 fine-tuned on synthetic padded token sequences.

    torchrun --nproc-per-node 2 examples/hf_trainer_stock.py --batch-size 8       # the same batch on every process
    torchrun --nproc-per-node 2 examples/hf_trainer_planned.py --plan plan.json   # the plan's per-process batches

hf_trainer_planned.py is hf_trainer_stock.py with the change docs/FRAMEWORKS.md shows (tests/frameworks/test_hf.py
applies that diff to this text and runs both). The planned trainer gives each process its planned batch
(--batch-size is then unused) and keeps the loss an exact mean over all processes' counted tokens. The model is
built from a local config (no download) and the token ids are synthetic (no tokenizer). CPU by default (--cuda
for GPUs).
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments


class SyntheticText(Dataset[dict[str, torch.Tensor]]):
    """``num_samples`` sequences of 8..seq_len random tokens, right-padded to seq_len (labels -100 on padding)."""

    def __init__(self, num_samples: int = 256, seq_len: int = 32, vocab_size: int = 512) -> None:
        self.num_samples, self.seq_len, self.vocab_size = num_samples, seq_len, vocab_size

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(i)  # the same sample on every process
        n = int(torch.randint(8, self.seq_len + 1, (1,), generator=g))
        ids = torch.zeros(self.seq_len, dtype=torch.long)
        ids[:n] = torch.randint(1, self.vocab_size, (n,), generator=g)
        mask = (torch.arange(self.seq_len) < n).long()
        return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


class RecordBatches(TrainerCallback):  # type: ignore[misc]
    """Remembers every training batch's size (the collator sees it), to show what each process ran."""

    def __init__(self) -> None:
        self.sizes: list[int] = []

    def collate(self, features: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        self.sizes.append(len(features))
        return {k: torch.stack([f[k] for f in features]) for k in features[0]}


def get_args_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per process per step")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--num-samples", type=int, default=256, help="size of the synthetic dataset")
    parser.add_argument("--seq-len", type=int, default=32, help="padded sequence length (tokens)")
    parser.add_argument("--accumulate", type=int, default=1, help="gradient accumulation steps")
    parser.add_argument("--out", default="hf-out", help="the Trainer's output_dir")
    parser.add_argument("--cuda", action="store_true", help="train on GPUs (bf16, NCCL) instead of CPU (gloo)")
    parser.add_argument("--seed", type=int, default=0)
    return parser


def train(args: argparse.Namespace) -> dict[str, Any]:
    torch.manual_seed(args.seed)  # the same initial weights on every process
    config = GPT2Config(vocab_size=512, n_positions=args.seq_len, n_embd=64, n_layer=2, n_head=2,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = GPT2LMHeadModel(config)
    record = RecordBatches()
    targs = TrainingArguments(output_dir=args.out, per_device_train_batch_size=args.batch_size,
                              num_train_epochs=args.epochs, gradient_accumulation_steps=args.accumulate,
                              learning_rate=1e-3, use_cpu=not args.cuda, bf16=args.cuda,
                              ddp_backend="nccl" if args.cuda else "gloo", seed=args.seed, report_to="none",
                              save_strategy="no", logging_strategy="no", disable_tqdm=True)
    trainer = Trainer(model=model, args=targs, train_dataset=SyntheticText(args.num_samples, args.seq_len), data_collator=record.collate, callbacks=[record])
    trainer.train()
    return {"rank": targs.process_index, "batch_sizes": record.sizes,
            "params": [p.detach().clone() for p in model.parameters()]}


def main(argv: list[str] | None = None) -> int:
    out = train(get_args_parser().parse_args(argv))
    print(f"rank {out['rank']}: {len(out['batch_sizes'])} steps, batch sizes {sorted(set(out['batch_sizes']))}")
    if torch.distributed.is_initialized():  # the Trainer started it; leaving it to interpreter exit can abort gloo
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
