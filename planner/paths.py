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

Pure: the standard library only (no torch), so `planner plan` and the programs share it.
"""

from __future__ import annotations

import errno
import hashlib
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


def _show(path: str) -> str:
    return path if len(path) <= 80 else path[:40] + "..." + path[-30:]


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


_HELD: dict[str, int] = {}
"""Locks this process holds, by path, until it exits (the kernel releases them when the process ends)."""


def lock_path(path: str) -> str:
    """Where the lock for output ``path`` lives: a file named by the hash of its resolved path in a per-user folder
    of the temp directory, so locking creates nothing beside the user's outputs (a refused run leaves no empty log
    or checkpoint folder behind)."""
    key = hashlib.sha256(os.path.realpath(path).encode()).hexdigest()[:32]
    uid = os.getuid() if hasattr(os, "getuid") else 0
    return os.path.join(tempfile.gettempdir(), f"ddp-planner-locks-{uid}", f"{key}.lock")


def hold_exclusive(path: str, flag: str, *, folder: bool = False) -> None:
    """Hold an exclusive lock on an output for the rest of this process, or refuse in one line.

    Two runs given the same ``--checkpoint`` folder or ``--log-file`` both pass the fresh-run checks, then
    interleave their lines in one log (which then reads as one valid, finished run) and overwrite each other's
    checkpoints.  ``flock`` on the output's lock file (``lock_path``): advisory, released by the kernel when the
    process dies (kill -9 included), so a crashed run never leaves a stale lock.  It guards runs on one host; runs
    on two hosts writing one shared-file-system folder are not seen.  A process that already holds the lock (the
    same path named twice) keeps it.
    """
    try:
        import fcntl
    except ImportError:  # no flock on this platform: nothing to hold
        return
    lock = lock_path(path)
    if lock in _HELD:
        return
    os.makedirs(os.path.dirname(lock), mode=0o700, exist_ok=True)
    fd = os.open(lock, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise ValidationError(f"{flag} {_show(path)} is in use by another run (it holds the lock); wait for it to "
                              f"finish, or name another {'folder' if folder else 'file'}") from None
    _HELD[lock] = fd


__all__ = ["TEMP_AFFIX_BYTES", "Output", "check_output_file", "check_output_folder", "check_outputs",
           "hold_exclusive", "lock_path", "same_file"]
