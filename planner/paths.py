"""Output paths checked before any work starts: a command refuses, in one line, a path it could not write.

Every command that writes (``plan --out``, ``profile --out``, ``report --out/--json``, ``train --log-file/
--checkpoint``, ``bench --json``, ``demo --out``) calls ``check_outputs`` first, on every rank, before it
measures, trains or benchmarks anything -- a bad path found after 76 s of benchmarking loses the 76 s.  What is
refused, and why:

- an empty path, or one naming a folder (``--out runs/``): nothing sensible to write;
- an existing folder, device (/dev/full), FIFO, socket or symbolic link: the atomic writer (temp file +
  ``os.replace``, planner.jsonio) would *replace* the node with a regular file -- a device or a link is destroyed,
  not written through;
- a folder that does not exist (file outputs; folder outputs such as ``--checkpoint DIR`` are created), one we
  cannot create files in (permissions, read-only file system), a name too long for the file system once the
  writer's temp-file affixes are added;
- an output that is the same file as an input (after resolving symbolic links and hard links:
  ``plan --profile X --out X`` would destroy the profile), or as another output.

Then, while a run writes, it owns its outputs (``hold_exclusive``: a lock on the output itself, the file written
through the descriptor that was checked), and every writer goes through ``write_all``, so a full disk is one line
naming the file (``write_error``) instead of a traceback.

Pure: the standard library only (no torch), so `planner plan` and the programs share it.
"""

from __future__ import annotations

import errno
import os
import stat
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass

from planner.errors import ValidationError

# planner.jsonio.write_text_atomic writes ".{name}.XXXXXXXX.tmp" beside the target: 14 bytes more than the name.
TEMP_AFFIX_BYTES = len(".") + len(".") + 8 + len(".tmp")
_DEFAULT_NAME_MAX = 255
_DEFAULT_PATH_MAX = 4096
_KINDS = ((stat.S_ISCHR, "character device"), (stat.S_ISBLK, "block device"), (stat.S_ISFIFO, "FIFO (named pipe)"),
          (stat.S_ISSOCK, "socket"), (stat.S_ISDIR, "folder"), (stat.S_ISLNK, "symbolic link"))


@dataclass(frozen=True, kw_only=True, slots=True)
class Output:
    """One path a command will write."""

    flag: str
    """The option that named it (``--out``), for the message."""
    path: str | None
    """None: the option was not given (nothing to check)."""
    folder: bool = False
    """A folder the command writes files into (``--checkpoint DIR``), created when missing."""
    files: tuple[str, ...] = ()
    """For a folder: the file names the command writes inside it (``checkpoint.pt``), checked like outputs."""


def _node_kind(mode: int) -> str | None:
    for test, name in _KINDS:
        if test(mode):
            return name
    return None


def _lstat(path: str, flag: str, *, follow: bool = False) -> os.stat_result | None:
    try:
        return os.stat(path) if follow else os.lstat(path)
    except FileNotFoundError:
        return None
    except OSError as e:  # a component is a file (ENOTDIR), a name too long, no permission on a parent ...
        why = "a part of the path is a file, not a folder" if e.errno == errno.ENOTDIR else e.strerror
        raise ValidationError(f"{flag} {_show(path)}: {why}") from None


def _stat(path: str, flag: str) -> os.stat_result | None:
    return _lstat(path, flag, follow=True)


def _limit(folder: str, name: str, default: int) -> int:
    try:
        return int(os.pathconf(folder, name))
    except (OSError, ValueError):
        return default


def _probe_writable(folder: str, flag: str, shown: str) -> None:
    """Create and remove one empty temp file in `folder`: the only test that catches every reason a write fails
    (permissions, a read-only mount, /proc or /sys, root's access() that always says yes)."""
    try:
        fd, tmp = tempfile.mkstemp(prefix=".planner-probe.", dir=folder)
    except OSError as e:
        raise ValidationError(f"{flag} {shown}: cannot write in folder {folder!r} ({e.strerror})") from None
    os.close(fd)
    os.unlink(tmp)


