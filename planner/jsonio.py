"""Strict, bounded JSON reading with field paths in every message, canonical dumps, fingerprints, atomic writes.

Every reader takes the value and its path ("profile.ranks[1].compute[0].step_time_s") so a user sees which field
is wrong, what it holds, and what would be right.

One loader for every file type (profile, plan, run log) that `validate`, `plan`, `report` and `train` read, so they
accept and refuse the same files: a file of at most ``MAX_FILE_BYTES`` (``MAX_RUN_LOG_BYTES`` for run logs), a
regular file, UTF-8, strict JSON (``loads_strict``), and then ``check_values`` over everything in it: finite
numbers, none below the smallest normal double, integers within int64, strings of at most ``MAX_TEXT_CHARS``
that are valid Unicode (no lone surrogate).  The field readers (``as_str``, ``as_int``, ``as_num``) then bound each
field by what it means: a name at most ``MAX_NAME_CHARS``, a core count, a time.  Unbounded, a 10 MB device name
made `report` run for minutes and 4.6 GB, a step time of 1e-320 divided to infinity, ``cpu_cores: 10**19``
overflowed a C long, and a lone surrogate in a name failed deep inside matplotlib.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import stat
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from planner.errors import ValidationError
from planner.shown import shown as _show

JSONDict = dict[str, Any]

MAX_FILE_BYTES = 64 * 2**20
"""Largest profile or plan file read (64 MiB; a 64-rank profile with device states is well under 1 MiB): a larger
one is refused before it is read, so no file makes a command hold gigabytes."""
MAX_RUN_LOG_BYTES = 256 * 2**20
"""Largest run log read (256 MiB: thousands of epochs of hundreds of ranks)."""
MAX_TEXT_CHARS = 4096
"""Longest string anywhere in our files (keys, reasons, free-form meta included); the longest any writer of ours
produces is a re-plan reason of about 500."""
MAX_NAME_CHARS = 256
"""Longest name (device, host, model, backend): what a table row, a plot label and a terminal line can show."""
MAX_WORLD_SIZE = 65_536
"""Most ranks a profile, plan or run log may describe (the largest DDP jobs run thousands)."""
MAX_CPU_CORES = 65_536
"""Most CPU cores a host may report (the largest single hosts have a few thousand hardware threads)."""
MAX_TIME_S = 1e6
"""Longest step time (or loader seconds per sample) accepted, about 11.6 days: larger is not a measurement, and
1.7e308 passed every check and then overflowed the solver's arithmetic to inf."""
MIN_TIME_S = 1e-9
"""Shortest nonzero time accepted (1 ns): no step or sample takes less, and a step of 1e-320 s made the report's
throughput (batch / time) infinite."""


def as_obj(value: Any, path: str, *, required: tuple[str, ...] = (), allowed: tuple[str, ...] = ()) -> JSONDict:
    """Check that `value` is a JSON object holding every `required` key and no key outside required+allowed."""
    if not isinstance(value, dict):
        raise ValidationError(f"{path}: expected an object, got {type(value).__name__} {_show(value)}")
    for key in required:
        if key not in value:
            raise ValidationError(f"{path}: missing required field {key!r}")
    known = set(required) | set(allowed)
    unknown = sorted(k for k in value if k not in known)
    if unknown:
        raise ValidationError(
            f"{path}: unknown field {_show(unknown[0])} (known: {', '.join(sorted(known))}); "
            "put free-form data under 'meta'"
        )
    return value


def as_list(value: Any, path: str, *, non_empty: bool = False, max_items: int | None = None) -> list[Any]:
    if not isinstance(value, list):
        raise ValidationError(f"{path}: expected a list, got {type(value).__name__} {_show(value)}")
    if non_empty and not value:
        raise ValidationError(f"{path}: must not be empty")
    if max_items is not None and len(value) > max_items:
        raise ValidationError(f"{path}: {len(value):,} entries, more than the {max_items:,} allowed")
    return value


