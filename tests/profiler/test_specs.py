"""--model / --dataset specs, the step runner on CPU, the loader cost, and the comm bucket math."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest
import torch
from torch import nn

from planner.errors import ValidationError
from profiler.comm import DDP_BUCKET_BYTES, bucket_sizes
from profiler.compute import StepRunner
from profiler.inventory import device_facts, host_profile
from profiler.loader import LoaderOptions, profile_loader, worker_counts
from profiler.workloads.specs import build_workload, gpu_normalize_for, synthetic_batch


@pytest.mark.parametrize(
    ("model", "shape", "classes", "bn"),
    [("mlp", (1, 28, 28), 10, False), ("mnist_cnn", (1, 28, 28), 10, False), ("cifar_cnn", (3, 32, 32), 10, True)],
)
def test_small_models_on_fake_data(model: str, shape: tuple[int, ...], classes: int, bn: bool) -> None:
    w = build_workload(model, "fake", num_samples=8)
    assert (w.sample_shape, w.num_classes, w.has_batchnorm) == (shape, classes, bn)
    assert len(w.dataset) == 8  # type: ignore[arg-type]
    x, y = w.dataset[3]
    assert tuple(x.shape) == shape and 0 <= int(y) < classes
    xb, yb = synthetic_batch(w, 4, "cpu")
    assert w.model_fn()(xb).shape == (4, classes) and yb.shape == (4,)


def test_torchvision_model_and_image_size() -> None:
    w = build_workload("resnet18", "fake", image_size=32, num_classes=7, num_samples=4)
    assert w.sample_shape == (3, 32, 32) and w.num_classes == 7 and w.has_batchnorm
    assert w.model_fn()(synthetic_batch(w, 2, "cpu")[0]).shape == (2, 7)


def test_factory_specs(monkeypatch: pytest.MonkeyPatch) -> None:
    mod = types.ModuleType("my_specs_mod")
    mod.net = lambda num_classes=3: nn.Sequential(nn.Flatten(), nn.Linear(5, num_classes))  # type: ignore[attr-defined]
    mod.data = lambda: torch.utils.data.TensorDataset(torch.randn(6, 5), torch.zeros(6, dtype=torch.long))  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "my_specs_mod", mod)
    w = build_workload("my_specs_mod:net", "my_specs_mod:data", num_classes=4)
    assert w.sample_shape == (5,) and w.num_classes == 4
    assert w.model_fn()(torch.randn(2, 5)).shape == (2, 4)


def test_unknown_and_missing_specs(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="mlp, mnist_cnn, cifar_cnn"):
        build_workload("resnet9000", "fake")
    with pytest.raises(ValidationError, match="fake, cifar10:DIR"):
        build_workload("mlp", "svhn")
    with pytest.raises(ValidationError, match="does not exist"):
        build_workload("mlp", "mnist:/no/such/dir")
    with pytest.raises(ValidationError, match="cannot open cifar10"):
        build_workload("mlp", f"cifar10:{tmp_path}")  # exists but empty: never downloaded
    with pytest.raises(ValidationError, match="cannot import"):
        build_workload("no_such_pkg.mod:f", "fake")


def test_step_runner_trains_and_reports_sizes() -> None:
    w = build_workload("mlp", "fake", num_samples=8)
    r = StepRunner(w, "cpu")
    before = [p.detach().clone() for p in r.model.parameters()]
    m = r.measure(16, 1, 3)
    assert len(m.times_s) == 3 and all(t > 0 for t in m.times_s) and m.peak_bytes is None
    assert any(not torch.equal(a, b) for a, b in zip(before, r.model.parameters(), strict=True))  # SGD stepped
    assert r.grad_bytes == 4 * r.num_params and r.fits(8)
    r.close()


def test_loader_cost_and_host_facts() -> None:
    w = build_workload("mlp", "fake", num_samples=64)
    lp, meta = profile_loader(w.dataset, LoaderOptions(num_samples=32, chunk=8, scaling_s=0.0))
    assert lp.sec_per_sample > 0 and lp.scaling == () and meta["loader_samples_timed"] >= 8
    assert worker_counts(6) == [1, 2, 4, 6] and worker_counts(1) == [1]
    h = host_profile()
    assert h.cpu_cores >= 1 and h.name
    name, facts = device_facts(torch.device("cpu"))
    assert name.startswith("CPU") and facts["torch_threads"] >= 1


def test_bucket_sizes_match_ddp_buckets() -> None:
    per = DDP_BUCKET_BYTES // 4
    assert bucket_sizes(4 * per * 2 + 40) == [per, per, 10]
    assert bucket_sizes(400) == [100]
    assert sum(bucket_sizes(97_000_000)) == 97_000_000 // 4


class _OomAbove(nn.Module):
    """Raises CUDA's out-of-memory error above a batch size, so the OOM path runs on CPU."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit = limit
        self.lin = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > self.limit:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")
        return self.lin(x)


