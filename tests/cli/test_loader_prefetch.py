"""planner.cli.steps.loader_prefetch: a rank's in-flight DataLoader batches sized to the host's shared memory.

Each DataLoader worker hands its batches over in /dev/shm and keeps up to ``prefetch_factor`` of them ready.  With
no fixed worker cap a loader-bound rank may run 28 workers: at ResNet-50's 224 px and batch 465 that is
28 x 4 batches of 267 MiB, 29 GiB of shared memory; a docker container's --shm-size of 8 GiB would see its
DataLoader die of a bus error mid-epoch.  `planner train` lowers the prefetch until the batches fit, and says so.
"""

from __future__ import annotations

import pytest
import torch

import planner.cli.steps as steps
from planner.cli.steps import LOADER_PREFETCH, SHM_SHARE, loader_prefetch, make_loader, tensor_nbytes
from planner.cli.train_config import TrainConfig
from profiler.workloads.specs import build_workload

GIB = 2**30
IMAGE = 3 * 224 * 224 * 4  # one ResNet-50 sample, float32


def test_fits_keeps_the_prefetch() -> None:
    # A 2x H100 host: 128 GiB of /dev/shm, 2 ranks; rank 0 with 28 workers at batch 465.
    assert loader_prefetch(28, 465 * IMAGE, 128 * GIB, 2) == (LOADER_PREFETCH, None)
    assert loader_prefetch(0, 465 * IMAGE, 1, 2) == (LOADER_PREFETCH, None)  # no workers: nothing in shm
    assert loader_prefetch(28, 465 * IMAGE, None, 2) == (LOADER_PREFETCH, None)  # no /dev/shm: torch's behaviour


