"""The shared up-front checks, function by function: output paths (planner/paths.py), argument ranges and the
resume comparison (planner/argcheck.py), and a stdout that cannot take a command down (planner/stdio.py).

The end-to-end cases (every command, exit 2, one line, nothing written) are in test_cli_input_refusals.py; here each refusal
is pinned to its reason. Nothing here writes to a device: /dev/full is only ever *checked*, never opened -- a
regression must not be able to replace the box's /dev/full with a file.
"""

from __future__ import annotations

import errno
import io
import os
import stat
from pathlib import Path

import pytest

from planner.argcheck import ResumeValue, check_global_batch, check_ranks, check_resume, count, real
from planner.errors import ValidationError
from planner.paths import TEMP_AFFIX_BYTES, Output, check_output_file, check_output_folder, check_outputs, same_file
from planner.stdio import GuardedStdout


def _refused(path: str | Path, needle: str) -> None:
    with pytest.raises(ValidationError, match=None) as e:
        check_output_file(str(path), "--out")
    assert needle in str(e.value), str(e.value)
    assert "\n" not in str(e.value)


def test_output_file_refusals(tmp_path: Path) -> None:
    (tmp_path / "dir").mkdir()
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "target.json").write_text("{}")
    os.symlink(tmp_path / "target.json", tmp_path / "link.json")
    os.symlink(tmp_path / "nowhere.json", tmp_path / "broken.json")
    _refused("", "the path is empty")
    _refused(f"{tmp_path}/dir/", "names a folder")
    _refused(tmp_path / "dir", "is a folder, not a regular file")
    _refused(tmp_path / "fifo", "is a FIFO (named pipe), not a regular file")
    _refused(tmp_path / "link.json", "is a symbolic link (to ")
    _refused(tmp_path / "broken.json", "is a symbolic link")
    _refused("/dev/full", "is a character device, not a regular file")
    _refused(tmp_path / "missing" / "x.json", "does not exist; create it first")
    _refused(tmp_path / "target.json" / "x.json", "is not a folder")
    _refused(tmp_path / ("a" * 300), "the file name is 300 bytes; this file system allows 255")
    # the longest name that still fits beside the writer's temp-file affixes passes, one more byte does not
    check_output_file(str(tmp_path / ("b" * (255 - TEMP_AFFIX_BYTES))), "--out")
    _refused(tmp_path / ("b" * (256 - TEMP_AFFIX_BYTES)), "outputs are written through a temporary file")
    if os.path.isdir("/sys"):  # not writable even for root: the probe catches what access() would not
        _refused("/sys/plan.json", "cannot write in folder '/sys'")
    assert (tmp_path / "target.json").read_text() == "{}" and stat.S_ISFIFO(os.stat(tmp_path / "fifo").st_mode)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["broken.json", "dir", "fifo", "link.json", "target.json"]


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through file modes")
def test_read_only_file_and_folder_are_refused(tmp_path: Path) -> None:
    ro = tmp_path / "ro.json"
    ro.write_text("{}")
    ro.chmod(0o444)
    _refused(ro, "the file is read-only")
    folder = tmp_path / "locked"
    folder.mkdir()
    folder.chmod(0o555)
    try:
        _refused(folder / "x.json", "cannot write in folder")
    finally:
        folder.chmod(0o755)


def test_a_regular_file_in_an_existing_folder_passes_and_nothing_is_left(tmp_path: Path) -> None:
    (tmp_path / "old.json").write_text("old")
    check_output_file(str(tmp_path / "new.json"), "--out")
    check_output_file(str(tmp_path / "old.json"), "--out")  # replacing one's own earlier output is fine
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old.json"]  # the write probe cleaned up


def test_output_folder(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValidationError, match="is a regular file, not a folder"):
        check_output_folder(str(tmp_path / "file"), "--checkpoint")
    with pytest.raises(ValidationError, match="a part of the path is a file, not a folder"):
        check_output_folder(str(tmp_path / "file" / "sub"), "--checkpoint")
    (tmp_path / "ck").mkdir()
    (tmp_path / "ck" / "checkpoint.pt").mkdir()
    with pytest.raises(ValidationError, match=r"checkpoint\.pt in it is a folder, not a regular file"):
        check_output_folder(str(tmp_path / "ck"), "--checkpoint", ("checkpoint.pt",))
    check_output_folder(str(tmp_path / "new" / "deeper"), "--checkpoint")  # created later, like mkdir -p
    assert not (tmp_path / "new").exists()


