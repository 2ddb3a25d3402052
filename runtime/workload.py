"""What a plan was made for, compared with the run that applies it: the model, the profile, the machine.

A plan balances the step times its profile measured -- for one model, on those devices, with those hosts' cores.
``Plan.made_for`` records them (planner.solve.made_for); ``WorkloadCheck`` compares them with the run at start, in
one line:

  refused (ValidationError)   where the prediction cannot hold: another model (its structural fingerprint or
                              parameter count differs), or a plan solved from another profile than the one given
                              (another world size is refused by PlannedRun.sampler_for);
  warned (rank 0, one line)   where only the speed model is off: another device name, host, or host core count.

``allow_workload_mismatch=True`` (`planner train --allow-workload-mismatch`) turns each refusal into a warning.  A
plan that records nothing (written before plans recorded it, or made by hand) is checked against the profile when
one is given, and otherwise gets one note that it cannot be checked.

The run's side of the comparison is measured here, with the same functions the profiler records a profile with
(profiler.inventory and profiler.compute call them), so a run on the profiled machine matches by construction.
"""

from __future__ import annotations

import os
import platform
import socket
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from planner.errors import ValidationError
from planner.jsonio import fingerprint
from planner.plan import Plan
from planner.profile import Profile
from runtime.collectives import all_gather_json

HOST_ID_ENV = "PLANNER_HOST_ID"
ESCAPE = "allow_workload_mismatch=True (planner train: --allow-workload-mismatch)"
WRAPPERS = frozenset({"module", "_orig_mod", "_forward_module", "_checkpoint_wrapped_module"})
"""Attribute names a wrapper keeps a model or layer under (DDP and DataParallel, torch.compile, Lightning's strategy
wrapper, the profiler's step wrapper, activation checkpointing): dropped from parameter names wherever they occur,
so a model and its wrapped form have one fingerprint."""


class WorkloadWarning(UserWarning):
    """The run differs from what its plan was made for only in the speed model (device, host, cores)."""


# -- the run's facts -------------------------------------------------------------------------------------------
def machine_name() -> str:
    """The operating system's host name."""
    return socket.gethostname() or "localhost"


def host_name() -> str:
    """The name of this rank's host in a profile: ranks with the same name share one host's cores.

    ``PLANNER_HOST_ID`` when set (the documented override: give ranks that truly share a machine the same id).
    Otherwise the machine's host name, and in a multi-node torchrun job (``GROUP_WORLD_SIZE`` > 1) the node's
    ``GROUP_RANK`` after it: containers on different nodes often report the same host name, and counting them as
    one host would split one node's loader budget over both.  Two torchrun agents on one machine (a test, or
    ``--nnodes`` misused) are then two hosts: set ``PLANNER_HOST_ID`` to share the budget.
    """
    override = os.environ.get(HOST_ID_ENV, "").strip()
    if override:
        return override
    name = machine_name()
    try:
        nodes = int(os.environ.get("GROUP_WORLD_SIZE", "1"))
    except ValueError:
        nodes = 1
    group_rank = os.environ.get("GROUP_RANK")
    return f"{name}/node{group_rank}" if nodes > 1 and group_rank is not None else name


def usable_cores() -> int:
    """Cores this process may run on (affinity / cpuset), psutil or os.cpu_count() where that is unknown."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        pass
    try:
        import psutil

        n = psutil.cpu_count(logical=True)
        if n:
            return int(n)
    except Exception:  # psutil is optional here
        pass
    return os.cpu_count() or 1


def device_name(device: torch.device | str) -> str:
    """The device's name as a profile records it (``RankProfile.device_name``): the CUDA device's own name, or
    ``CPU <processor>``."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return f"CPU {platform.processor() or platform.machine() or 'cpu'}"
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    return str(torch.cuda.get_device_properties(index).name)


def rank_facts(device: torch.device | str) -> dict[str, Any]:
    """This rank's device name, host and usable cores: what ``Plan.made_for["ranks"]`` is compared with."""
    return {"device_name": device_name(device), "host": host_name(), "cpu_cores": usable_cores()}


def _entries(model: torch.nn.Module) -> list[list[Any]]:
    def bare(name: str) -> str:
        return ".".join(part for part in name.split(".") if part not in WRAPPERS)

    out: list[list[Any]] = []
    for kind, named in (("p", model.named_parameters()), ("b", model.named_buffers())):
        out.extend([kind, bare(n), list(t.shape), str(t.dtype).removeprefix("torch.")] for n, t in named)
    return out


def model_fingerprint(model: torch.nn.Module) -> str:
    """The model's structural fingerprint: a hash of the ordered (name, shape, dtype) of its parameters, then its
    buffers, with a wrapper's prefix dropped (``WRAPPERS``).  Its weights' values do not enter: a trained and a
    fresh model are one structure."""
    return fingerprint(_entries(model))


def num_params(model: torch.nn.Module) -> int:
    """The model's parameter count, as the profile records it (``ModelInfo.num_params``)."""
    return sum(p.numel() for p in model.parameters())


# -- the comparison ----------------------------------------------------------------------------------------
def recorded(plan: Plan, profile: Profile | None) -> dict[str, Any]:
    """What the run is compared with: ``plan.made_for``, else (an older plan) what the given profile measured."""
    if plan.made_for:
        return dict(plan.made_for)
    if profile is None:
        return {}
    from planner.solve import made_for

    out = made_for(profile)
    out.pop("profile_fingerprint")  # the plan does not say which profile it came from
    return out


def _count(n: Any) -> str:
    return f"{n:,}" if isinstance(n, int) else "?"


