"""Test selection: ``pytest --fast`` (``make check``) runs the tests that start no other process.

A test that starts a program or an interpreter -- gloo ranks (``distributed``), ``python -m planner``, torchrun,
a browser (``subprocess``) -- or takes long by itself (``slow``) carries that marker; ``--fast`` deselects them,
and the tests marked ``alone``, which read the host's CPU load (`make check` runs lint beside its workers).
Under ``--fast`` a test that starts an interpreter anyway fails at once, naming the marker it lacks, so the
selection stays fast as tests are added.  Forked processes (DataLoader workers) cost no interpreter start and are
allowed.
"""

from __future__ import annotations

import multiprocessing.popen_forkserver
import multiprocessing.popen_spawn_posix
import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest

SPAWNING = ("distributed", "subprocess", "slow")
LEFT_OUT = (*SPAWNING, "alone")
"""What --fast deselects."""


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--fast", action="store_true",
                     help="only the tests that start no other process and need no quiet host (deselects the "
                          f"markers {', '.join(LEFT_OUT)}); an unmarked test that starts a process fails")


HEAVY_FIRST = (
    "cli/test_train_cli.py", "runtime/test_replan.py", "frameworks/test_ray.py", "reliability/test_elastic.py",
    "cli/test_bench.py", "reliability/test_no_hangs.py", "frameworks/test_hf.py", "frameworks/test_hf_examples.py",
    "reliability/test_multinode.py", "frameworks/test_hf_bench.py", "reliability/test_cli_input_refusals.py",
    "runtime/test_sampler.py", "cli/test_loader_check.py", "reliability/test_crash_resume.py",
    "planner/test_solve.py", "reliability/test_divergence.py", "reliability/test_bad_inputs.py",
    "cli/test_comm_breakdown.py", "reliability/test_report_scale.py", "frameworks/test_lightning.py",
    "frameworks/test_examples.py", "cli/test_profile_cli.py",
)
"""The modules that take longest on 2 cores, longest first (under tests/). They run first: pytest-xdist's
``--dist loadscope`` hands a worker the next module whenever it runs dry, so with the long ones first the two
workers end close together instead of one finishing a long module alone at the end. The order is only a
schedule: no test depends on it (the Makefile passes --no-loadscope-reorder, or xdist would order the modules by
test count)."""


def _heavy_first(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(HEAVY_FIRST)}
    here = os.path.dirname(__file__)

    def key(item: pytest.Item) -> int:
        return rank.get(os.path.relpath(str(item.path), here).replace(os.sep, "/"), len(HEAVY_FIRST))

    items.sort(key=key)  # stable: a module's tests keep their order, the other modules theirs


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    _heavy_first(items)
    if not config.getoption("--fast"):
        return
    keep: list[pytest.Item] = []
    drop: list[pytest.Item] = []
    for item in items:
        (drop if any(item.get_closest_marker(m) for m in LEFT_OUT) else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def pytest_collection_finish(session: pytest.Session) -> None:
    """With the tests selected (``-m``, ``-k`` applied): the fork server preloads the frameworks where framework
    tests are among them, and -- in a run without xdist workers that launches ranks (`make test`'s ``alone`` run) --
    starts now, importing on the core the in-process tests before the first launch leave idle (~4 s sooner).  Under
    xdist every core is busy already, and two workers' servers starting together would both compile the modules a
    fresh install has no bytecode for: there each starts at its worker's first launch."""
    if session.config.getoption("--fast"):
        return
    frameworks = os.path.join(os.path.dirname(__file__), "frameworks")
    preload = any(str(item.path).startswith(frameworks + os.sep) for item in session.items)
    start = "PYTEST_XDIST_WORKER" not in os.environ and any(i.get_closest_marker("distributed") for i in session.items)
    if preload or start:
        from tests import _dist

        if preload:
            _dist.preload_frameworks = True
        if start:
            _dist.start_fork_server()


_finished: list[pytest.Session] = []


def pytest_sessionfinish(session: pytest.Session) -> None:
    _finished.append(session)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    """Leave without the interpreter's teardown once pytest has done everything, its report and exit status
    included: a process that imported torch and torch._dynamo spends ~2 s of CPU clearing its modules at exit
    (measured: 6.6 s for ``python -c "import torch, torch._dynamo"`` against 4.8 s with ``os._exit``), which each
    xdist worker, and the run that waits for them, would pay at the end.  Not under pytest-cov, which may still
    write its data at exit."""
    if not _finished or config.pluginmanager.hasplugin("_cov"):
        return
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        if stream is not None:
            stream.flush()
    os._exit(int(_finished[-1].exitstatus))


class StartsAProcess(BaseException):
    """Raised under --fast where a test starts an interpreter, a shell or a browser (BaseException: no ``except
    Exception`` in the code under test turns it into a fallback)."""


def _refuse(what: str) -> None:
    raise StartsAProcess(f"this test starts {what}: mark it @pytest.mark.subprocess (a program, torchrun) or "
                         "@pytest.mark.distributed (gloo ranks), so that `make check` (pytest --fast) leaves it out")


def _costly(program: str) -> bool:
    """An interpreter (which imports torch and the package again), a shell (which may start one) or a browser;
    the system's small tools (``ldconfig`` behind ``ctypes.util.find_library``) are not what --fast leaves out."""
    name = os.path.basename(program)
    return (os.path.realpath(program) == os.path.realpath(sys.executable) or name.startswith(("python", "torchrun"))
            or name in {"sh", "bash", "dash", "planner"} or name.startswith("chrom"))


_guarding = False
"""True while a test runs (its setup, call and teardown) under --fast: pytest's own processes (xdist's workers)
start outside that."""


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    global _guarding
    _guarding = bool(item.config.getoption("--fast"))
    try:
        yield
    finally:
        _guarding = False


def pytest_configure(config: pytest.Config) -> None:
    if not config.getoption("--fast"):
        return
    spawn_popen, forkserver_popen = multiprocessing.popen_spawn_posix.Popen, multiprocessing.popen_forkserver.Popen
    execute_child = getattr(subprocess.Popen, "_execute_child")  # noqa: B009 (private: no stub)
    spawn_launch, forkserver_launch = getattr(spawn_popen, "_launch"), getattr(forkserver_popen, "_launch")  # noqa: B009

    def guarded_execute_child(self: subprocess.Popen[Any], args: Any, *rest: Any, **kw: Any) -> None:
        argv = [args] if isinstance(args, (str, bytes, os.PathLike)) else list(args)
        if _guarding and argv and str(argv[0]).split() and _costly(str(argv[0]).split()[0]):
            _refuse(f"a program ({' '.join(map(str, argv))[:160]})")
        execute_child(self, args, *rest, **kw)

    def guarded_spawn(self: Any, process_obj: Any) -> None:
        if _guarding:
            _refuse("an interpreter (multiprocessing spawn)")
        spawn_launch(self, process_obj)

    def guarded_forkserver(self: Any, process_obj: Any) -> None:
        if _guarding:
            _refuse("ranks from a fork server (tests/_dist.py)")
        forkserver_launch(self, process_obj)

    setattr(subprocess.Popen, "_execute_child", guarded_execute_child)  # noqa: B010
    setattr(spawn_popen, "_launch", guarded_spawn)  # noqa: B010
    setattr(forkserver_popen, "_launch", guarded_forkserver)  # noqa: B010