def test_an_output_is_never_an_input_nor_another_output(tmp_path: Path) -> None:
    prof = tmp_path / "profile.json"
    prof.write_text("{}")
    os.symlink(prof, tmp_path / "alias.json")
    os.link(prof, tmp_path / "hard.json")
    for spelled in (str(prof), f"{tmp_path}/./profile.json", str(tmp_path / "hard.json")):
        with pytest.raises(ValidationError, match="is the --profile input") as e:
            check_outputs([Output(flag="--out", path=spelled)], {"--profile": str(prof)})
        assert "writing it would destroy it" in str(e.value)
    assert same_file(str(tmp_path / "alias.json"), str(prof))  # an input read through a link is the file itself
    with pytest.raises(ValidationError, match="--out and --json both name"):
        check_outputs([Output(flag="--out", path=str(tmp_path / "r")), Output(flag="--json", path=str(tmp_path / "r"))])
    with pytest.raises(ValidationError, match="is the --plan input"):  # a folder output's files count too
        check_outputs([Output(flag="--checkpoint", path=str(tmp_path), folder=True, files=("profile.json",))],
                      {"--plan": str(prof)})
    check_outputs([Output(flag="--out", path=None)], {"--profile": str(prof)})  # not given: nothing to check
    assert prof.read_text() == "{}"


@pytest.mark.parametrize(("parse", "text", "needle"), [
    (count(), "0", "must be >= 1, got 0"),
    (count(), "-3", "must be >= 1, got -3"),
    (count(), str(2**63), "must be <= 2147483647"),
    (count(), "1.5", "expected an integer"),
    (count(0), "-1", "must be >= 0"),
    (real(0.0, lo_open=True), "0", "must be > 0"),
    (real(0.0, lo_open=True), "-1", "must be > 0"),
    (real(0.0, lo_open=True), "nan", "must be a finite number"),
    (real(0.0, lo_open=True), "1e400", "must be a finite number"),
    (real(0.0, 1.0, hi_open=True), "1", "must be < 1"),
    (real(), "abc", "expected a number"),
])
def test_argument_types_refuse_out_of_range(parse: object, text: str, needle: str) -> None:
    import argparse

    with pytest.raises(argparse.ArgumentTypeError, match=None) as e:
        parse(text)  # type: ignore[operator]
    assert needle in str(e.value)


def test_rank_maps_and_global_batch() -> None:
    check_ranks({0: 3.0}, 1, "--emulate-slowdown")
    with pytest.raises(ValidationError, match=r"--emulate-slowdown: rank 5 does not exist in a job of 1 rank\(s\)"):
        check_ranks({5: 3.0}, 1, "--emulate-slowdown")
    with pytest.raises(ValidationError, match=r"--global-batch 2 cannot give each of 2 rank\(s\) the min batch 2"):
        check_global_batch(2, 2, 2)
    check_global_batch(4, 2, 2)


def test_resume_comparison_names_both_values() -> None:
    same = ResumeValue(flag="--lr", saved=0.1, given=None)  # not given: the checkpoint's, nothing to say
    lr = ResumeValue(flag="--lr", saved=0.1, given=0.001)
    assert check_resume([same], allow=False) == []
    with pytest.raises(ValidationError) as e:
        check_resume([same, lr], allow=False)
    assert str(e.value) == ("--resume: --lr 0.001 differs from the checkpoint's 0.1; resume with --lr 0.1, or pass "
                            "--allow-resume-changes to continue with 0.001")
    assert check_resume([lr], allow=True) == [
        "resuming with --lr 0.001 instead of the checkpoint's 0.1 (--allow-resume-changes)"]
    fixed = ResumeValue(flag="--model", saved="mlp", given="resnet18", changeable=False, why="weights differ")
    with pytest.raises(ValidationError, match="--model resnet18 differs from the checkpoint's mlp; weights differ"):
        check_resume([fixed], allow=True)


class _Failing(io.StringIO):
    def __init__(self, err: int) -> None:
        super().__init__()
        self.err = err

    def write(self, s: str) -> int:
        raise BrokenPipeError(errno.EPIPE, "Broken pipe") if self.err == errno.EPIPE else OSError(self.err, os.strerror(self.err))


def test_guarded_stdout_keeps_going_and_says_what_was_lost() -> None:
    closed = GuardedStdout(_Failing(errno.EPIPE))
    assert closed.write("table\n") == 6 and closed.write("more\n") == 5  # no exception, the rest dropped
    closed.flush()
    assert closed.reader_left and closed.problem() is None  # `| head -1`: the reader chose to stop
    full = GuardedStdout(_Failing(errno.ENOSPC))
    print("x", file=full)  # type: ignore[arg-type]
    problem = full.problem()
    assert problem is not None and "No space left on device" in problem and "\n" not in problem
    fine = GuardedStdout(io.StringIO())
    fine.write("ok")
    assert fine.error is None and fine.problem() is None and fine.inner.getvalue() == "ok"  # type: ignore[attr-defined]
