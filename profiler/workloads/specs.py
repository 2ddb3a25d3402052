"""Model and dataset specs (``--model``, ``--dataset``), shared by `planner profile` and `planner train`.

Models:   any torchvision classification name (``resnet18``, ``resnet50``, ``vit_b_16``...), ``mnist_cnn`` and
          ``cifar_cnn`` (small CNNs; cifar_cnn has BatchNorm), ``mlp`` (tiny, for quick CPU runs),
          ``tiny_lm[:tiny|small|125m]`` (a causal LM in plain torch, profiler.workloads.lm), or
          ``package.module:factory`` (called with ``num_classes=`` when it accepts it).
Datasets: ``fake`` (``FakeImages``, torchvision FakeData's images, through a realistic CPU transform pipeline:
          PIL image -> RandomResizedCrop/flip -> ToTensor -> Normalize), ``cifar10:DIR``, ``mnist:DIR``,
          ``imagefolder:DIR`` (local files only, never downloaded), ``fake_text[:LEN|:MIN-MAX]`` (synthetic
          tokens for tiny_lm), or ``package.module:factory`` (returns a Dataset of (x, y)).

    >>> w = build_workload("mlp", "fake")                 # doctest: +SKIP
    >>> x, y = synthetic_batch(w, 32, torch.device("cpu")) # doctest: +SKIP
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from planner.argcheck import GPU_NORMALIZE_CHOICES
from planner.errors import ValidationError
from planner.options import BATCHNORM_MIN_BATCH
from profiler.workloads.lm import build_lm, count_tokens, is_lm_spec, lm_loss

SMALL_MODELS = ("mlp", "mnist_cnn", "cifar_cnn")
DATASET_KINDS = ("fake", "cifar10:DIR", "mnist:DIR", "imagefolder:DIR", "fake_text", "package.module:factory")
IMAGE_DATASETS = ("fake", "cifar10", "mnist", "imagefolder")
"""The built-in image datasets, whose transforms this module owns (``gpu_normalize``)."""
DEFAULT_FAKE_SAMPLES = 8192
AUGMENT_SEED = 1_000_003
"""Base of the per-sample seed of ``fake``'s crop and flip (``IndexSeeded``)."""
BUILTIN_KINDS: dict[str, frozenset[str]] = {
    "--model": frozenset({"tiny_lm"}),
    "--dataset": frozenset({"fake_text", "cifar10", "mnist", "imagefolder"}),
}
"""The ``kind:ARG`` specs resolved from a fixed table; any other ``a:b`` spec imports module ``a``."""


def names_code(spec: str, flag: str) -> bool:
    """True when a ``--model``/``--dataset`` spec names code to import and call (``package.module:factory``).

    Such a spec may come from the command line only: a file (a checkpoint's run record, a profile) can be compared
    with it, never imported from (docs/SECURITY.md).  Built-in names and ``kind:ARG`` specs of ``BUILTIN_KINDS``
    are data: they select from a fixed table.
    """
    return ":" in spec and spec.partition(":")[0] not in BUILTIN_KINDS[flag]

# Default input shape per small model; torchvision models default to 3x224x224.
_SMALL_SHAPES = {"mlp": (1, 28, 28), "mnist_cnn": (1, 28, 28), "cifar_cnn": (3, 32, 32)}
_MEAN_STD = {1: ((0.1307,), (0.3081,)), 3: ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))}


