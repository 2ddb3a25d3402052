"""Outputs are owned by one run, a full disk is one line, and a command's processes end with it.

- The lock a run holds on its ``--log-file`` / ``--checkpoint`` lives in the output itself (flock on its own
  descriptor): another $TMPDIR or a hard link cannot sidestep it, nothing is created in a shared temp folder,
  a symbolic link, another user's file or a world-writable one is refused, and a forked DataLoader worker never
  keeps it once its trainer is dead.
- A full disk (ENOSPC, injected at ``os.write``, the one call every writer goes through) is one line naming the
  file, exit 2: the checkpoint save, the run log (and the epoch is checkpointed before its record is logged, so it
  is not lost), ``plan --out``, ``report --out``.
- SIGTERM stops a command as Ctrl-C does (a checkpoint save's temp file removed), a save killed by SIGKILL leaves a
  temp file the next run removes, ``planner bench`` killed by SIGKILL leaves no fork server or rank running, and
  ``planner demo`` terminated leaves no stage running.
- The step log is opened once (a symbolic link swapped in mid-run is not written through) and a fresh run refuses
  a step log that holds another run's lines.

Every child process is killed in ``finally``; every wait has a deadline.
"""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from planner.cli import main
from planner.errors import ValidationError
from planner.paths import hold_exclusive, release_all
from tests.reliability.test_divergence import one_rank_plan

REPO = Path(__file__).resolve().parents[2]
MINIMAL = REPO / "planner" / "examples" / "minimal_profile.json"  # 2 ranks
COMMON = ["--device", "cpu", "--model", "mlp", "--num-samples", "32", "--quiet"]
DEADLINE_S = 60.0


def _one_line_error(err: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith("error:") or "Traceback" in line]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", PYTHONPATH=str(REPO))
    return env


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has ended
    except OSError:
        return False


