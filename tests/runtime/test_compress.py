"""Weighted gradient compression (runtime/compress.py) over gloo, uneven batches [7, 3].

The weighted bf16/fp16 hook must equal torch's own compress hook applied to the exact weighted gradient (the loss
scaled by n_i * W / n, DDP averaging over W) to the wire dtype's rounding, and keep a large uneven gradient finite
in fp16 where casting before scaling overflows. The uncompressed hook's fp64 exactness is tests/runtime/
test_weighting.py's.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from planner.errors import ValidationError
from runtime.compress import COMPRESSIONS, WIRE_DTYPES, stock_compress_hook
from runtime.sampler import HeteroBatchSampler
from runtime.weighting import loss_scale, register_weighted_hook
from tests._dist import run_distributed

SIZES = [7, 3]
N = 40


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 2))


def _grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.detach().clone() for p in model.parameters() if p.grad is not None]


def _one_step(rank: int, mode: str, wire: str, device: str) -> tuple[list[torch.Tensor], float | None]:
    """Gradients after one DDP backward on step 0's batch: 'weighted' (our hook, compress=wire), 'stock' (the loss
    scaled by n_i * W / n, torch's compress hook) or 'exact' (our hook, uncompressed)."""
    g = torch.Generator().manual_seed(5)
    x, y = (torch.randn(N, 4, generator=g) * 3).to(device), torch.randn(N, 2, generator=g).to(device)
    sampler = HeteroBatchSampler(N, SIZES, rank, seed=3)
    model = _mlp().to(device)
    ddp = DDP(model, bucket_cap_mb=1e-6)  # one bucket per parameter: the step bookkeeping sees several buckets
    state = None
    if mode == "stock":
        ddp.register_comm_hook(None, stock_compress_hook(wire))  # type: ignore[arg-type]
    else:
        state = register_weighted_hook(ddp, sampler, compress=wire if mode == "weighted" else "none")
    idx = next(iter(sampler))
    loss = F.mse_loss(ddp(x[idx]), y[idx])
    if mode == "stock":
        loss = loss * loss_scale(sampler, 0)
    loss.backward()
    if state is not None:
        assert state.num_syncs == 1
    return _grads(model), None if state is None else state.last_factor


def compress_worker(rank: int, world: int, device: str = "cpu") -> None:
    for wire in ("bf16", "fp16"):
        eps = torch.finfo(WIRE_DTYPES[wire]).eps
        weighted, factor = _one_step(rank, "weighted", wire, device)
        stock, _ = _one_step(rank, "stock", wire, device)
        exact, _ = _one_step(rank, "exact", wire, device)
        assert factor == pytest.approx(SIZES[rank] / sum(SIZES))
        differs = False
        for w, s, e in zip(weighted, stock, exact, strict=True):
            scale = float(e.abs().max())
            # to the wire's rounding: one cast per rank and the sum in the wire dtype
            torch.testing.assert_close(w, s, rtol=2 * eps, atol=2 * eps * scale)
            torch.testing.assert_close(w, e, rtol=2 * eps, atol=2 * eps * scale)
            differs |= not torch.equal(w, e)
            assert w.dtype == torch.float32  # back in the parameters' dtype
        assert differs, f"{wire}: the compressed gradients equal the fp32 ones bit for bit: nothing was compressed"