def as_str(value: Any, path: str, *, max_chars: int = MAX_NAME_CHARS) -> str:
    """A non-empty string of at most ``max_chars`` (a name by default)."""
    if not isinstance(value, str) or not value:
        raise ValidationError(f"{path}: expected a non-empty string, got {_show(value)}")
    if len(value) > max_chars:
        raise ValidationError(f"{path}: {_show(value)} is longer than {max_chars:,} characters; shorten it")
    return value


def as_int(value: Any, path: str, *, min_value: int | None = None, max_value: int | None = None) -> int:
    # bool is an int subclass in Python; "true" is never a batch size.
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        else:
            raise ValidationError(f"{path}: expected an integer, got {_show(value)}")
    if not -INT64_MAX <= value <= INT64_MAX:  # 1e300 is an integral float: int() of it has 301 digits
        raise ValidationError(f"{path}: {value:.3g} is beyond the 64-bit integer range (at most 2**63 - 1)")
    if min_value is not None and value < min_value:
        raise ValidationError(f"{path}: must be >= {min_value}, got {value}")
    if max_value is not None and value > max_value:
        raise ValidationError(f"{path}: must be <= {max_value:,}, got {value:,}")
    return int(value)


def as_num(value: Any, path: str, *, positive: bool = False, non_negative: bool = False,
           max_value: float | None = None) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValidationError(f"{path}: expected a number, got {_show(value)}")
    x = float(value)
    if not math.isfinite(x):
        raise ValidationError(f"{path}: must be a finite number, got {x} (re-measure; NaN/inf never reach the solver)")
    if positive and x <= 0:
        raise ValidationError(f"{path}: must be > 0, got {_show(value)}")
    if non_negative and x < 0:
        raise ValidationError(f"{path}: must be >= 0, got {_show(value)}")
    if max_value is not None and x > max_value:
        raise ValidationError(f"{path}: must be <= {max_value:g}, got {x:g}")
    return x


def as_seconds(value: Any, path: str, *, positive: bool = False) -> float:
    """A time field: a finite number of seconds, > 0 (``positive``) or >= 0, at most MAX_TIME_S and, when not 0, at
    least MIN_TIME_S."""
    x = as_num(value, path, positive=positive, non_negative=not positive)
    if x > MAX_TIME_S:
        raise ValidationError(f"{path} is {x:g} s, more than {MAX_TIME_S:g} s (11.6 days): not a measurement; "
                              "re-measure")
    if 0 < x < MIN_TIME_S:
        raise ValidationError(f"{path} is {x:g} s, less than {MIN_TIME_S:g} s: not a measurement; re-measure")
    return x


def opt(data: Mapping[str, Any], key: str) -> Any:
    """The value of an optional field; an explicit JSON null counts as absent."""
    return data.get(key)


def check_header(data: Any, path: str, *, kind: str, version: int) -> None:
    if not isinstance(data, dict):
        raise ValidationError(f"{path}: expected a JSON object at the top level, got {type(data).__name__}")
    got_kind = data.get("kind")
    if got_kind != kind:
        raise ValidationError(f"{path}: 'kind' is {_show(got_kind)}, expected {kind!r} (is this a {kind} file?)")
    got_version = data.get("version")
    if isinstance(got_version, bool) or got_version != version:
        raise ValidationError(
            f"{path}: unsupported version {_show(got_version)}; this planner reads version {version} "
            "(upgrade ddp-planner or re-create the file)"
        )


MAX_INT_DIGITS = 20
"""Digits an integer in our files may have: every count, size and byte total fits (2^64 has 20 digits).  A longer
one is refused with its field: a 400-digit integer overflowed float conversion, a 5,000-digit one tripped
Python's int-string limit, both as tracebacks."""


class _LongInt(int):
    """An integer literal longer than MAX_INT_DIGITS, kept as its digit count until ``check_values`` names it."""