def model_mismatch(want: Mapping[str, Any], model: torch.nn.Module) -> str | None:
    """Why ``model`` is not the model ``want`` (``made_for["model"]``) describes, or None (also when it records
    neither a structure nor a parameter count)."""
    n = num_params(model)
    if want.get("structure") is not None:
        got = model_fingerprint(model)
        if got == want["structure"]:
            return None
        return (f"the plan was made for another model ({_count(want.get('num_params'))} parameters, structure "
                f"{want['structure']}) than this run trains ({n:,} parameters, structure {got})")
    if want.get("num_params") is not None and want["num_params"] != n:
        return (f"the plan was made for a model of {_count(want['num_params'])} parameters, this run trains one of "
                f"{n:,}")
    return None


def speed_mismatch(want: Sequence[Mapping[str, Any]], have: Sequence[Mapping[str, Any]]) -> str | None:
    """What differs between the ranks a plan was made for and the run's (both in rank order): device names, the
    grouping of ranks on hosts and each host's cores.  None: the same machine, as far as a profile tells."""
    diffs = []
    for i, (w, h) in enumerate(zip(want, have, strict=False)):
        if w.get("device_name") and w["device_name"] != h["device_name"]:
            diffs.append(f"rank {i} runs on {h['device_name']} (plan: {w['device_name']})")
    if all(w.get("host") for w in want):
        if _groups(want) != _groups(have):
            diffs.append(f"the ranks are on hosts {_hosts(have)} (plan: {_hosts(want)})")
        else:
            diffs.extend(f"host {h} (plan: {w})" for w, h in dict.fromkeys(
                (w["host"], h["host"]) for w, h in zip(want, have, strict=False) if w["host"] != h["host"]))
            cores: dict[str, int] = {}
            for h in have:  # a host's widest affinity, as a profile records it
                cores[h["host"]] = max(cores.get(h["host"], 0), int(h["cpu_cores"]))
            planned: dict[str, tuple[str, int]] = {}  # by the run's host: (the plan's host, its cores)
            for w, h in zip(want, have, strict=False):
                if "cpu_cores" in w:
                    planned.setdefault(h["host"], (w["host"], int(w["cpu_cores"])))
            diffs.extend(f"host {host} has {cores[host]} usable cores (plan: {n})"
                         for host, (_, n) in planned.items() if cores[host] != n)
    if not diffs:
        return None
    return (f"the plan's speed model was measured on other hardware: {'; '.join(diffs)}; its split may not "
            "balance this run -- re-profile on this machine and re-plan")


def _by_host(ranks: Sequence[Mapping[str, Any]]) -> dict[str, list[int]]:
    by: dict[str, list[int]] = {}
    for i, r in enumerate(ranks):
        by.setdefault(str(r.get("host")), []).append(i)
    return by


def _groups(ranks: Sequence[Mapping[str, Any]]) -> list[list[int]]:
    """The ranks that share a host, whatever the hosts are called."""
    return sorted(_by_host(ranks).values())


def _hosts(ranks: Sequence[Mapping[str, Any]]) -> str:
    return "; ".join(f"{h}: rank{'s' if len(v) > 1 else ''} {','.join(map(str, v))}" for h, v in _by_host(ranks).items())


class WorkloadCheck:
    """A plan's ``made_for`` checked against one rank's run: the profile at construction, the ranks' devices and
    hosts at ``check_ranks`` (collective), the model at ``check_model``.  ``allow``: refusals become warnings."""

    def __init__(self, plan: Plan, profile: Profile | None, *, allow: bool = False) -> None:
        if not isinstance(allow, bool):
            raise ValidationError(f"allow_workload_mismatch must be True or False, got {allow!r}")
        self.allow = allow
        self.want = recorded(plan, profile)
        self._models: set[int] = set()
        self._said: set[str] = set()
        made_from = plan.made_for.get("profile_fingerprint") or plan.solver.get("profile_fingerprint")
        if profile is not None and made_from and made_from != profile.fingerprint():
            self.refuse(f"the plan was solved from another profile (fingerprint {made_from}) than the one given "
                        f"({profile.fingerprint()}): its split balances other step times; re-plan from this profile")

    def refuse(self, why: str) -> None:
        """Raise ``why`` with the fix, or (``allow``) warn it once."""
        if not self.allow:
            raise ValidationError(f"{why}, or pass {ESCAPE}")
        self.warn(f"{why} (allowed: allow_workload_mismatch)")

    def warn(self, line: str) -> None:
        if line not in self._said:
            self._said.add(line)
            warnings.warn(line, WorkloadWarning, stacklevel=4)

    def check_ranks(self, rank: int, device: torch.device | str) -> None:
        """Collective under torch.distributed: every rank's device, host and cores against ``made_for["ranks"]``;
        rank 0 warns in one line what differs (or notes that the plan records nothing to check)."""
        mine = rank_facts(device)
        have = all_gather_json(mine)
        if rank != 0:
            return
        if not self.want:
            self.warn("note: the plan records no model, profile or machine (a plan made before plans recorded "
                      "them, or by hand): this run cannot be checked against what it was made for; re-plan to "
                      "record them")
            return
        want = self.want.get("ranks")
        if want and len(want) == len(have):
            line = speed_mismatch(want, have)
            if line:
                self.warn(line)

    def check_model(self, model: torch.nn.Module) -> None:
        """``model`` against ``made_for["model"]`` (once per model): another structure is refused."""
        if id(model) in self._models:
            return
        self._models.add(id(model))
        want = self.want.get("model")
        why = model_mismatch(want, model) if want else None
        if why:
            self.refuse(f"{why}: its split balances another model's step times; re-profile and re-plan for this "
                        "model")