def _kill(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def _children(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (from /proc)."""
    parent: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parent[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        kids = [c for c, pp in parent.items() if pp == p]
        out += kids
        todo += kids
    return [p for p in out if _alive(p)]


def _wait_until(what: str, done: Callable[[], bool], deadline_s: float = DEADLINE_S) -> None:
    end = time.monotonic() + deadline_s
    while not done():
        assert time.monotonic() < end, f"{what}: not within {deadline_s:.0f} s"
        time.sleep(0.1)


@contextmanager
def _holder(path: Path, *, fork_child: bool = False) -> Iterator[tuple[subprocess.Popen[str], int | None]]:
    """Another process that holds ``path`` (planner.paths.hold_exclusive), optionally with a forked child (what a
    DataLoader worker is); both killed on the way out."""
    code = ("import multiprocessing as mp, sys, time\n"
            "from planner.paths import hold_exclusive\n"
            "hold_exclusive(sys.argv[1], '--log-file')\n"
            "child = None\n"
            "if sys.argv[2] == '1':\n"
            "    child = mp.get_context('fork').Process(target=time.sleep, args=(120,), daemon=False)\n"
            "    child.start()\n"
            "    import os\n"
            "    fds, end = f'/proc/{child.pid}/fd', time.monotonic() + 30\n"
            "    # the child drops its copy as it starts (planner.paths: at fork); wait until it has\n"
            "    while time.monotonic() < end and any(os.path.realpath(f'{fds}/{n}') == os.path.realpath(sys.argv[1])\n"
            "                                         for n in os.listdir(fds)):\n"
            "        time.sleep(0.01)\n"
            "print('held', child.pid if child else '', flush=True)\n"
            "time.sleep(120)\n")
    proc = subprocess.Popen([sys.executable, "-c", code, str(path), "1" if fork_child else "0"], cwd=REPO,
                            env=_env(), stdout=subprocess.PIPE, text=True, start_new_session=True)
    child = None
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().split()  # the holder prints once it holds the lock
        assert line and line[0] == "held", line
        child = int(line[1]) if len(line) > 1 else None
        yield proc, child
    finally:
        _kill([proc.pid] + ([child] if child else []))
        proc.wait(timeout=30)


# -- 1. the lock is in the output itself ------------------------------------------------------------------------
@pytest.mark.subprocess
def test_the_lock_is_on_the_output_whatever_the_temp_dir_or_hard_link(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    log = tmp_path / "run.jsonl"
    link = tmp_path / "same-run.jsonl"
    log.touch()
    os.link(log, link)
    with _holder(log):
        with pytest.raises(ValidationError, match="is in use by another run"):
            hold_exclusive(str(link), "--log-file")  # a hard link names the same file
        from runtime import PlannedRun
        from tests.runtime.test_planned_run_agreement import _plan

        with pytest.raises(ValidationError, match=r"log_file .* is in use by another run"):
            PlannedRun(_plan(1), log_file=str(link)).sampler_for(100, "cpu")  # an own loop's run log: the same
        other = tmp_path / "other-tmp"
        other.mkdir()
        monkeypatch.setattr(tempfile, "tempdir", str(other))  # another $TMPDIR (Slurm sets one per job)
        with pytest.raises(ValidationError, match="is in use by another run"):
            hold_exclusive(str(log), "--log-file")
        assert list(other.iterdir()) == []  # nothing created outside the output
    release_all()


def test_holding_an_output_creates_nothing_in_the_temp_dir_and_refuses_what_another_user_could_change(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    shared_tmp = tmp_path / "tmp"
    shared_tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(shared_tmp))
    out = tmp_path / "out"
    out.mkdir()
    try:
        hold_exclusive(str(out / "run.jsonl"), "--log-file")
        hold_exclusive(str(out / "ck"), "--checkpoint", folder=True)
        assert list(shared_tmp.iterdir()) == []  # no lock folder another local user could pre-create or link
        target = out / "elsewhere.jsonl"
        (out / "link.jsonl").symlink_to(target)
        with pytest.raises(ValidationError, match="symbolic link"):
            hold_exclusive(str(out / "link.jsonl"), "--log-file")
        assert not target.exists()  # never created through the link
        theirs = out / "theirs.jsonl"
        theirs.touch()
        os.chown(theirs, 4242, 4242)  # the tests run as root: a file of another uid
        with pytest.raises(ValidationError, match="belongs to another user"):
            hold_exclusive(str(theirs), "--log-file")
        open_to_all = out / "open.jsonl"
        open_to_all.touch()
        open_to_all.chmod(0o666)
        with pytest.raises(ValidationError, match="writable by every user"):
            hold_exclusive(str(open_to_all), "--log-file")
    finally:
        release_all()
    assert not (out / "run.jsonl").exists() and not (out / "ck").exists()  # created, never written: removed


# -- 2. a forked worker never keeps the lock ----------------------------------------------------------------------
@pytest.mark.subprocess
def test_a_forked_child_does_not_keep_the_lock_of_a_killed_parent(tmp_path: Path) -> None:
    log = tmp_path / "run.jsonl"
    with _holder(log, fork_child=True) as (proc, child):
        assert child is not None
        os.kill(proc.pid, signal.SIGKILL)  # the trainer dies; its DataLoader worker lives on a while
        proc.wait(timeout=30)
        assert _alive(child)
        try:
            hold_exclusive(str(log), "--log-file")  # a --resume right after: not refused
        finally:
            release_all()


# -- 3. a full disk ----------------------------------------------------------------------------------------------
@contextmanager
def _full_disk(monkeypatch: pytest.MonkeyPatch, match: Callable[[str], bool], skip: int = 0) -> Iterator[list[str]]:
    """``os.write`` to a file whose path ``match``es fails with ENOSPC, after ``skip`` such writes succeed; yields
    the paths refused."""
    real = os.write
    seen: list[str] = []
    refused: list[str] = []

    def write(fd: int, data: bytes) -> int:  # type: ignore[override]
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            target = ""
        if match(target):
            seen.append(target)
            if len(seen) > skip:
                refused.append(target)
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, data)

    monkeypatch.setattr(os, "write", write)
    try:
        yield refused
    finally:
        monkeypatch.setattr(os, "write", real)


def test_a_full_disk_at_the_run_log_loses_no_trained_epoch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    plan, ck, log = one_rank_plan(tmp_path / "plan.json", 8), tmp_path / "ck", tmp_path / "run.jsonl"
    with _full_disk(monkeypatch, lambda p: p == str(log), skip=1) as refused:  # the start record is written
        rc = main(["train", "--plan", str(plan), *COMMON, "--epochs", "2", "--checkpoint", str(ck),
                   "--log-file", str(log)])
    line = _one_line_error(capsys.readouterr().err)
    assert rc == 2 and refused, line
    assert line.startswith(f"error: cannot write {log}: no space left on device"), line
    import torch

    state = torch.load(ck / "checkpoint.pt", map_location="cpu", weights_only=True)
    assert (state["epoch"], state["step"]) == (1, 0)  # epoch 0 was saved before its record failed to log


def test_a_full_disk_at_the_checkpoint_is_one_line_and_leaves_no_temp_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    plan, ck = one_rank_plan(tmp_path / "plan.json", 8), tmp_path / "ck"
    with _full_disk(monkeypatch, lambda p: "/.checkpoint." in p) as refused:
        rc = main(["train", "--plan", str(plan), *COMMON, "--epochs", "1", "--checkpoint", str(ck)])
    line = _one_line_error(capsys.readouterr().err)
    assert rc == 2 and refused, line
    assert line.startswith(f"error: cannot write {ck / 'checkpoint.pt'}: no space left on device (ENOSPC)"), line
    assert not ck.exists()  # no temp file; the folder this run created holds nothing, so it is removed too


@pytest.mark.parametrize("command", ["plan", "report"])
def test_a_full_disk_at_plan_or_report_out_is_one_line(command: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    plan = tmp_path / "plan.json"
    assert main(["plan", "--profile", str(MINIMAL), "--global-batch", "64", "--out", str(plan)]) == 0
    out = tmp_path / ("plan2.json" if command == "plan" else "report.html")
    argv = (["plan", "--profile", str(MINIMAL), "--global-batch", "64", "--out", str(out)] if command == "plan"
            else ["report", "--profile", str(MINIMAL), "--plan", str(plan), "--out", str(out)])
    capsys.readouterr()
    with _full_disk(monkeypatch, lambda p: os.path.basename(p).startswith(f".{out.name}.")) as refused:
        rc = main(argv)
    line = _one_line_error(capsys.readouterr().err)
    assert rc == 2 and refused, line
    assert line.startswith(f"error: cannot write {out}: no space left on device"), line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.json"]  # no output, no temp file


# -- 4. signals --------------------------------------------------------------------------------------------------
_SIGTERM_MID_SAVE = """
import os, signal, sys
real, sent = os.write, []
def write(fd, data):
    try:
        target = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        target = ""
    if "/.checkpoint." in target and not sent:
        sent.append(1)
        os.kill(os.getpid(), signal.SIGTERM)  # what a scheduler's preemption sends, once, mid-save
    return real(fd, data)
os.write = write
from planner.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.subprocess
def test_sigterm_mid_save_cleans_up_like_ctrl_c_and_a_killed_saves_temp_file_is_swept(tmp_path: Path) -> None:
    plan, ck, log = one_rank_plan(tmp_path / "plan.json", 8), tmp_path / "ck", tmp_path / "run.jsonl"
    proc = subprocess.Popen([sys.executable, "-c", _SIGTERM_MID_SAVE, "train", "--plan", str(plan), *COMMON,
                             "--epochs", "1", "--checkpoint", str(ck), "--log-file", str(log)], cwd=REPO, env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        _, err = proc.communicate(timeout=DEADLINE_S)
    finally:
        _kill([proc.pid])
        proc.wait(timeout=30)
    assert proc.returncode == 143 and err.strip().splitlines()[-1] == "terminated (SIGTERM)", err[-2000:]
    assert not ck.exists()  # the temp file removed; the folder this run created, left empty, removed too
    assert '"reason": "interrupted"' in log.read_text().splitlines()[-1]
    # What a save killed by SIGKILL leaves: the next run that holds the folder removes it.
    ck.mkdir()
    (ck / ".checkpoint.k1ll3d00.tmp").write_bytes(b"\0" * 1024)
    assert main(["train", "--plan", str(plan), *COMMON, "--epochs", "1", "--checkpoint", str(ck)]) == 0
    assert sorted(p.name for p in ck.iterdir()) == ["checkpoint.pt"]


def _launch(argv: list[str], tmp_path: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "planner", *argv], cwd=REPO, env=_env(), stdout=subprocess.DEVNULL,
                            stderr=open(tmp_path / "stderr.txt", "wb"), start_new_session=True)


@pytest.mark.subprocess
def test_bench_killed_by_sigkill_leaves_no_fork_server_or_rank_running(tmp_path: Path) -> None:
    proc = _launch(["bench", "--device", "cpu", "--nproc", "2", "--model", "mlp", "--quick", "--global-batch", "32",
                    "--steps", "5000", "--rounds", "3", "--timeout", "300"], tmp_path)
    left: list[int] = []
    try:
        def ranks_started() -> bool:
            assert proc.poll() is None, (tmp_path / "stderr.txt").read_text()[-2000:]
            return len(_children(proc.pid)) >= 4  # resource tracker, fork server, 2 ranks

        _wait_until("bench's ranks start", ranks_started)
        left = _children(proc.pid)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        _wait_until("every process bench started ends", lambda: not any(_alive(p) for p in left), 30.0)
    finally:
        _kill([proc.pid, *left])
        proc.wait(timeout=30)


@pytest.mark.subprocess
def test_demo_terminated_stops_its_stage_before_it_writes(tmp_path: Path) -> None:
    out = tmp_path / "demo"
    proc = _launch(["demo", "--out", str(out), "--device", "cpu", "--model", "mlp", "--stage-timeout", "300"],
                   tmp_path)
    left: list[int] = []
    try:
        def stage_started() -> bool:
            assert proc.poll() is None, (tmp_path / "stderr.txt").read_text()[-2000:]
            return len(_children(proc.pid)) >= 2  # torchrun and at least one of its ranks

        _wait_until("the demo's profile stage starts", stage_started)
        left = _children(proc.pid)
        os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=DEADLINE_S) == 143, (tmp_path / "stderr.txt").read_text()[-2000:]
        _wait_until("the stage's processes end", lambda: not any(_alive(p) for p in left), 30.0)
        assert not (out / "profile.json").exists()
    finally:
        _kill([proc.pid, *left])
        proc.wait(timeout=30)


@pytest.mark.subprocess
def test_a_child_tied_to_its_parent_dies_when_the_parent_is_killed(tmp_path: Path) -> None:
    code = ("import subprocess, sys, time\n"
            "from planner.lifetime import child_dies_with_parent\n"
            "p = subprocess.Popen(['sleep', '120'], preexec_fn=child_dies_with_parent())\n"
            "print(p.pid, flush=True)\n"
            "time.sleep(120)\n")
    parent = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, env=_env(), stdout=subprocess.PIPE, text=True,
                              start_new_session=True)
    child = None
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        assert _alive(child)
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(timeout=30)
        _wait_until("the child ends with its parent", lambda: not _alive(child), 30.0)
    finally:
        _kill([parent.pid] + ([child] if child else []))
        parent.wait(timeout=30)