def _check_name(path: str, flag: str, shown: str, folder: str) -> None:
    name = os.path.basename(path)
    name_max = _limit(folder, "PC_NAME_MAX", _DEFAULT_NAME_MAX)
    n = len(os.fsencode(name))
    if n + TEMP_AFFIX_BYTES > name_max:
        raise ValidationError(
            f"{flag} {shown}: the file name is {n} bytes; this file system allows {name_max}, and outputs are "
            f"written through a temporary file beside them, so at most {name_max - TEMP_AFFIX_BYTES}")
    path_max = _limit(folder, "PC_PATH_MAX", _DEFAULT_PATH_MAX)
    full = len(os.fsencode(os.path.abspath(path))) + TEMP_AFFIX_BYTES
    if full >= path_max:
        raise ValidationError(f"{flag} {shown}: the path is {full - TEMP_AFFIX_BYTES} bytes long; this file system "
                              f"allows {path_max - TEMP_AFFIX_BYTES - 1} for an output")


SHOWN_PATH = 400
"""Characters of a path an error line shows whole: a real path is read in full (the user must find the file),
only a path longer than any a user types (bad input, a runaway join) is cut, keeping its start and its end."""


def _show(path: str) -> str:
    return path if len(path) <= SHOWN_PATH else path[:200] + "..." + path[-150:]


def check_output_file(path: str, flag: str) -> None:
    """Refuse (ValidationError, one line) a path that a regular-file output cannot safely be written to."""
    shown = _show(path)
    if not path:
        raise ValidationError(f"{flag}: the path is empty; name the file to write")
    if path.endswith(os.sep) or os.path.basename(path) in ("", ".", ".."):
        raise ValidationError(f"{flag} {shown}: names a folder; give a file name, e.g. {path.rstrip(os.sep)}/out.json")
    folder = os.path.dirname(path) or "."
    fst = _stat(folder, flag)
    if fst is None:
        raise ValidationError(f"{flag} {shown}: folder {_show(folder)!r} does not exist; create it first")
    if not stat.S_ISDIR(fst.st_mode):
        raise ValidationError(f"{flag} {shown}: {_show(folder)!r} is not a folder")
    _check_name(path, flag, shown, folder)
    st = _lstat(path, flag)
    if st is not None:
        kind = _node_kind(st.st_mode)
        if kind == "symbolic link":
            raise ValidationError(
                f"{flag} {shown}: is a symbolic link (to {os.readlink(path)!r}); writing would replace the link with "
                "a file -- name the target itself")
        if kind is not None:
            raise ValidationError(f"{flag} {shown}: is a {kind}, not a regular file; writing would replace it -- "
                                  "name a file")
        if not os.access(path, os.W_OK):
            raise ValidationError(f"{flag} {shown}: the file is read-only; make it writable or name another file")
    _probe_writable(folder, flag, shown)


def check_output_folder(path: str, flag: str, files: tuple[str, ...] = ()) -> None:
    """Refuse a folder output that is not a folder, cannot be created, or holds a non-file where we write `files`.

    A missing folder is fine when it can be created (like ``mkdir -p``): the nearest existing ancestor must be a
    folder we can write in.
    """
    shown = _show(path)
    if not path:
        raise ValidationError(f"{flag}: the path is empty; name a folder")
    st = _stat(path, flag)
    if st is not None and not stat.S_ISDIR(st.st_mode):
        kind = _node_kind(st.st_mode) or "regular file"
        raise ValidationError(f"{flag} {shown}: is a {kind}, not a folder; name a folder (it is created when missing)")
    if st is None and _lstat(path, flag) is not None:
        raise ValidationError(f"{flag} {shown}: is a broken symbolic link (to {os.readlink(path)!r})")
    if st is None:
        ancestor = os.path.dirname(os.path.abspath(path))
        while _stat(ancestor, flag) is None:  # a file on the way raises (ENOTDIR) in _stat
            ancestor = os.path.dirname(ancestor)
        _probe_writable(ancestor, flag, shown)
        return
    for name in files:
        inner = os.path.join(path, name)
        ist = _lstat(inner, flag)
        if ist is not None and _node_kind(ist.st_mode) is not None:
            raise ValidationError(f"{flag} {shown}: {name} in it is a {_node_kind(ist.st_mode)}, not a regular file; "
                                  "writing would replace it -- remove it or name another folder")
        _check_name(inner, flag, shown, path)
    _probe_writable(path, flag, shown)