def test_lowered_to_what_fits_with_the_numbers() -> None:
    batch = 465 * IMAGE
    free = 64 * GIB  # 16 GiB a rank of 2 at SHM_SHARE 0.5: 61 batches
    p, note = loader_prefetch(28, batch, free, 2)
    share = SHM_SHARE * free / 2
    assert p == int(share // batch - 2) // 28 == 2
    assert 28 * p + 2 <= share / batch < 28 * (p + 1) + 2
    assert note is not None and note.startswith("note:") and "from 4 to 2" in note and "267 MiB" in note


def test_warns_when_even_one_batch_a_worker_does_not_fit() -> None:
    p, warning = loader_prefetch(28, 465 * IMAGE, 8 * GIB, 2)  # docker --shm-size 8g: 7 batches a rank
    assert p == 1 and warning is not None and warning.startswith("warning:")
    assert "--shm-size" in warning and "--max-workers-per-rank 5" in warning


def test_tensor_nbytes() -> None:
    x = torch.zeros(3, 4, dtype=torch.float32)
    assert tensor_nbytes((x, 7)) == 48
    assert tensor_nbytes({"a": x, "b": [x, torch.zeros(2, dtype=torch.int64)]}) == 48 + 48 + 16
    assert tensor_nbytes("text") == 0


def test_make_loader_applies_it(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A real DataLoader over the fake CIFAR-size workload: its prefetch follows the shared memory there is."""
    workload = build_workload("cifar_cnn", "fake", num_samples=64)
    sample = tensor_nbytes(workload.dataset[0])
    cfg = TrainConfig(model="cifar_cnn")
    said: list[str] = []
    sampler = [list(range(16))] * 2
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    monkeypatch.setattr(steps, "shm_free_bytes", lambda: None)
    roomy = make_loader(cfg, workload, sampler, 2, torch.device("cpu"), batch_size=16, say=said.append)
    assert roomy.loader.prefetch_factor == LOADER_PREFETCH and said == []
    tight = int((2 * 2 + 2) * 16 * sample / SHM_SHARE) + 1  # room for 2 workers x 2 batches and the loop's two
    monkeypatch.setattr(steps, "shm_free_bytes", lambda: tight)
    loader = make_loader(cfg, workload, sampler, 2, torch.device("cpu"), batch_size=16, say=said.append)
    assert loader.loader.prefetch_factor == 2 and len(said) == 1 and "from 4 to 2" in said[0]
    assert sum(len(x) for x, _y in loader) == 32  # and it still loads


def test_make_loader_lets_the_dataloader_pin_on_cuda() -> None:
    """On CUDA the DataLoader pins (pin_memory=True: its thread pins batches in the order the workers finish them,
    measured faster on a loader-fed rank than pinning in step order or not pinning); off CUDA nothing is pinned.
    Built, not iterated: a CPU-only torch cannot pin."""
    workload = build_workload("cifar_cnn", "fake", num_samples=64)
    sampler = [list(range(16))] * 2
    own = make_loader(TrainConfig(model="cifar_cnn"), workload, sampler, 2, torch.device("cuda", 0))
    assert own.pin_device is None and own.loader.pin_memory
    cpu = make_loader(TrainConfig(model="cifar_cnn"), workload, sampler, 2, torch.device("cpu"))
    assert cpu.pin_device is None and not cpu.loader.pin_memory


def test_the_pinning_and_nice_switches_measured_not_to_help_are_gone() -> None:
    import argparse

    import pytest

    from planner.cli.cmd_train import add_arguments

    p = argparse.ArgumentParser()
    add_arguments(p)
    base = ["--plan", "plan.json"]
    for gone in (["--pin-ahead"], ["--no-pin-memory"], ["--loader-nice", "10"], ["--dataloader-pin-memory"]):
        with pytest.raises(SystemExit):
            p.parse_args([*base, *gone])


@pytest.mark.slow
def test_gc_pauses_are_timed_per_generation_and_cleared_when_taken() -> None:
    import gc
    import time

    from planner.cli.steps import GcPauses

    watch = GcPauses(min_ms=0.0)
    try:
        t0 = time.perf_counter()
        junk = [[i] for i in range(20000)]  # something for a full collection to walk
        gc.collect()
        del junk
        got = watch.take(t0)
        assert got["collections"][2] >= 1
        full = [p for p in got["pauses"] if p[2] == 2]
        assert full and all(p[0] >= 0 and p[1] >= 0 for p in full)  # ms after t0, ms long
        assert watch.take(t0)["collections"][2] == 0  # taken: the full collection is not counted again
    finally:
        watch.close()
    assert watch._on_gc not in gc.callbacks


def test_the_command_line_normalizes_on_the_gpu_where_every_rank_trains_on_cuda() -> None:
    """--gpu-normalize auto (the default): uint8 images on CUDA ranks under NCCL; the workers normalize on a CPU rank,
    on every rank of a CPU + CUDA job (gloo), and with --gpu-normalize off (profiler.workloads.specs.gpu_normalize_for)."""
    import argparse
    from types import SimpleNamespace

    from planner.cli.cmd_train import add_arguments, config_from_args

    p = argparse.ArgumentParser()
    add_arguments(p)
    base = ["--plan", "plan.json", "--model", "resnet18", "--lr", "0.1"]

    def normalized(argv: list[str], device: str, backend: str, shared_gpu: bool = False) -> bool:
        env = SimpleNamespace(rank=0, device=torch.device(device), backend=backend, shared_gpu=shared_gpu)
        return bool(config_from_args(p.parse_args(argv), env, {}, {}).gpu_normalize)

    assert normalized(base, "cuda:0", "nccl")
    assert not normalized(base, "cuda:0", "gloo")  # a CPU rank trains beside this one: one pipeline for all
    assert normalized(base, "cuda:0", "gloo", shared_gpu=True)  # ranks sharing a GPU: every rank is on CUDA
    assert not normalized(base, "cpu", "gloo")
    assert not normalized([*base, "--gpu-normalize", "off"], "cuda:0", "nccl")
    assert normalized([*base, "--gpu-normalize"], "cpu", "gloo")  # the bare flag is "on", as before
    assert not normalized([*base, "--dataset", "tests.profiler.test_specs:nothing"], "cuda:0", "nccl")
