"""torch.randperm(N) on the main thread vs a background thread, alternating (checks that prefetching the shuffle
on a thread costs no more than building it in place).  python benchmarks/randperm_threads.py [N] [repeats]"""

from __future__ import annotations

import sys
import threading
import time

import torch


def _perm(n: int, seed: int) -> torch.Tensor:
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed), dtype=torch.int32)


def main() -> int:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 10**8
    repeats = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    print(f"torch {torch.__version__}, N = {n:,}, intra-op threads {torch.get_num_threads()}")
    for i in range(repeats):
        t0 = time.perf_counter()
        _perm(n, i)
        main_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        th = threading.Thread(target=_perm, args=(n, i))
        th.start()
        th.join()
        print(f"repeat {i}: main thread {main_s:.2f} s, background thread {time.perf_counter() - t0:.2f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
