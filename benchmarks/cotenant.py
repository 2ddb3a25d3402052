"""A co-tenant: keep one GPU (or one CPU core) busy a given fraction of the time until killed.

Real heterogeneity (docs/DESIGN.md, Heterogeneity we can produce): another job sharing a card.  Start it beside a rank,
profile and train, then stop it:

    python benchmarks/cotenant.py --device cuda:1 --duty 0.5 &      # rank 1's GPU is busy half the time
    COTENANT=$!; ...; kill $COTENANT                                 # SIGTERM/SIGINT end it cleanly

Each period (default 50 ms) it runs back-to-back bf16 matmuls for ``duty * period`` seconds (synchronized, so
the busy time is real device time) and sleeps the rest; a duty of 1 never sleeps.  On CPU it burns one core
(one torch thread, fp32 matmuls).  At exit it prints the duty it achieved to stderr.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from types import FrameType

import torch


def get_args_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu", help="cuda:N or cpu")
    p.add_argument("--duty", type=float, default=0.5, help="busy fraction of each period, 0 < duty <= 1 (default 0.5)")
    p.add_argument("--period-s", type=float, default=0.05, help="length of one busy+idle period in seconds")
    p.add_argument("--size", type=int, default=None, help="matmul side (default 8192 on CUDA, 256 on CPU)")
    p.add_argument("--seconds", type=float, default=None, help="stop after this many seconds (default: until killed)")
    p.add_argument("--start-file", default=None, metavar="PATH",
                   help="set up (CUDA context, operands), then wait until PATH exists before loading the device: a "
                        "co-tenant that joins at a chosen moment without its start-up delay")
    p.add_argument("--hold-gib", type=float, default=0.0,
                   help="also hold this many GiB of device memory, as a real co-tenant job does (default 0)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = get_args_parser().parse_args(argv)
    if not 0.0 < args.duty <= 1.0:
        print(f"error: --duty must be in (0, 1], got {args.duty}", file=sys.stderr)
        return 2
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)  # exactly one core
    n = args.size or (8192 if cuda else 256)
    dtype = torch.bfloat16 if cuda else torch.float32
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    held = torch.empty(int(args.hold_gib * 2**30), dtype=torch.uint8, device=device) if args.hold_gib > 0 else None

    stop = False

    def on_signal(signum: int, frame: FrameType | None) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    # Printed once the memory is held: a caller may wait for this line before it measures.
    print(f"cotenant pid {os.getpid()} on {device}: duty {args.duty:g}, period {args.period_s:g} s, "
          f"holding {args.hold_gib:g} GiB", file=sys.stderr, flush=True)

    if args.start_file is not None:
        torch.mm(a, b)  # the first matmul's set-up (cuBLAS handle, kernels) before the wait, not in the load
        if cuda:
            torch.cuda.synchronize(device)
        while not stop and not os.path.exists(args.start_file):
            time.sleep(0.01)
    busy_total, t_start = 0.0, time.perf_counter()
    end = None if args.seconds is None else t_start + args.seconds
    while not stop and (end is None or time.perf_counter() < end):
        period_start = time.perf_counter()
        busy_until = period_start + args.duty * args.period_s
        while time.perf_counter() < busy_until and not stop:
            torch.mm(a, b)
            if cuda:
                torch.cuda.synchronize(device)  # count device time, not launch time
        busy_total += time.perf_counter() - period_start
        idle = period_start + args.period_s - time.perf_counter()
        if idle > 0 and args.duty < 1.0:
            time.sleep(idle)
    wall = time.perf_counter() - t_start
    del held
    print(f"cotenant done: busy {busy_total:.1f} s of {wall:.1f} s (duty {busy_total / max(wall, 1e-9):.2f})",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
