"""Atomic checkpoints: model, optimizer, sampler position, plan and re-plan state in one file.

Written by rank 0 to ``DIR/checkpoint.pt`` through a temp file and ``os.replace``, so a kill -9 at any moment
leaves either the previous checkpoint or the new one, never a torn file.  A full disk is one line naming the file
(the previous checkpoint kept, the temp file removed); a killed save's temp file is removed by the next run.

A checkpoint is data, never code (docs/SECURITY.md): it holds only tensors, numbers, strings, bools, None, lists,
tuples and dicts, and is read with ``torch.load(..., weights_only=True)``, whose unpickler refuses every global
outside torch's tensor allowlist. A file whose pickle names anything else (a ``__reduce__`` payload, a numpy
scalar, an object from an older format) is refused with one line before any of it is built -- nothing in it runs.
"""

from __future__ import annotations

import math
import os
import re
import tempfile
import warnings
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from planner.argcheck import MAX_COUNT, MAX_IMAGE_SIZE
from planner.errors import ValidationError
from planner.paths import write_all, write_error
from planner.plan import Plan
from planner.shown import shown_apart
from runtime.sampler import MAX_EPOCH

CHECKPOINT_NAME = "checkpoint.pt"
TEMP_PREFIX = ".checkpoint."
"""A save writes ``.checkpoint.XXXXXXXX.tmp`` beside the checkpoint, then renames it over ``checkpoint.pt``."""
# The on-disk layout (the keys below, the plan/sampler/replanner as JSON-able data) is unchanged since version 1;
# only the loader became strict, so checkpoints of version 1 that hold plain data still resume.
CHECKPOINT_VERSION = 1
MAX_STEP = 1 << 40
"""Bound on a saved step and on the run record's counts: beyond any real run, within int64 arithmetic."""
_KEYS = ("version", "epoch", "step", "model", "optimizer", "plan", "sampler", "replanner")

# Exact types, not isinstance: a float or int subclass (np.float64, an IntEnum) pickles under its own class name,
# which weights_only refuses, so our own save would write a file our own load cannot read.
_SCALARS = (bool, int, float, str, type(None))
_DICTS = (dict, OrderedDict)  # model.state_dict() is an OrderedDict; weights_only rebuilds it, _metadata included
_TENSORS = (torch.Tensor, torch.nn.Parameter)
# Before 2.6 a crafted file could run code despite weights_only=True (CVE-2025-32434), so older torch is refused.
_SAFE_LOAD_TORCH = (2, 6)


def save_checkpoint(directory: str | os.PathLike[str], *, epoch: int, step: int, model: torch.nn.Module,
                    optimizer: torch.optim.Optimizer, plan: Plan, sampler_state: dict[str, Any] | None,
                    replanner: Any = None, run: dict[str, Any] | None = None,
                    profile: dict[str, Any] | None = None) -> Path:
    """Save where training resumes: `epoch` and `step` are the next step to run.

    ``run``: what the run was started with (model, lr, global batch, plan fingerprint...), JSON-able; a resume
    compares it with its own command line (planner/cli/preflight.py) instead of silently taking the checkpoint's.
    ``profile``: the profile the plan was solved on, as JSON (``Profile.to_dict``): an elastic restart takes the
    curves of the ranks it already measured from it (planner/cli/elastic.py).
    """
    d = Path(directory)
    try:
        d.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise write_error(d / CHECKPOINT_NAME, e) from None
    state = {
        "version": CHECKPOINT_VERSION,
        "epoch": int(epoch),
        "step": int(step),
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        # The JSON-able parts are copied as plain data (numpy scalars -> Python numbers, tuples -> lists), the
        # same values a JSON round trip would give.
        "plan": _plain(plan.to_dict(), "plan"),
        "sampler": _plain(sampler_state, "sampler"),
        "replanner": _plain(replanner.state_dict(), "replanner") if replanner is not None else None,
        "run": _plain(run, "run"),
        "profile": _plain(profile, "profile"),
    }
    _check_data_only(state, "checkpoint")  # our invariant: what we write, load_checkpoint can read back
    target = d / CHECKPOINT_NAME
    try:
        fd, tmp = tempfile.mkstemp(prefix=TEMP_PREFIX, suffix=".tmp", dir=d)
    except OSError as e:
        raise write_error(target, e) from None
    try:
        try:
            torch.save(state, _FdWriter(fd))  # type: ignore[arg-type]  # a file object, not a path: torch's own writer hides the errno
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, target)
    except BaseException as e:
        # Ctrl-C or SIGTERM mid-save included (planner/lifetime.py); a kill -9's temp file is removed by the next
        # run that holds the folder (planner.paths.hold_exclusive(stale_prefix=TEMP_PREFIX)).
        if os.path.exists(tmp):
            os.unlink(tmp)
        if isinstance(e, OSError):  # a full disk: one line naming the file, the previous checkpoint kept
            raise write_error(target, e) from None
        raise
    return target


