"""The all-reduce within each host, timed beside the one over the whole job (planner.comm_model, hosts).

Collective: every rank calls ``measure_host_allreduce`` with every rank's host name, in the same order.  One
process group per host (``dist.new_group`` is itself collective: every rank creates every group, in one order);
each host's ranks time their own group's all-reduce of the gradient's buckets at once (the groups share no rank,
as hosts share no intra-host link).  Rank 0 gets {host: seconds}; a host of one rank has nothing to reduce (0).
"""

from __future__ import annotations

import torch.distributed as dist

from planner.comm_model import host_groups
from profiler.comm import measure_allreduce
from runtime.collectives import all_gather_json


def measure_host_allreduce(grad_bytes: int, hosts_by_rank: list[str], *, repeats: int,
                           backend: str | None = None) -> dict[str, float]:
    """{host: its ranks' all-reduce of ``grad_bytes``, seconds} on every rank; {} within one host."""
    groups = host_groups(hosts_by_rank)
    if len(groups) < 2:
        return {}
    me = dist.get_rank()
    mine: tuple[str, dist.ProcessGroup | None] | None = None
    made = []
    for host, ranks in groups:
        group = dist.new_group(ranks=ranks, backend=backend)
        made.append(group)
        if me in ranks:
            mine = (host, group if isinstance(group, dist.ProcessGroup) and len(ranks) > 1 else None)
    assert mine is not None
    try:
        host, own = mine
        seconds = 0.0
        if own is not None and grad_bytes > 0:
            seconds = float(measure_allreduce(grad_bytes, repeats=repeats, group=own).allreduce_s or 0.0)
        times = all_gather_json({"host": host, "s": seconds})
    finally:
        for group in made:
            if isinstance(group, dist.ProcessGroup):
                dist.destroy_process_group(group)
    return {h: round(max(float(t["s"]) for t in times if t["host"] == h), 6) for h, _ in groups}