def _parse_int(text: str) -> int:
    digits = len(text.lstrip("-"))
    return _LongInt(digits) if digits > MAX_INT_DIGITS else int(text)


def _unique_keys(pairs: list[tuple[str, Any]]) -> JSONDict:
    out: JSONDict = {}
    for key, value in pairs:
        if key in out:  # json.loads keeps the last silently: two readers could see two files
            raise ValidationError(f"the key {_show(key)} appears twice in one object")
        out[key] = value
    return out


INT64_MAX = 2**63 - 1
"""Largest integer magnitude in our files: numpy, torch and C longs hold every count, size and byte total in int64."""
SMALLEST_NORMAL = sys.float_info.min
"""Smallest normal double (2.2e-308): a nonzero number below it (1e-320) is no measurement, and dividing by it
gives infinity."""


def _check_text(text: str, where: str) -> None:
    if len(text) > MAX_TEXT_CHARS:
        raise ValidationError(f"{where}: {_show(text)} is longer than {MAX_TEXT_CHARS:,} characters; no file of "
                              "ours holds one that long")
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:  # a lone surrogate: JSON's "\ud800" escape decodes to one
            raise ValidationError(f"{where}: {_show(text)} holds {text[e.start]!a} at character {e.start + 1}, "
                                  "half of a UTF-16 pair: not valid Unicode; fix the text") from None


def check_values(data: Any, path: str) -> None:
    """Refuse, naming the field, what no file of ours holds: NaN, Infinity or a literal beyond float range (1e400
    reads as infinity), a nonzero number below the smallest normal double, an integer longer than MAX_INT_DIGITS
    or beyond int64, a string (key or value) longer than MAX_TEXT_CHARS or not valid Unicode."""
    stack = [(data, path)]
    while stack:
        value, where = stack.pop()
        if isinstance(value, dict):
            for k in value:
                _check_text(k, f"{where} (a key)")
            stack.extend((v, f"{where}.{k if len(k) <= 40 else k[:37] + '...'}") for k, v in value.items())
        elif isinstance(value, list):
            stack.extend((v, f"{where}[{i}]") for i, v in enumerate(value))
        elif isinstance(value, str):
            _check_text(value, where)
        elif isinstance(value, _LongInt):
            raise ValidationError(f"{where}: an integer of {int(value)} digits (at most {MAX_INT_DIGITS} are read)")
        elif isinstance(value, bool):
            continue
        elif isinstance(value, int) and not -INT64_MAX <= value <= INT64_MAX:
            raise ValidationError(f"{where}: {value} is beyond the 64-bit integer range (at most 2**63 - 1 = "
                                  f"{INT64_MAX:,})")
        elif isinstance(value, float) and not math.isfinite(value):
            raise ValidationError(f"{where}: must be a finite number, got {value} (NaN and infinity never reach "
                                  "the solver; a literal like 1e400 reads as infinity)")
        elif isinstance(value, float) and value != 0 and abs(value) < SMALLEST_NORMAL:
            raise ValidationError(f"{where}: {value!r} is below the smallest normal number ({SMALLEST_NORMAL:.3g}); "
                                  "no measurement is that small (write 0 or re-measure)")


def loads_strict(text: str, path: str) -> Any:
    """``json.loads`` for our files, then ``check_values``: no key twice in an object, finite numbers only,
    integers of at most MAX_INT_DIGITS digits.  Raises ValidationError naming the field under ``path``,
    json.JSONDecodeError for bad syntax, RecursionError for absurd nesting."""
    data = json.loads(text, parse_int=_parse_int, object_pairs_hook=_unique_keys)
    check_values(data, _label(data, path))
    return data


def _label(data: Any, path: str) -> str:
    """The root of field paths in messages: a file read before its kind is known (``planner validate``'s "input")
    is named by its kind, so validate's line for a profile is the one `plan` and `report` print for it."""
    kind = data.get("kind") if path == "input" and isinstance(data, dict) else None
    return kind if kind in ("profile", "plan") else path