@dataclass(frozen=True, kw_only=True, slots=True)
class Workload:
    """What one training step needs: a model factory, the real dataset, and the loss."""

    model_fn: Callable[[], nn.Module]
    """Builds a fresh, randomly initialized model (on CPU)."""
    dataset: torch.utils.data.Dataset[Any]
    """The real dataset with its CPU transform pipeline (what the dataloader workers run)."""
    num_classes: int
    sample_shape: tuple[int, ...]
    """Shape of one transformed input sample, e.g. (3, 224, 224)."""
    loss_fn: Callable[..., torch.Tensor]
    name: str
    """``model@dataset``, for reports."""
    has_batchnorm: bool
    """True when the model has BatchNorm layers (plans then need min_batch >= 2)."""
    vocab_size: int | None = None
    """Token vocabulary of a language model (inputs and targets are token ids); None for classifiers."""
    normalize: tuple[tuple[float, ...], tuple[float, ...]] | None = None
    """(mean, std) per channel when the dataset hands over uint8 images (``gpu_normalize``): the training process
    moves a quarter of the bytes and normalizes on the device, ``(x / 255 - mean) / std`` (planner.cli.steps.DeviceCopy);
    None: the dataset's tensors are the model's inputs."""
    weight_fn: Callable[[torch.Tensor], torch.Tensor] | None = None
    """weight_fn(targets): what a batch's mean loss averages over when it is not the sample count -- the counted
    tokens of variable-length text (runtime.weighting.step_weights). None: samples (packed text included)."""

    @property
    def min_batch(self) -> int:
        """The smallest local batch the model trains on: ``BATCHNORM_MIN_BATCH`` with BatchNorm, else 1."""
        return BATCHNORM_MIN_BATCH if self.has_batchnorm else 1


class IndexSeeded(torch.utils.data.Dataset[Any]):
    """A dataset whose random transforms draw from the sample's own seed (``AUGMENT_SEED + index``), not from the
    process's generator.

    A DataLoader worker's generator advances with every sample it transforms, and which worker builds which
    batch depends on where the loader started: a run resumed mid-epoch (or whose loader restarted at an epoch
    boundary) gave the same indices other crops and flips, and its weights drifted from the uninterrupted run's
    (0.0275 after a kill -9 and ``--resume``).  Seeded by index, sample i is the same tensor wherever and
    whenever it is built, so a resume is bit-identical.  Used for ``fake``, whose images are a function of the
    index already (FakeImages); the crop and flip still cost the CPU what a real pipeline's do.
    """

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset
        self.classes = getattr(dataset, "classes", None)

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Any:
        # The CPU generator only: the transforms draw from it.  torch.manual_seed would also queue a seed for every
        # CUDA device, which in a process that has not initialized CUDA (a DataLoader worker) records a Python
        # stack each call: 0.19 ms a call here, against 0.6 ms for a whole 16-pixel fake sample.
        with torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed(AUGMENT_SEED + int(index))
            return self.dataset[index]


class FakeImages(torch.utils.data.Dataset[Any]):
    """torchvision's FakeData (the same tensors: image i is ``randn(image_size)`` then its target ``randint``, from
    seed ``i + random_offset``), each image drawn from a generator of its own rather than by re-seeding the
    process's: see IndexSeeded for why not torch.manual_seed."""

    def __init__(self, size: int, image_size: tuple[int, ...], num_classes: int, transform: Any = None,
                 random_offset: int = 0) -> None:
        self.size, self.image_size, self.num_classes = size, image_size, num_classes
        self.transform, self.random_offset = transform, random_offset

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[Any, int]:
        from torchvision.transforms.functional import to_pil_image

        if index >= len(self):
            raise IndexError(f"{type(self).__name__} index out of range")
        g = torch.Generator().manual_seed(index + self.random_offset)
        img = to_pil_image(torch.randn(*self.image_size, generator=g))
        target = int(torch.randint(0, self.num_classes, size=(1,), dtype=torch.long, generator=g)[0])
        return (self.transform(img) if self.transform is not None else img), target


def owns_transforms(model_spec: str, dataset_spec: str) -> bool:
    """True for an image model on a built-in image dataset: the transforms, normalization included, are ours."""
    return not is_lm_spec(model_spec) and dataset_spec.partition(":")[0] in IMAGE_DATASETS


def gpu_normalize_for(choice: str, model_spec: str, dataset_spec: str, device_types: Sequence[str]) -> bool:
    """Whether the workers hand over uint8 images that the training process normalizes (``build_workload``).

    ``auto`` is on when the transforms are ours and every device named is CUDA: a batch of 224-pixel images is
    4 bytes a value as float32 and 1 as uint8, and every byte passes the workers' shared memory, the pin copy and
    PCIe.  On 2x H200 (docs/PERFORMANCE.md) rank 0's 28 workers built a 477-sample batch in
    98.7 ms, and its float batches (287 MB) reached the loop at 2.2 GB/s, 35 ms a step late.  timm's prefetcher
    hands the GPU uint8 batches the same way.  Off on CPU (the normalization would move from the workers into the
    training process) and where a CPU rank trains beside CUDA ones (``device_types`` then holds "cpu"): every rank
    runs the same pipeline.  ``on`` is refused by ``build_workload`` where the transforms are not ours.
    """
    if choice not in GPU_NORMALIZE_CHOICES:
        raise ValidationError(f"--gpu-normalize: expected {', '.join(GPU_NORMALIZE_CHOICES)}, got {choice!r}")
    if choice != "auto":
        return choice == "on"
    return owns_transforms(model_spec, dataset_spec) and bool(device_types) and all(t == "cuda" for t in device_types)