def same_file(a: str, b: str) -> bool:
    """True when both paths name one file: equal after resolving symbolic links, or the same inode (hard links)."""
    if os.path.realpath(a) == os.path.realpath(b):
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def check_outputs(outputs: list[Output], inputs: Mapping[str, str | None] | None = None) -> None:
    """Check every output (``check_output_file`` / ``check_output_folder``), then that no output is an input or
    another output.  ``inputs`` maps an option (``--profile``) to the path it read (None: not given).

    Raises:
        ValidationError: the first problem, in one line naming the option(s) and the path.
    """
    given = [o for o in outputs if o.path is not None]
    for o in given:
        assert o.path is not None
        if o.folder:
            check_output_folder(o.path, o.flag, o.files)
        else:
            check_output_file(o.path, o.flag)
    # What is actually written: a file output, or each named file inside a folder output.
    written = [(o.flag, o.path) for o in given if not o.folder and o.path]
    written += [(o.flag, os.path.join(o.path, f)) for o in given if o.folder and o.path for f in o.files]
    for flag, path in written:
        for in_flag, in_path in (inputs or {}).items():
            if in_path and same_file(path, in_path):
                spelled = "" if os.path.abspath(path) == os.path.abspath(in_path) else f" ({_show(in_path)})"
                raise ValidationError(f"{flag} {_show(path)} is the {in_flag} input{spelled}: writing it would "
                                      "destroy it; name another output file")
    for i, (flag, path) in enumerate(written):
        for other_flag, other in written[i + 1:]:
            if same_file(path, other):
                raise ValidationError(f"{flag} and {other_flag} both name {_show(path)}; give each its own file")


# -- ownership: one run at a time writes an output, through the descriptor it locked ---------------------------
#
# The lock lives in the output itself: ``flock`` on the open log file, on the checkpoint folder's own descriptor.
# Any two opens of one inode see each other's lock, whatever path, hard link or $TMPDIR each run has, and nothing
# is created outside the output (no shared lock folder another user could pre-create, fill with a file, or point
# elsewhere with a symbolic link).  A file is opened with O_NOFOLLOW (a link swapped in after the checks is refused,
# not written through) and O_NONBLOCK (a FIFO swapped in is refused, never waited on); an existing one must be a
# regular file owned by this user and not writable by every user.  The writers (the run log, the step log) write
# through the locked descriptor, so the file checked is the file written, for the whole run.
#
# The descriptors are close-on-exec, and a forked child (a DataLoader worker) points its copies at /dev/null as it
# starts: a flock belongs to the open file, so a worker's copy kept the lock after its trainer was killed until
# the worker noticed (about 5 s), and a ``--resume`` right after was refused.

@dataclass(slots=True)
class _Claim:
    fd: int
    path: str
    folder: bool
    created: bool
    """This process created the file or folder: released unused (empty), it is removed again."""
    users: int = 1


_CLAIMS: dict[tuple[int, int], _Claim] = {}
"""Outputs this process holds, by (device, inode): the kernel releases them when the process ends."""


def _refuse(path: str, flag: str, why: str) -> ValidationError:
    return ValidationError(f"{flag} {_show(path)}: {why}")


def _check_owned(st: os.stat_result, path: str, flag: str, what: str) -> None:
    uid = os.geteuid() if hasattr(os, "geteuid") else st.st_uid
    if st.st_uid != uid:
        raise _refuse(path, flag, f"the {what} belongs to another user (uid {st.st_uid}; this is uid {uid}); a run "
                                  f"writes only into outputs it owns -- name another {what}")
    if st.st_mode & stat.S_IWOTH:
        raise _refuse(path, flag, f"the {what} is writable by every user (mode {stat.S_IMODE(st.st_mode):04o}); "
                                  f"another user could replace what the run writes -- chmod o-w it or name another "
                                  f"{what}")


def _open_file(path: str, flag: str) -> tuple[int, bool]:
    flags = (os.O_WRONLY | os.O_APPEND | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
             | getattr(os, "O_CLOEXEC", 0))
    try:
        try:
            return os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o644), True
        except FileExistsError:
            return os.open(path, flags), False
    except OSError as e:
        why = {errno.ELOOP: "is a symbolic link; name the target itself",
               errno.ENXIO: "is a FIFO (named pipe), not a regular file -- name a file",
               errno.EISDIR: "is a folder, not a file -- name a file",
               errno.ENOSPC: "no space left on device"}.get(e.errno or 0, e.strerror or str(e))
        raise _refuse(path, flag, why) from None


