"""The built-in language-model workload: ``--model tiny_lm[:SIZE]`` and ``--dataset fake_text[:LEN | :MIN-MAX]``.

``tiny_lm`` is a GPT-style decoder in plain torch (token + position embeddings, pre-norm
``nn.TransformerEncoderLayer`` blocks under a causal mask, a head tied to the token embedding), built from a local
size table -- no download and no ``transformers`` (an optional extra). Sizes:

    tiny_lm  / tiny_lm:tiny    d=128, 2 layers,  4 heads, vocab 2048   (~0.7M params; CPU tests)
    tiny_lm:small              d=256, 4 layers,  4 heads, vocab 8192   (~5M; CPU profiling and training)
    tiny_lm:125m               d=768, 12 layers, 12 heads, vocab 32000 (~110M; the GPU benchmark, GPT-2 small)

``fake_text`` is synthetic token data, seeded per index (the same on every rank). A sample is (input ids, target
ids), both ``seq_len`` long; target t is input t+1 (next-token prediction) and -100 (ignored) past the sequence's
real length. ``fake_text`` / ``fake_text:LEN`` gives packed fixed-length sequences (every position counted: the
common pre-training/fine-tuning layout, and the default); ``fake_text:MIN-MAX`` draws each sequence's length
uniformly from [MIN, MAX] and pads it to MAX.

Why padded batches keep the plan right: a padded batch costs what its padded shape costs -- b x seq_len tokens
through every layer whatever the real lengths -- so step time is a function of the sample count alone and the
sample-count plan equalizes it exactly. What changes is the gradient: the loss is a mean over counted (non-padding)
target tokens, so ranks must be weighted by tokens, not samples (runtime.weighting.step_weights; docs/ADOPTING.md).
Length-aware batching (cutting padding by grouping similar lengths) would make a step's cost depend on its
lengths, and is not done here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from planner.errors import ValidationError

IGNORE_INDEX = -100
"""Target id that the loss and the token count skip (torch's and Hugging Face's convention)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class LMConfig:
    """Shape of a tiny_lm decoder."""

    d_model: int
    num_layers: int
    num_heads: int
    vocab_size: int
    default_seq_len: int
    """Sequence length ``fake_text`` uses with this size when it names none."""

    def __post_init__(self) -> None:
        if self.d_model % self.num_heads:
            raise ValidationError(f"tiny_lm: d_model {self.d_model} is not a multiple of {self.num_heads} heads")


LM_SIZES = {
    "tiny": LMConfig(d_model=128, num_layers=2, num_heads=4, vocab_size=2048, default_seq_len=64),
    "small": LMConfig(d_model=256, num_layers=4, num_heads=4, vocab_size=8192, default_seq_len=256),
    "125m": LMConfig(d_model=768, num_layers=12, num_heads=12, vocab_size=32000, default_seq_len=1024),
}


def is_lm_spec(model_spec: str) -> bool:
    return model_spec == "tiny_lm" or model_spec.startswith("tiny_lm:")


def lm_config(model_spec: str) -> LMConfig:
    """The size named by ``tiny_lm[:SIZE]`` (default ``tiny``)."""
    _, _, size = model_spec.partition(":")
    cfg = LM_SIZES.get(size or "tiny")
    if cfg is None:
        raise ValidationError(f"--model {model_spec}: unknown tiny_lm size {size!r}; choose {', '.join(LM_SIZES)}")
    return cfg