def overflow_worker(rank: int, world: int) -> None:
    """Rank 0's mean-loss gradient 70000 (> fp16's 65504), rank 1's 20000: the weighted sum 0.7 * 70000 + 0.3 *
    20000 = 55000 fits fp16; casting before scaling does not (70000, or 1.4 * 70000 loss-scaled, is inf)."""
    sampler = HeteroBatchSampler(N, SIZES, rank, seed=3)
    value = 70000.0 if rank == 0 else 20000.0

    def grad(mode: str) -> float:
        model = nn.Linear(1, 1, bias=False)
        with torch.no_grad():
            model.weight.fill_(1.0)
        ddp = DDP(model)
        if mode == "stock":
            ddp.register_comm_hook(None, stock_compress_hook("fp16"))  # type: ignore[arg-type]
        else:
            register_weighted_hook(ddp, sampler, compress=mode)
        idx = next(iter(sampler))
        loss = ddp(torch.full((len(idx), 1), value)).mean()  # d loss / d w = value
        if mode == "stock":
            loss = loss * loss_scale(sampler, 0)
        loss.backward()
        assert model.weight.grad is not None
        return float(model.weight.grad)

    assert grad("none") == pytest.approx(55000.0)
    assert grad("fp16") == pytest.approx(55000.0, rel=torch.finfo(torch.float16).eps)
    assert grad("bf16") == pytest.approx(55000.0, rel=torch.finfo(torch.bfloat16).eps)
    assert grad("stock") == float("inf")  # cast first: 1.4 * 70000 overflows on rank 0


@pytest.mark.distributed
def test_weighted_compression_equals_torch_hook_on_the_weighted_gradient() -> None:
    run_distributed(compress_worker, 2, timeout_s=120)


@pytest.mark.distributed
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_weighted_compression_on_a_shared_gpu() -> None:
    """Two ranks on one GPU over gloo, as `planner train` runs them (planner.cli.distenv.shares_gpu): gloo's CUDA
    all-reduce goes through host memory on its own stream, and the hook must still return the weighted sum."""
    run_distributed(compress_worker, 2, "cuda:0", timeout_s=180)


@pytest.mark.distributed
def test_fp16_scale_first_keeps_an_uneven_large_gradient_finite() -> None:
    run_distributed(overflow_worker, 2, timeout_s=120)


def test_unknown_compression_is_refused() -> None:
    sampler = HeteroBatchSampler(N, SIZES, 0, seed=3)
    with pytest.raises(ValidationError, match="bf16"):
        register_weighted_hook(object(), sampler, compress="int8")  # type: ignore[arg-type]
    assert COMPRESSIONS[0] == "none"


def test_train_config_and_run_log_carry_the_compression() -> None:
    from planner.cli.train_config import GRAD_COMPRESSIONS, TrainConfig
    from planner.runlog import StartRecord, parse_record

    assert GRAD_COMPRESSIONS == COMPRESSIONS
    assert TrainConfig().grad_compress == "none"  # never on unless asked
    assert TrainConfig(grad_compress="bf16").agreed_settings()["--grad-compress"] == "bf16"
    with pytest.raises(ValidationError, match="grad_compress"):
        TrainConfig(grad_compress="int8")
    with pytest.raises(ValidationError, match="FSDP2"):
        TrainConfig(grad_compress="bf16", fsdp=True)
    plain = StartRecord(time=1.0, world_size=2, global_batch=10).to_dict()
    assert "grad_compress" not in plain  # an uncompressed log reads as before
    parsed = parse_record(plain)
    assert isinstance(parsed, StartRecord) and parsed.grad_compress == "none"
    d = StartRecord(time=1.0, world_size=2, global_batch=10, grad_compress="bf16").to_dict()
    parsed = parse_record(d)
    assert d["grad_compress"] == "bf16" and isinstance(parsed, StartRecord) and parsed.grad_compress == "bf16"


def test_plan_ddp_settings_are_checked() -> None:
    from planner.cli.train_config import ddp_settings_from

    assert ddp_settings_from({}) == {}
    assert ddp_settings_from({"ddp": {"bucket_cap_mb": 100, "static_graph": True}}) == {
        "bucket_cap_mb": 100.0, "static_graph": True}
    for bad, match in (({"find_unused_parameters": True}, "not a DDP setting"), ({"bucket_cap_mb": 0}, r"\[1, 1024\]"),
                       ({"bucket_cap_mb": True}, "MiB"), ({"static_graph": "yes"}, "true or false")):
        with pytest.raises(ValidationError, match=match):
            ddp_settings_from({"ddp": bad})
    with pytest.raises(ValidationError, match="object"):
        ddp_settings_from({"ddp": [1]})