def _open_folder(path: str, flag: str) -> tuple[int, bool]:
    created = not os.path.lexists(path)
    try:
        if created:  # 0755: a folder the run makes is never writable by other users (umask 0 would give 0777)
            os.makedirs(path, mode=0o755, exist_ok=True)
        return os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0)), created
    except OSError as e:
        why = "is not a folder" if e.errno == errno.ENOTDIR else (e.strerror or str(e))
        raise _refuse(path, flag, why) from None


def hold_exclusive(path: str, flag: str, *, folder: bool = False, stale_prefix: str | None = None) -> int:
    """Own an output for the rest of this process (or until ``release``), or refuse in one line; returns the
    descriptor the writer writes through (a file, opened for appending) or that holds the folder.

    Two runs given the same ``--checkpoint`` folder or ``--log-file`` both pass the fresh-run checks, then
    interleave their lines in one log (which then reads as one valid, finished run) and overwrite each other's
    checkpoints.  ``flock`` on the output's own descriptor (see above): advisory, released by the kernel when the
    process dies (kill -9 included), so a crashed run never leaves a stale lock.  It guards runs on one host; runs
    on two hosts writing one shared-file-system folder are not seen.  A process that already holds the output (the
    same path named twice, or two writers of one file) shares its hold.

    ``stale_prefix`` (folders): once the folder is held, temp files ``<prefix>*.tmp`` in it are removed -- the
    writer that left one was killed mid-write (kill -9, a lost node), and no live writer can own one while we hold
    the folder.
    """
    try:
        import fcntl
    except ImportError:  # no flock on this platform: nothing to hold
        fcntl = None  # type: ignore[assignment]
    fd, created = _open_folder(path, flag) if folder else _open_file(path, flag)
    try:
        st = os.fstat(fd)
        key = (st.st_dev, st.st_ino)
        if key in _CLAIMS:  # this process holds it already
            os.close(fd)
            _CLAIMS[key].users += 1
            return _CLAIMS[key].fd
        if not folder and not stat.S_ISREG(st.st_mode):
            raise _refuse(path, flag, f"is a {_node_kind(st.st_mode) or 'special file'}, not a regular file -- "
                                      "name a file")
        if not created:
            _check_owned(st, path, flag, "folder" if folder else "file")
        if fcntl is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise ValidationError(f"{flag} {_show(path)} is in use by another run (it holds the lock); wait for "
                                      f"it to finish, or name another {'folder' if folder else 'file'}") from None
    except BaseException:
        os.close(fd)
        if created:
            _remove_unused(path, folder)
        raise
    _CLAIMS[key] = _Claim(fd=fd, path=path, folder=folder, created=created)
    if folder and stale_prefix:
        sweep_stale_temp_files(path, stale_prefix)
    return fd