def read_text_bounded(path: str | os.PathLike[str], what: str, *, limit: int = MAX_FILE_BYTES) -> str:
    """The UTF-8 text of a regular file of at most ``limit`` bytes, every problem a one-line ValidationError: a
    missing, unreadable, non-UTF-8 or larger file, or a FIFO or device (reading one would wait or never end)."""
    p = Path(path)
    try:
        # O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer before fstat could refuse it.
        fd = os.open(p, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise ValidationError(f"{what} file {p} is not a regular file; give the file itself")
            os.set_blocking(fd, True)
            if st.st_size > limit:
                raise ValidationError(f"{what} file {p} is {st.st_size:,} bytes, more than the {limit:,} read; "
                                      "no file of ours is that large")
            data = f.read(limit + 1)  # the size was read before: a file growing meanwhile is cut here
    except FileNotFoundError:
        raise ValidationError(f"{what} file not found: {p}") from None
    except OSError as e:
        raise ValidationError(f"cannot read {what} file {p}: {e}") from None
    if len(data) > limit:
        raise ValidationError(f"{what} file {p} grew past {limit:,} bytes while it was read")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValidationError(f"cannot read {what} file {p}: {e}") from None


def read_json(path: str | os.PathLike[str], what: str) -> Any:
    """Read a JSON file (``read_text_bounded``, ``loads_strict``), every problem a one-line ValidationError."""
    p = Path(path)
    text = read_text_bounded(p, what)
    try:
        return loads_strict(text, what)
    except ValidationError as e:
        raise ValidationError(f"{p}: {e}") from None
    except json.JSONDecodeError as e:
        msg = e.msg.removesuffix(" at")  # some decoder messages end in "at" already
        raise ValidationError(f"{p}: not valid JSON ({msg} at line {e.lineno} column {e.colno})") from None
    except RecursionError:  # [[[[...]]]] thousands deep: the decoder recurses once per level
        raise ValidationError(f"cannot read {what} file {p}: its JSON is nested too deeply") from None


def canonical(data: Any) -> str:
    """Key-sorted compact JSON: the same content always gives the same bytes (and fingerprint)."""
    return json.dumps(data, sort_keys=True, separators=(",", ":"), allow_nan=False)


def fingerprint(data: Any) -> str:
    return hashlib.sha256(canonical(data).encode()).hexdigest()[:16]


def _mode_for(path: Path) -> int:
    """The mode the written file gets: an existing file's own (a 0600 plan stays private when overwritten), else
    0644 less the umask (mkstemp makes 0600; plans, profiles and reports are meant to be shared)."""
    try:
        return stat.S_IMODE(os.stat(path).st_mode)
    except OSError:
        mask = os.umask(0)
        os.umask(mask)
        return 0o644 & ~mask


def write_text_atomic(path: str | os.PathLike[str], text: str) -> None:
    """Write via a temp file in the same folder and rename, so a crash never leaves a half-written file.  A write
    that fails (a full disk) is one ValidationError naming the file (planner.paths.write_error), the temp file
    removed."""
    from planner.paths import write_all, write_error

    p = Path(path)
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp", dir=p.parent)
    except OSError as e:
        raise write_error(p, e) from None
    try:
        try:
            write_all(fd, text.encode("utf-8"))
            os.fsync(fd)
        finally:
            os.close(fd)
        os.chmod(tmp, _mode_for(p))
        os.replace(tmp, p)
    except BaseException as e:
        if os.path.exists(tmp):
            os.unlink(tmp)
        if isinstance(e, OSError):
            raise write_error(p, e) from None
        raise


def write_json_atomic(path: str | os.PathLike[str], data: Any) -> None:
    """JSON (indented, no NaN) written atomically; see write_text_atomic."""
    write_text_atomic(path, json.dumps(data, indent=1, allow_nan=False) + "\n")
