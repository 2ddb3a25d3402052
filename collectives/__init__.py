"""What ranks exchange, as data: JSON over tensors, never pickle.

``torch.distributed``'s object collectives (``all_gather_object``, ``broadcast_object_list``) unpickle what
peers send, so a rogue or compromised peer could run code on every rank (docs/SECURITY.md).  Everything our
ranks exchange (plans, profiles, step statistics, agreement facts, decisions) is JSON-able, so it crosses as
UTF-8 JSON bytes in a uint8 tensor and is parsed with ``json.loads``, which builds dicts, lists, strings and
numbers only.

    all_gather_json(obj)          every rank's obj, in rank order
    broadcast_json(obj, src)      src's obj on every rank
    decide_on_rank0(fn)           rank 0 runs fn(), every rank gets its result or raises its error

Used by the profiler (gathering rank profiles), the runtime (agreement check, re-plan exchange) and the programs.
Without an initialized process group each function acts on this process alone.
"""

from __future__ import annotations

from collectives.exchange import RemoteError, all_gather_json, broadcast_json, decide_on_rank0, is_distributed

__all__ = ["RemoteError", "all_gather_json", "broadcast_json", "decide_on_rank0", "is_distributed"]