def held_elsewhere(path: str) -> bool:
    """True when another process holds output ``path`` (a folder or a file): for tests and tools."""
    import fcntl

    fd = os.open(path, os.O_RDONLY if os.path.isdir(path) else os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # closing our own description releases what we took
    return False


def sweep_stale_temp_files(folder: str, prefix: str) -> list[str]:
    """Remove ``<prefix>*.tmp`` regular files of this user in ``folder`` (call it holding the folder); their
    names."""
    gone: list[str] = []
    uid = os.geteuid() if hasattr(os, "geteuid") else None
    try:
        names = os.listdir(folder)
    except OSError:
        return gone
    for name in names:
        if not (name.startswith(prefix) and name.endswith(".tmp")):
            continue
        inner = os.path.join(folder, name)
        try:
            st = os.lstat(inner)
            if stat.S_ISREG(st.st_mode) and (uid is None or st.st_uid == uid):
                os.unlink(inner)
                gone.append(name)
        except OSError:
            continue
    return gone


def _remove_unused(path: str, folder: bool) -> None:
    """Remove an output this process created and never wrote into (a refused run leaves nothing behind)."""
    try:
        if folder:
            os.rmdir(path)  # only when empty
        elif os.lstat(path).st_size == 0:
            os.unlink(path)
    except OSError:
        pass


def release(fd: int) -> None:
    """Give up one hold of the output held through ``fd`` (``hold_exclusive``'s return); the last one unlocks and
    closes it, removing it when this process created it and left it empty."""
    for key, claim in list(_CLAIMS.items()):
        if claim.fd == fd:
            claim.users -= 1
            if claim.users <= 0:
                del _CLAIMS[key]
                _close_claim(claim, key)
            return


def _close_claim(claim: _Claim, key: tuple[int, int]) -> None:
    unused = False
    if claim.created:
        try:
            st = os.lstat(claim.path)
            same = (st.st_dev, st.st_ino) == key
            unused = same and ((claim.folder and not os.listdir(claim.path)) or (not claim.folder and not st.st_size))
        except OSError:
            pass
    os.close(claim.fd)  # the lock goes with the last descriptor of the open file
    if unused:
        _remove_unused(claim.path, claim.folder)


def release_all() -> None:
    """Release every output this process holds (a command's end: in-process callers run several)."""
    while _CLAIMS:
        key, claim = next(iter(_CLAIMS.items()))
        del _CLAIMS[key]
        _close_claim(claim, key)


def open_for_append(path: str, flag: str) -> int:
    """A descriptor appending to output ``path`` for the whole run, for a log several writers may share (``train
    --step-log`` without ``{rank}``: no lock).  Opened once, with O_NOFOLLOW and O_NONBLOCK and checked like a held
    output, so a symbolic link or FIFO swapped in mid-run is never written through (reopened by path each epoch,
    a swapped link appended the steps to another file)."""
    fd, created = _open_file(path, flag)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _refuse(path, flag, f"is a {_node_kind(st.st_mode) or 'special file'}, not a regular file -- "
                                      "name a file")
        if not created:
            _check_owned(st, path, flag, "file")
    except BaseException:
        os.close(fd)
        raise
    return fd


def check_not_written(path: str | None, flag: str) -> None:
    """Refuse, for a run that starts afresh, a log that already holds another run's lines (a finished run's step
    log was appended to): a fresh run starts its own."""
    if not path:
        return
    try:
        size = os.stat(path).st_size
    except FileNotFoundError:
        return
    except OSError as e:
        raise _refuse(path, flag, f"cannot read it ({e.strerror})") from None
    if size:
        raise _refuse(path, flag, f"already holds {size} bytes of another run; a run that starts afresh writes its "
                                  "own -- name another file or remove it")


def write_all(fd: int, data: bytes | bytearray | memoryview) -> None:
    """Write all of ``data`` to ``fd`` (``os.write`` until done): every writer of an output goes through here, so a
    failed write (a full disk) raises OSError at one place."""
    view = memoryview(data).cast("B")
    while view:
        n = os.write(fd, view)
        view = view[n:]


def write_error(path: str | os.PathLike[str], e: OSError) -> ValidationError:
    """The one line for an output that could not be written: a full disk (or quota) is named as such, not left to
    a traceback (a checkpoint's was 36 lines that never said "no space")."""
    if e.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)):
        why = "no space left on device" if e.errno == errno.ENOSPC else "disk quota exceeded"
        code = errno.errorcode.get(e.errno or 0, str(e.errno))
        return ValidationError(f"cannot write {_show(os.fspath(path))}: {why} ({code}); free some space or name "
                               "an output on another file system")
    return ValidationError(f"cannot write {_show(os.fspath(path))}: {e.strerror or e}")


def _forget_in_child() -> None:
    """In a forked child: point our copies of the held descriptors at /dev/null, so the lock stays only with the
    owner and ends with it.  (``flock(LOCK_UN)`` here would release the owner's lock too: it is one open file.)"""
    if not _CLAIMS:
        return
    null = os.open(os.devnull, os.O_RDWR)
    for claim in _CLAIMS.values():
        os.dup2(null, claim.fd, inheritable=False)
    os.close(null)
    _CLAIMS.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)


__all__ = ["TEMP_AFFIX_BYTES", "Output", "check_not_written", "check_output_file", "check_output_folder", "check_outputs", "held_elsewhere",
           "hold_exclusive", "open_for_append", "release", "release_all", "same_file", "sweep_stale_temp_files", "write_all",
           "write_error"]