# -- 5. the step log ---------------------------------------------------------------------------------------------
def test_the_step_log_is_opened_once_and_never_appended_to_by_another_run(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import planner.cli.train as trainer

    plan, steps, victim = one_rank_plan(tmp_path / "plan.json", 8), tmp_path / "steps.jsonl", tmp_path / "victim"
    victim.write_text("")
    real_end_epoch = trainer.end_epoch

    def end_epoch_then_swap(*args: object, **kw: object) -> None:
        real_end_epoch(*args, **kw)  # type: ignore[arg-type]
        if not os.path.islink(steps):  # after epoch 0: the step log's path becomes a link to another file
            os.rename(steps, tmp_path / "steps-kept.jsonl")
            os.symlink(victim, steps)

    monkeypatch.setattr(trainer, "end_epoch", end_epoch_then_swap)
    assert main(["train", "--plan", str(plan), *COMMON, "--epochs", "2", "--step-log", str(steps)]) == 0
    monkeypatch.setattr(trainer, "end_epoch", real_end_epoch)
    assert victim.read_text() == ""
    assert len((tmp_path / "steps-kept.jsonl").read_text().splitlines()) == 2  # both epochs, in the file opened
    # A finished run's step log: a fresh run refuses to append to it.
    os.unlink(steps)
    os.rename(tmp_path / "steps-kept.jsonl", steps)
    before = steps.read_bytes()
    capsys.readouterr()
    rc = main(["train", "--plan", str(plan), *COMMON, "--epochs", "1", "--step-log", str(steps)])
    line = _one_line_error(capsys.readouterr().err)
    assert rc == 2 and line.startswith(f"error: --step-log {steps}: already holds"), line
    assert steps.read_bytes() == before


@pytest.mark.distributed
@pytest.mark.parametrize("when", ["epoch-end", "mid-epoch"])
def test_a_full_disk_at_rank_0s_checkpoint_is_every_ranks_one_line(when: str, tmp_path: Path) -> None:
    from tests._ranks import run_each
    from tests.reliability.test_no_hangs import write_plan

    plan, ck = write_plan(tmp_path / "plan.json", [8, 8]), tmp_path / "ck"
    every = ["--checkpoint-every", "1"] if when == "mid-epoch" else []
    codes, _, err, _ = run_each([str(REPO / "tests" / "reliability" / "_full_disk_rank.py"), "train", "--plan",
                                 str(plan), *COMMON, "--epochs", "1", "--checkpoint", str(ck), *every], nproc=2,
                                timeout_s=DEADLINE_S)
    lines = [line for line in err.splitlines() if line.startswith("error:") or "Traceback" in line]
    want = f"error: cannot write {ck / 'checkpoint.pt'}: no space left on device (ENOSPC)"
    assert codes == [2, 2] and len(lines) == 2 and all(line.startswith(want) for line in lines), err[-3000:]
    assert not ck.exists()


def test_bench_refuses_a_step_log_of_another_run_before_its_ranks_start(tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    old = tmp_path / "steps_plan_1_1.jsonl"  # what an earlier bench wrote for strategy plan, round 1, rank 1
    old.write_text('{"epoch": 0}\n')
    rc = main(["bench", "--device", "cpu", "--nproc", "2", "--model", "mlp", "--quick", "--global-batch", "32",
               "--step-log", str(tmp_path / "steps_{strategy}_{round}_{rank}.jsonl")])
    line = _one_line_error(capsys.readouterr().err)
    assert rc == 2 and line.startswith("error: --step-log ") and f"{old.name}: already holds 13 bytes" in line, line
    assert old.read_text() == '{"epoch": 0}\n'
