"""Strict JSON reading with field paths in every message, canonical dumps, fingerprints, atomic writes.

Every reader takes the value and its path ("profile.ranks[1].compute[0].step_time_s") so a user sees which field
is wrong, what it holds, and what would be right.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import stat
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from planner.errors import ValidationError

JSONDict = dict[str, Any]


def _show(value: Any) -> str:
    text = json.dumps(value) if not isinstance(value, float) or math.isfinite(value) else str(value)
    return text if len(text) <= 40 else text[:37] + "..."


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
            f"{path}: unknown field {unknown[0]!r} (known: {', '.join(sorted(known))}); "
            "put free-form data under 'meta'"
        )
    return value


def as_list(value: Any, path: str, *, non_empty: bool = False) -> list[Any]:
    if not isinstance(value, list):
        raise ValidationError(f"{path}: expected a list, got {type(value).__name__} {_show(value)}")
    if non_empty and not value:
        raise ValidationError(f"{path}: must not be empty")
    return value


def as_str(value: Any, path: str) -> str:
    if not isinstance(value, str) or not value:
        raise ValidationError(f"{path}: expected a non-empty string, got {_show(value)}")
    return value


def as_int(value: Any, path: str, *, min_value: int | None = None) -> int:
    # bool is an int subclass in Python; "true" is never a batch size.
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        else:
            raise ValidationError(f"{path}: expected an integer, got {_show(value)}")
    if min_value is not None and value < min_value:
        raise ValidationError(f"{path}: must be >= {min_value}, got {value}")
    return int(value)


def as_num(value: Any, path: str, *, positive: bool = False, non_negative: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValidationError(f"{path}: expected a number, got {_show(value)}")
    x = float(value)
    if not math.isfinite(x):
        raise ValidationError(f"{path}: must be a finite number, got {x} (re-measure; NaN/inf never reach the solver)")
    if positive and x <= 0:
        raise ValidationError(f"{path}: must be > 0, got {_show(value)}")
    if non_negative and x < 0:
        raise ValidationError(f"{path}: must be >= 0, got {_show(value)}")
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


def check_values(data: Any, path: str) -> None:
    """Refuse, naming the field, a number no file of ours holds: NaN, Infinity or a literal beyond float range
    (1e400 reads as infinity), or an integer longer than MAX_INT_DIGITS."""
    stack = [(data, path)]
    while stack:
        value, where = stack.pop()
        if isinstance(value, dict):
            stack.extend((v, f"{where}.{k}") for k, v in value.items())
        elif isinstance(value, list):
            stack.extend((v, f"{where}[{i}]") for i, v in enumerate(value))
        elif isinstance(value, _LongInt):
            raise ValidationError(f"{where}: an integer of {int(value)} digits (at most {MAX_INT_DIGITS} are read)")
        elif isinstance(value, float) and not math.isfinite(value):
            raise ValidationError(f"{where}: must be a finite number, got {value} (NaN and infinity never reach "
                                  "the solver; a literal like 1e400 reads as infinity)")


def loads_strict(text: str, path: str) -> Any:
    """``json.loads`` for our files, then ``check_values``: no key twice in an object, finite numbers only,
    integers of at most MAX_INT_DIGITS digits.  Raises ValidationError naming the field under ``path``,
    json.JSONDecodeError for bad syntax, RecursionError for absurd nesting."""
    data = json.loads(text, parse_int=_parse_int, object_pairs_hook=_unique_keys)
    check_values(data, path)
    return data


def read_json(path: str | os.PathLike[str], what: str) -> Any:
    """Read a JSON file, turning every I/O and syntax problem into a one-line ValidationError."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ValidationError(f"{what} file not found: {p}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ValidationError(f"cannot read {what} file {p}: {e}") from None
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