class TinyLM(nn.Module):
    """GPT-style causal decoder: ``forward(ids[b, L]) -> logits[b, L, vocab]``. No dropout (deterministic)."""

    def __init__(self, cfg: LMConfig, max_seq_len: int) -> None:
        super().__init__()
        self.cfg, self.max_seq_len = cfg, max_seq_len
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(max_seq_len, cfg.d_model)
        layer = nn.TransformerEncoderLayer(cfg.d_model, cfg.num_heads, dim_feedforward=4 * cfg.d_model, dropout=0.0,
                                           activation="gelu", batch_first=True, norm_first=True)
        # enable_nested_tensor only matters for padding masks, which a causal LM does not use.
        self.blocks = nn.TransformerEncoder(layer, cfg.num_layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.head.weight = self.tok.weight  # tied, as GPT-2: the 125m size lands near GPT-2 small's count
        # GPT-2's embedding init (std 0.02): torch's default N(0, 1) under a tied head starts at a loss of ~80.
        nn.init.normal_(self.tok.weight, std=0.02)
        nn.init.normal_(self.pos.weight, std=0.02)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        length = ids.shape[1]
        if length > self.max_seq_len:
            raise ValidationError(f"tiny_lm: sequence of {length} tokens exceeds its {self.max_seq_len} positions")
        h = self.tok(ids) + self.pos(torch.arange(length, device=ids.device))
        # Position t attends to 0..t only, so padding after a sequence's end never changes its real positions.
        mask = nn.Transformer.generate_square_subsequent_mask(length, device=ids.device, dtype=h.dtype)
        h = self.blocks(h, mask=mask, is_causal=True)
        return self.head(self.norm(h))  # type: ignore[no-any-return]


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over the counted target tokens (targets != -100) of the batch."""
    return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX)


def count_tokens(targets: torch.Tensor) -> torch.Tensor:
    """Counted target tokens of a batch: the weight of its mean loss (runtime.weighting.step_weights)."""
    return (targets != IGNORE_INDEX).sum()


def parse_text_spec(spec: str, default_seq_len: int) -> tuple[int, int]:
    """``fake_text[:LEN | :MIN-MAX]`` -> (min length, padded length)."""
    _, _, arg = spec.partition(":")
    if not arg:
        return default_seq_len, default_seq_len
    lo, sep, hi = arg.partition("-")
    try:
        low, high = (int(lo), int(hi)) if sep else (int(lo), int(lo))
    except ValueError:
        raise ValidationError(f"--dataset {spec}: expected fake_text, fake_text:LEN or fake_text:MIN-MAX "
                              "(token counts), e.g. fake_text:64-256") from None
    if not 2 <= low <= high:
        raise ValidationError(f"--dataset {spec}: sequence lengths need 2 <= MIN <= MAX, got {low}-{high}")
    return low, high


class FakeText(torch.utils.data.Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Synthetic next-token data: sample i is (ids, targets), seeded by i, padded to ``seq_len`` (module docstring)."""

    def __init__(self, num_samples: int, seq_len: int, vocab_size: int, *, min_len: int | None = None,
                 seed: int = 0) -> None:
        self.num_samples, self.seq_len, self.vocab_size = num_samples, seq_len, vocab_size
        self.min_len = seq_len if min_len is None else min_len
        self.seed = seed

    def __len__(self) -> int:
        return self.num_samples

    def length_of(self, i: int) -> int:
        """Counted target tokens of sample i (its real length)."""
        if self.min_len == self.seq_len:
            return self.seq_len
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        return int(torch.randint(self.min_len, self.seq_len + 1, (1,), generator=g))

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= i < self.num_samples:
            raise IndexError(i)
        n = self.length_of(i)
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i + 7_919)
        # Id 0 is the pad token; real tokens are 1..vocab-1. n + 1 tokens give n (input, next-token) pairs.
        seq = torch.randint(1, self.vocab_size, (n + 1,), generator=g)
        ids = torch.zeros(self.seq_len, dtype=torch.long)
        targets = torch.full((self.seq_len,), IGNORE_INDEX, dtype=torch.long)
        ids[:n], targets[:n] = seq[:n], seq[1:]
        return ids, targets


def build_lm(model_spec: str, dataset_spec: str, num_samples: int) -> tuple[Any, Any, LMConfig, int]:
    """(model factory, dataset, size, padded sequence length) for ``--model tiny_lm[:SIZE] --dataset fake_text...``.

    ``--dataset fake`` (the image default) means ``fake_text`` for a language model.
    """
    cfg = lm_config(model_spec)
    if dataset_spec == "fake":
        dataset_spec = "fake_text"
    if dataset_spec != "fake_text" and not dataset_spec.startswith("fake_text:"):
        raise ValidationError(f"--model {model_spec} trains on token data: use --dataset fake_text "
                              f"(or fake_text:LEN, fake_text:MIN-MAX), not {dataset_spec!r}")
    low, high = parse_text_spec(dataset_spec, cfg.default_seq_len)
    dataset = FakeText(num_samples, high, cfg.vocab_size, min_len=low)
    return (lambda: TinyLM(cfg, high)), dataset, cfg, high