def build_workload(
    model_spec: str,
    dataset_spec: str,
    *,
    image_size: int | None = None,
    num_samples: int | None = None,
    num_classes: int | None = None,
    gpu_normalize: bool = False,
) -> Workload:
    """Build the model factory and dataset named by the specs.

    Args:
        model_spec: see the module docstring.
        dataset_spec: see the module docstring.
        image_size: side of the square input (fake data and imagefolder crops); default per model.
        num_samples: length of the fake dataset (default 8192); ignored for real datasets.
        num_classes: classifier outputs; default from the dataset (fake: 1000 for torchvision models, else 10).
        gpu_normalize: the built-in image datasets end their transforms with uint8 tensors (``PILToTensor``), and
            the workload's ``normalize`` says how the device normalizes them; refused for other datasets.

    Raises:
        ValidationError: unknown spec (the message lists the choices) or a dataset folder that is missing.
    """
    if gpu_normalize and not owns_transforms(model_spec, dataset_spec):
        raise ValidationError(f"--gpu-normalize applies to the built-in image datasets ({', '.join(IMAGE_DATASETS)}), "
                              f"not --dataset {dataset_spec} with --model {model_spec}: a dataset of your own "
                              "normalizes in its own transforms")
    if is_lm_spec(model_spec):
        return _lm_workload(model_spec, dataset_spec, num_samples)
    if dataset_spec.partition(":")[0] == "fake_text":
        raise ValidationError(f"--dataset {dataset_spec} is token data for --model tiny_lm, not {model_spec!r}")
    tv_names = _torchvision_names()
    is_tv = model_spec in tv_names
    if not is_tv and model_spec not in SMALL_MODELS and not names_code(model_spec, "--model"):
        raise ValidationError(
            f"--model: unknown model {model_spec!r}; choose {', '.join(SMALL_MODELS)}, a torchvision classification "
            f"model ({', '.join(sorted(n for n in tv_names if n.startswith('resnet')))}, ...) or package.module:factory"
        )
    default_shape = _SMALL_SHAPES.get(model_spec, (3, 224, 224))
    if image_size is not None:
        default_shape = (default_shape[0], image_size, image_size)
    dataset, shape, ds_classes = _build_dataset(dataset_spec, default_shape, num_samples, num_classes,
                                                default_classes=1000 if is_tv else 10, uint8=gpu_normalize)
    classes = num_classes if num_classes is not None else ds_classes
    model_fn = _model_factory(model_spec, shape, classes, tv_names)
    probe = model_fn()
    has_bn = any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in probe.modules())
    del probe
    return Workload(
        model_fn=model_fn,
        dataset=dataset,
        num_classes=classes,
        sample_shape=shape,
        loss_fn=nn.functional.cross_entropy,
        name=f"{model_spec}@{dataset_spec.split(':')[0]}",
        has_batchnorm=has_bn,
        normalize=_MEAN_STD.get(shape[0], ((0.5,) * shape[0], (0.5,) * shape[0])) if gpu_normalize else None,
    )