class _FdWriter:
    """What ``torch.save`` writes to: every byte through planner.paths.write_all, so a failed write is an OSError
    with its errno (``torch.save`` to a path turned ENOSPC into "unexpected pos 704 vs 598")."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def write(self, data: bytes) -> int:
        write_all(self.fd, data)
        return len(data)

    def flush(self) -> None:
        pass


def load_checkpoint(directory: str | os.PathLike[str], device: torch.device) -> dict[str, Any] | None:
    """The saved state, or None when the folder holds no checkpoint yet (a fresh start).

    Raises ValidationError (one line naming the file and the fix) for a file this version did not write: one
    holding objects other than tensors and plain data, an unreadable or truncated one, or one of another layout.
    """
    path = Path(directory) / CHECKPOINT_NAME
    if not path.exists():
        return None
    have = tuple(int(x) for x in re.findall(r"\d+", torch.__version__)[:2])
    if have < _SAFE_LOAD_TORCH:
        raise ValidationError(f"{path}: refused: resuming needs torch >= {'.'.join(map(str, _SAFE_LOAD_TORCH))} "
                              f"(torch {torch.__version__} can be made to run code from a checkpoint even with "
                              "weights_only=True, CVE-2025-32434); upgrade torch")
    try:
        with warnings.catch_warnings():
            # A pickle protocol other than torch.save's makes the weights_only unpickler warn before it reads
            # (or refuses) the file; our own files never do, and the CLI's promise is one stderr line.
            warnings.filterwarnings("ignore", message="Detected pickle protocol", category=UserWarning)
            state = torch.load(path, map_location=device, weights_only=True)
    except Exception as e:  # unpickling raises many types (UnpicklingError, EOFError, RuntimeError, ...)
        raise _refusal(path, e) from None
    _check_layout(state, path)
    return state  # type: ignore[no-any-return]


def checkpoint_fingerprint(directory: str | os.PathLike[str]) -> str | None:
    """A digest of the checkpoint file (16 hex digits), None when the folder holds none: ranks that read their own
    copy (node-local folders) resume the same state exactly when their digests agree.

    ``torch.save`` writes a zip archive whose central directory holds every record's CRC-32 and size: each
    tensor's bytes and the pickle of the rest (epoch, step, plan, sampler...).  The digest hashes that directory,
    read from the file's end (0.5 ms for a 100 MB file here), so the ranks of a large job do not each read a
    multi-gigabyte file through a shared file system only to compare it.  A file without one (not a zip, or saved
    with torch's CRC computation off) is hashed whole.
    """
    import hashlib
    import json
    import zipfile

    path = Path(directory) / CHECKPOINT_NAME
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return None
    try:
        with zipfile.ZipFile(path) as archive:
            records = [[i.filename, i.CRC, i.file_size] for i in archive.infolist()]
        if records and all(crc for _, crc, length in records if length):
            text = json.dumps([size, records], separators=(",", ":"))
            return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]
    except (zipfile.BadZipFile, OSError, ValueError):
        pass  # not a zip archive: its bytes are the fingerprint
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(4 << 20):
            digest.update(chunk)
    return digest.hexdigest()[:16]


def check_state_fits(state: Mapping[str, Any], model: torch.nn.Module, optimizer: torch.optim.Optimizer, *,
                     steps_per_epoch: int, path: str | os.PathLike[str]) -> None:
    """Refuse, in one line, a checkpoint whose contents this run's model and optimizer cannot take exactly --
    before anything of it is loaded or printed.

    ``load_state_dict`` casts a weight of another dtype silently (int64 weights became floats), accepts optimizer
    state of any shape (a momentum buffer of the wrong shape failed only at the first step, after the resume was
    announced) and any extra entries; a saved step beyond the epoch printed a negative step count.
    """
    def bad(what: str) -> ValidationError:
        return ValidationError(f"{Path(path) / CHECKPOINT_NAME}: refused: {what}; it was not written by this run's "
                               f"model and optimizer -- {_FIX}")

    mine = model.state_dict()
    for key, saved in state["model"].items():
        own = mine.get(key)
        if isinstance(own, torch.Tensor) and saved.dtype != own.dtype:
            raise bad(f"model[{key[:60]!r}] is {saved.dtype} there and {own.dtype} here")
    step = int(state["step"])
    if not 0 <= step <= steps_per_epoch:
        raise bad(f"step {step} is beyond an epoch of {steps_per_epoch} steps")
    sampler = state.get("sampler")
    if isinstance(sampler, dict) and sampler.get("step") != step:
        raise bad(f"the sampler's step {str(sampler.get('step'))[:20]} is not the checkpoint's step {step}")
    problem = _optimizer_fit_problem(state["optimizer"], optimizer)
    if problem:
        raise bad(problem)


# The per-parameter state each optimizer the trainer builds keeps (torch.optim): other entries are not its own.
_OPTIMIZER_STATE = {"SGD": {"momentum_buffer"}, "Adam": {"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"},
                    "AdamW": {"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"}}
_UPDATE_KEYS = ("momentum", "dampening", "weight_decay", "nesterov", "maximize", "betas", "eps", "amsgrad")
"""Hyperparameters that change the update: a saved group's value replaces the run's in ``load_state_dict``. The
learning rate is compared with the command line instead (planner/cli/preflight.py); implementation switches
(``foreach``, ``fused``...) are not compared."""


def _optimizer_fit_problem(saved: Mapping[str, Any], optimizer: torch.optim.Optimizer) -> str | None:
    """What of the saved optimizer state does not fit ``optimizer`` (its groups, parameters, state entries,
    shapes, dtypes, hyperparameters other than the learning rate); None when all of it does."""
    live = optimizer.state_dict()
    groups, own_groups = saved["param_groups"], live["param_groups"]
    if [len(g["params"]) for g in groups] != [len(g["params"]) for g in own_groups]:
        return (f"optimizer has parameter groups of {[len(g['params']) for g in groups]} parameters, this run's "
                f"{[len(g['params']) for g in own_groups]}")
    params: dict[int, torch.Tensor] = {}
    for group, own in zip(groups, optimizer.param_groups, strict=True):
        params.update(zip(group["params"], own["params"], strict=True))
    for i, (group, own) in enumerate(zip(groups, own_groups, strict=True)):
        for key in (k for k in _UPDATE_KEYS if k in group and k in own):
            if group[key] != own[key]:
                there, here = shown_apart([group[key], own[key]], 30, text=str)  # never cut alike
                return f"optimizer.param_groups[{i}].{key} is {there} there and {here} here"
    known = _OPTIMIZER_STATE.get(type(optimizer).__name__)
    for index, entry in saved["state"].items():
        if index not in params:
            return f"optimizer.state holds parameter {str(index)[:20]}, which no parameter group lists"
        if not isinstance(entry, dict):
            return f"optimizer.state[{index}] is a {type(entry).__name__}, expected a dict"
        param = params[index]
        for key, value in entry.items():
            if known is not None and key not in known:
                return (f"optimizer.state[{index}] holds {str(key)[:30]!r}, which {type(optimizer).__name__} does "
                        f"not keep (it keeps {', '.join(sorted(known))})")
            if value is None:
                continue  # a momentum buffer not made yet (momentum 0)
            if not isinstance(value, torch.Tensor):
                if not _number(value):
                    return f"optimizer.state[{index}].{key} is {type(value).__name__}, expected a tensor or number"
                continue
            if value.dim() == 0:
                continue  # a step count
            if tuple(value.shape) != tuple(param.shape) or value.dtype != param.dtype:
                return (f"optimizer.state[{index}].{key} is {value.dtype} {list(value.shape)} but its parameter is "
                        f"{param.dtype} {list(param.shape)}")
    return None


def saved_global_batch(directory: str | os.PathLike[str]) -> int | None:
    """The global batch of the run that wrote the checkpoint in `directory` (None when there is none yet)."""
    state = load_checkpoint(directory, torch.device("cpu"))
    return None if state is None else int(Plan.from_dict(state["plan"]).global_batch)


def _plain(value: Any, path: str) -> Any:
    """A copy of JSON-able `value` as plain Python data; TypeError naming `path` for anything else (our bug)."""
    if isinstance(value, np.generic) and not isinstance(value, (np.str_, np.bytes_, np.void)):
        return value.item()  # np.int64 -> int, np.float64 -> float, np.bool_ -> bool
    if type(value) in _SCALARS:
        return value
    if isinstance(value, str):  # a str subclass (torch.__version__ is a TorchVersion): its text
        return str(value)
    if isinstance(value, Mapping):
        out = {}
        for k, v in value.items():
            if type(k) is not str:
                raise TypeError(f"checkpoint {path}: key {k!r} is a {type(k).__name__}, expected str (JSON-able)")
            out[k] = _plain(v, f"{path}.{k}")
        return out
    if isinstance(value, (list, tuple)):
        return [_plain(v, f"{path}[{i}]") for i, v in enumerate(value)]
    raise TypeError(f"checkpoint {path}: {type(value).__module__}.{type(value).__qualname__} is not plain data "
                    "(tensors, numbers, strings, bools, None, lists and dicts only)")


def _check_data_only(value: Any, path: str) -> None:
    """Assert `value` is what the weights_only unpickler reads back; TypeError naming the key path if not."""
    if type(value) in _SCALARS or type(value) in _TENSORS:
        return
    if type(value) in _DICTS:
        for k, v in value.items():
            # int keys: the optimizer's state is keyed by parameter index
            if type(k) not in (str, int):
                raise TypeError(f"checkpoint {path}: key {k!r} is a {type(k).__name__}, expected str or int")
            _check_data_only(v, f"{path}.{k}")
        return
    if type(value) in (list, tuple):  # tuples: torch's own state_dicts hold some (Adam's betas)
        for i, v in enumerate(value):
            _check_data_only(v, f"{path}[{i}]")
        return
    raise TypeError(f"checkpoint {path}: {type(value).__module__}.{type(value).__qualname__} is not data "
                    "(tensors, numbers, strings, bools, None, lists and dicts only)")


_FIX = "delete it to start afresh, or resume from a checkpoint this version wrote"


def _refusal(path: Path, e: Exception) -> ValidationError:
    """The one-line error for a file torch.load would not read."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(e))  # torch bolds part of its message with terminal escapes
    found = re.search(r"GLOBAL (\S+)", text) if "Weights only load failed" in text else None
    if found is not None:
        # The pickle names a class or function outside torch's allowlist: code, or objects we never write.
        return ValidationError(
            f"{path}: refused: the checkpoint holds objects other than tensors and plain data (weights_only load "
            f"failed: unsupported global {found.group(1).rstrip('.')}); it was not written by this version of "
            f"ddp-planner or was tampered with -- {_FIX}")
    # Not a pickle we can read at all (garbage, truncated, another format). torch's advice to retry with
    # weights_only=False is left out on purpose: only the line that says what is wrong is kept.
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    boilerplate = ("Weights only load failed", "Please file an issue", "Check the documentation", "(1)", "(2)")
    why = ([ln for ln in lines if not ln.startswith(boilerplate)] or lines or [""])[0]
    return ValidationError(f"{path}: not a readable checkpoint ({type(e).__name__}{': ' + why if why else ''}); "
                           "delete it to start afresh or point --checkpoint at the folder of the run to resume")


def _check_layout(state: Any, path: Path) -> None:
    """Refuse plain data that is not a checkpoint of this version, before the trainer indexes into it."""
    def bad(what: str) -> ValidationError:
        return ValidationError(f"{path}: refused: {what}; it was not written by this version of ddp-planner or "
                               f"was tampered with -- {_FIX}")

    if not isinstance(state, dict):
        raise bad(f"expected a dict of {', '.join(_KEYS)}, got a {type(state).__name__}")
    version = state.get("version")
    if version != CHECKPOINT_VERSION:
        raise bad(f"checkpoint version {version!r} is not {CHECKPOINT_VERSION}")
    missing = [k for k in _KEYS if k not in state]
    if missing:
        raise bad(f"missing {', '.join(missing)}")
    for key, most in (("epoch", MAX_EPOCH), ("step", MAX_STEP)):
        if type(state[key]) is not int or not 0 <= state[key] <= most:
            raise bad(f"{key} is {str(state[key])[:30]}, expected an integer in 0..{most}")
    for key, kinds in (("model", (dict,)), ("optimizer", (dict,)), ("plan", (dict,)),
                       ("sampler", (dict, type(None))), ("replanner", (dict, type(None))),
                       ("run", (dict, type(None))), ("profile", (dict, type(None)))):
        if not isinstance(state.get(key), kinds):  # "run" and "profile" are absent from older checkpoints
            raise bad(f"{key} is a {type(state.get(key)).__name__}, expected "
                      + " or ".join("None" if k is type(None) else k.__name__ for k in kinds))
    try:
        Plan.from_dict(state["plan"], path="plan")
    except ValidationError as e:
        raise bad(str(e).splitlines()[0] if str(e) else "the plan is invalid") from None
    problem = (_model_problem(state["model"]) or _optimizer_problem(state["optimizer"])
               or _run_problem(state.get("run")))
    if problem:
        raise bad(problem)


def _model_problem(model: dict[Any, Any]) -> str | None:
    for key, value in model.items():
        if type(key) is not str or not isinstance(value, torch.Tensor):
            return f"model[{str(key)[:40]!r}] is a {type(value).__name__}, expected a tensor"
    return None


def _number(value: Any) -> bool:
    return type(value) in (int, float) and math.isfinite(value)


def _optimizer_problem(opt: dict[Any, Any]) -> str | None:
    """What torch's ``Optimizer.load_state_dict`` would stumble on, said first (it raised KeyError or
    TypeError tracebacks on an empty dict or a string learning rate)."""
    if not isinstance(opt.get("state"), dict):
        return "optimizer.state is missing or not a dict"
    groups = opt.get("param_groups")
    if not isinstance(groups, list) or not groups or not all(isinstance(g, dict) for g in groups):
        return "optimizer.param_groups is missing, empty or not a list of dicts"
    for i, group in enumerate(groups):
        lr = group.get("lr")
        if not (_number(lr) and lr > 0):
            return f"optimizer.param_groups[{i}].lr is {str(lr)[:30]}, expected a positive finite number"
        params = group.get("params")
        if not isinstance(params, list) or not all(type(p) is int for p in params):
            return f"optimizer.param_groups[{i}].params is not a list of parameter indices"
    return None


_RUN_TYPES: dict[str, tuple[type, ...]] = {
    "model": (str,), "dataset": (str,), "seed": (int,), "lr": (int, float), "global_batch": (int,),
    "world_size": (int,), "image_size": (int, type(None)), "num_samples": (int, type(None)),
    "plan_fingerprint": (str,),
}


# What a resume may take from the run record for a flag left off: within the bounds that flag accepts typed.
_RUN_BOUNDS = {"image_size": MAX_IMAGE_SIZE, "num_samples": MAX_COUNT}


def _run_problem(run: dict[str, Any] | None) -> str | None:
    """The run record's values, typed and bounded: a resume compares them with the command line and may take them
    (a data size of 2**40 samples or a 2**20-pixel side asked for terabytes before a traceback)."""
    for key, kinds in _RUN_TYPES.items():
        if run is None or key not in run:
            continue
        value = run[key]
        if type(value) not in kinds or (kinds == (int, float) and not _number(value)) or (
                type(value) is int and not 0 <= value <= MAX_STEP):
            return f"run.{key} is {type(value).__name__} {str(value)[:30]}, not what this version writes"
        most = _RUN_BOUNDS.get(key)
        if most is not None and value is not None and not 1 <= value <= most:
            return f"run.{key} is {value}, outside the 1..{most} its flag accepts"
    return None