def test_out_of_memory_is_caught_and_the_largest_batch_found() -> None:
    from profiler.memory import find_max_batch
    from profiler.sweep import SweepOptions, run_sweep
    from profiler.workloads.specs import Workload

    w = Workload(model_fn=lambda: _OomAbove(40), dataset=torch.utils.data.TensorDataset(torch.zeros(1, 4)),
                 num_classes=3, sample_shape=(4,), loss_fn=nn.functional.cross_entropy, name="oom", has_batchnorm=False)
    r = StepRunner(w, "cpu")
    res = run_sweep(r.measure, SweepOptions(max_batch=256, min_repeats=1, max_repeats=2), clock=lambda: 0.0)
    assert [p.batch_size for p in res.points] == [8, 12, 16, 24, 32] and res.oom_batch == 48
    assert find_max_batch(res, r.fits, rel_tol=0.0) == 40
    r.measure(16, 0, 1)  # the runner still works after the failures


def test_gpu_normalize_hands_over_uint8_and_the_device_copy_restores_the_inputs() -> None:
    """--gpu-normalize: the workers' last transform is PILToTensor (a quarter of the bytes), and DeviceCopy's
    (x / 255 - mean) / std gives the float pipeline's inputs, crop and flip for crop and flip."""
    from planner.cli.steps import DeviceCopy

    floats = build_workload("cifar_cnn", "fake", num_samples=8)
    uint8 = build_workload("cifar_cnn", "fake", num_samples=8, gpu_normalize=True)
    assert floats.normalize is None and uint8.normalize == ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
    torch.manual_seed(3)
    want = torch.stack([floats.dataset[i][0] for i in range(4)])
    torch.manual_seed(3)
    raw = torch.stack([uint8.dataset[i][0] for i in range(4)])
    assert raw.dtype == torch.uint8 and raw.shape == want.shape and raw.element_size() * 4 == want.element_size()
    x, _ = DeviceCopy(torch.device("cpu"), channels_last=True, normalize=uint8.normalize)(raw, torch.zeros(4))
    assert x.dtype == torch.float32 and x.is_contiguous(memory_format=torch.channels_last)
    assert torch.allclose(x, want, atol=1e-5)
    # float inputs (synthetic batches, other datasets) pass untouched
    same, _ = DeviceCopy(torch.device("cpu"), normalize=uint8.normalize)(want, torch.zeros(4))
    assert torch.equal(same, want)


@pytest.mark.parametrize(("model", "dataset"), [("tiny_lm", "fake_text"), ("mlp", "tests.profiler.test_specs:nothing")])
def test_gpu_normalize_is_refused_where_the_transforms_are_not_ours(model: str, dataset: str) -> None:
    with pytest.raises(ValidationError, match="--gpu-normalize applies to the built-in image datasets"):
        build_workload(model, dataset, gpu_normalize=True)
    assert gpu_normalize_for("auto", model, dataset, ["cuda"]) is False  # auto leaves such data alone


@pytest.mark.parametrize(("choice", "devices", "want"), [
    ("auto", ["cuda"], True), ("auto", ["cuda", "cuda"], True),
    ("auto", ["cpu"], False),  # the normalization would move from the workers into the training process
    ("auto", ["cuda", "cpu"], False), ("auto", [], False),  # a CPU rank beside CUDA ones: one pipeline for all
    ("on", ["cpu"], True), ("off", ["cuda"], False)])
def test_gpu_normalize_auto_is_on_where_every_rank_trains_on_cuda(choice: str, devices: list[str], want: bool) -> None:
    assert gpu_normalize_for(choice, "resnet50", "fake", devices) is want
    assert gpu_normalize_for(choice, "cifar_cnn", "imagefolder:/data", devices) is want


def test_gpu_normalize_refuses_an_unknown_choice() -> None:
    with pytest.raises(ValidationError, match="--gpu-normalize: expected auto, on, off, got 'yes'"):
        gpu_normalize_for("yes", "resnet50", "fake", ["cuda"])


def test_fake_images_are_torchvisions_fake_data_drawn_without_reseeding_the_process() -> None:
    import torch
    import torchvision

    from profiler.workloads.specs import FakeImages

    ours = FakeImages(size=8, image_size=(3, 9, 9), num_classes=7, transform=torchvision.transforms.ToTensor())
    theirs = torchvision.datasets.FakeData(size=8, image_size=(3, 9, 9), num_classes=7,
                                           transform=torchvision.transforms.ToTensor())
    torch.manual_seed(123)
    state = torch.get_rng_state()
    for i in (0, 3, 7):
        (a, ya), (b, yb) = ours[i], theirs[i]
        assert torch.equal(a, b) and ya == yb
    assert torch.equal(torch.get_rng_state(), state)  # neither moved the process's generator