def synthetic_batch(
    workload: Workload, batch_size: int, device: torch.device | str, dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random inputs and labels created directly on `device`, so compute timing excludes the loader.

    Language models get full-length token ids and targets (a padded batch costs its padded shape, profiler.workloads.lm)."""
    if workload.vocab_size is not None:
        shape = (batch_size, *workload.sample_shape)
        ids = torch.randint(1, workload.vocab_size, shape, device=device)
        return ids, torch.randint(0, workload.vocab_size, shape, device=device)
    x = torch.randn((batch_size, *workload.sample_shape), device=device, dtype=dtype)
    y = torch.randint(0, workload.num_classes, (batch_size,), device=device)
    return x, y


def _lm_workload(model_spec: str, dataset_spec: str, num_samples: int | None) -> Workload:
    model_fn, dataset, cfg, seq_len = build_lm(model_spec, dataset_spec, num_samples or DEFAULT_FAKE_SAMPLES)
    # Packed sequences count every position: tokens = samples x seq_len, so sample weighting is already exact.
    variable = dataset.min_len < seq_len
    return Workload(model_fn=model_fn, dataset=dataset, num_classes=cfg.vocab_size, sample_shape=(seq_len,),
                    loss_fn=lm_loss, name=f"{model_spec}@fake_text", has_batchnorm=False, vocab_size=cfg.vocab_size,
                    weight_fn=count_tokens if variable else None)


# -- models ----------------------------------------------------------------------------------------------------
def _torchvision_names() -> set[str]:
    import torchvision

    return set(torchvision.models.list_models(module=torchvision.models))


def _model_factory(spec: str, shape: tuple[int, ...], num_classes: int, tv_names: set[str]) -> Callable[[], nn.Module]:
    if spec in tv_names:
        import torchvision

        return lambda: torchvision.models.get_model(spec, weights=None, num_classes=num_classes)
    if spec == "mlp":
        return lambda: _mlp(shape, num_classes)
    if spec == "mnist_cnn":
        return lambda: _mnist_cnn(shape[0], num_classes)
    if spec == "cifar_cnn":
        return lambda: _cifar_cnn(shape[0], num_classes)
    factory = _import_factory(spec, "--model")

    def build() -> nn.Module:
        kw = {"num_classes": num_classes} if _accepts(factory, "num_classes") else {}
        model = factory(**kw)
        if not isinstance(model, nn.Module):
            raise ValidationError(f"--model {spec}: the factory returned {type(model).__name__}, not a torch.nn.Module")
        return model

    return build


def _mlp(shape: tuple[int, ...], num_classes: int) -> nn.Module:
    n_in = 1
    for s in shape:
        n_in *= s
    return nn.Sequential(nn.Flatten(), nn.Linear(n_in, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                         nn.Linear(256, num_classes))


def _mnist_cnn(channels: int, num_classes: int) -> nn.Module:
    # The classic PyTorch MNIST example net; the adaptive pool keeps it valid for any input size.
    return nn.Sequential(
        nn.Conv2d(channels, 32, 3), nn.ReLU(), nn.Conv2d(32, 64, 3), nn.ReLU(), nn.MaxPool2d(2),
        nn.AdaptiveAvgPool2d(12), nn.Flatten(), nn.Linear(64 * 12 * 12, 128), nn.ReLU(), nn.Linear(128, num_classes),
    )


def _cifar_cnn(channels: int, num_classes: int) -> nn.Module:
    def block(cin: int, cout: int) -> list[nn.Module]:
        return [nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True)]

    return nn.Sequential(
        *block(channels, 32), *block(32, 32), nn.MaxPool2d(2),
        *block(32, 64), *block(64, 64), nn.MaxPool2d(2),
        *block(64, 128), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(128, num_classes),
    )


# -- datasets --------------------------------------------------------------------------------------------------
def _transform(shape: tuple[int, ...], *, crop: str, uint8: bool = False) -> Any:
    """The CPU pipeline: crop and flip, then float and normalized (``ToTensor``, ``Normalize``), or uint8
    (``PILToTensor``) for a workload that normalizes on the device."""
    from torchvision import transforms as T

    mean, std = _MEAN_STD.get(shape[0], ((0.5,) * shape[0], (0.5,) * shape[0]))
    size = shape[-1]
    first = (
        [T.RandomCrop(size, padding=size // 8), T.RandomHorizontalFlip()]
        if crop == "pad"
        else [T.RandomResizedCrop(size, scale=(0.35, 1.0), antialias=True), T.RandomHorizontalFlip()]
    )
    return T.Compose([*first, T.PILToTensor()] if uint8 else [*first, T.ToTensor(), T.Normalize(mean, std)])


def _build_dataset(
    spec: str, shape: tuple[int, ...], num_samples: int | None, num_classes: int | None, *, default_classes: int,
    uint8: bool = False,
) -> tuple[Any, tuple[int, ...], int]:
    import torchvision

    kind, _, arg = spec.partition(":")
    if spec == "fake":
        classes = num_classes or default_classes
        # The source image is larger than the crop, as with real photos (256 -> 224), so the crop resizes.
        src = (shape[0], shape[1] + shape[1] // 7, shape[2] + shape[2] // 7)
        ds = FakeImages(num_samples or DEFAULT_FAKE_SAMPLES, src, classes,
                        _transform(shape, crop="resized", uint8=uint8))
        return IndexSeeded(ds), shape, classes
    if kind in ("cifar10", "mnist", "imagefolder"):
        if not arg:
            raise ValidationError(f"--dataset {spec}: give the folder, e.g. --dataset {kind}:/data/{kind}")
        if not os.path.isdir(arg):
            raise ValidationError(f"--dataset {spec}: folder {arg!r} does not exist (datasets are never downloaded)")
        try:
            if kind == "cifar10":
                shape = (3, 32, 32)
                ds = torchvision.datasets.CIFAR10(arg, train=True, download=False,
                                                  transform=_transform(shape, crop="pad", uint8=uint8))
                return ds, shape, 10
            if kind == "mnist":
                shape = (1, 28, 28)
                ds = torchvision.datasets.MNIST(arg, train=True, download=False,
                                                transform=_transform(shape, crop="pad", uint8=uint8))
                return ds, shape, 10
            shape = (3, shape[1], shape[2]) if shape[0] == 3 else (3, 224, 224)
            ds = torchvision.datasets.ImageFolder(arg, transform=_transform(shape, crop="resized", uint8=uint8))
            return ds, shape, len(ds.classes)
        except (RuntimeError, FileNotFoundError) as e:
            raise ValidationError(f"--dataset {spec}: cannot open {kind} data in {arg!r} ({e}); "
                                  "download it yourself first") from None
    if names_code(spec, "--dataset"):
        factory = _import_factory(spec, "--dataset")
        ds = factory()
        if not (hasattr(ds, "__len__") and hasattr(ds, "__getitem__")) or isinstance(ds, (str, bytes)):
            raise ValidationError(f"--dataset {spec}: the factory returned {type(ds).__name__}, not a dataset (an "
                                  "object with __len__ and __getitem__ giving (tensor, label) pairs)")
        if len(ds) == 0:
            raise ValidationError(f"--dataset {spec}: the factory returned an empty dataset")
        first = ds[0]
        if not (isinstance(first, (tuple, list)) and len(first) == 2 and isinstance(first[0], torch.Tensor)):
            raise ValidationError(f"--dataset {spec}: samples must be (tensor, label) pairs, got "
                                  f"{type(first).__name__} {str(first)[:40]!r}")
        x = first[0]
        classes = num_classes or int(len(getattr(ds, "classes", [])) or default_classes)
        return ds, tuple(x.shape), classes
    raise ValidationError(f"--dataset: unknown dataset {spec!r}; choose one of {', '.join(DATASET_KINDS)}")


def _import_factory(spec: str, flag: str) -> Callable[..., Any]:
    mod_name, _, attr = spec.partition(":")
    if not mod_name or not attr:
        raise ValidationError(f"{flag} {spec}: expected package.module:factory")
    _current_folder_first(mod_name)
    try:
        module = importlib.import_module(mod_name)
    except ImportError as e:
        raise ValidationError(f"{flag} {spec}: cannot import {mod_name!r} ({e})") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValidationError(f"{flag} {spec}: {mod_name!r} has no callable {attr!r}")
    return fn  # type: ignore[no-any-return]


def _current_folder_first(mod_name: str) -> None:
    """Put the current folder first on sys.path when it holds the named module (``./mymodel.py`` or
    ``./mymodel/``), as ``python -m`` does: the ``planner`` console script's sys.path starts at its own bin/ folder,
    so ``--model mymodel:build`` would otherwise need PYTHONPATH=. (only the module the user named is affected)."""
    top = mod_name.split(".")[0]
    cwd = os.getcwd()
    if os.path.isfile(os.path.join(cwd, f"{top}.py")) or os.path.isdir(os.path.join(cwd, top)):
        if cwd not in sys.path and "" not in sys.path:
            sys.path.insert(0, cwd)


def _accepts(fn: Callable[..., Any], name: str) -> bool:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
