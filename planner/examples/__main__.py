"""``python -m planner.examples [--out DIR]``: copy the example files into DIR (default: the current folder).

A file already there with the same content is left as it is; one with other content is refused in one line (exit
2), never overwritten.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from planner.errors import ValidationError
from planner.examples import NAMES, path
from planner.jsonio import write_text_atomic
from planner.paths import check_output_file


def copy_examples(out: str) -> list[tuple[str, bool]]:
    """Copy every example into ``out`` (an existing folder): (path, whether it was written now) for each."""
    if not os.path.isdir(out):
        raise ValidationError(f"--out {out}: not an existing folder")
    done = []
    for name in NAMES:
        text = path(name).read_text(encoding="utf-8")
        target = os.path.join(out, name)
        if os.path.isfile(target) and not os.path.islink(target):
            with open(target, encoding="utf-8") as f:
                if f.read() == text:
                    done.append((target, False))
                    continue
            raise ValidationError(f"{target} exists with other content: move it, or copy the examples elsewhere "
                                  "with --out DIR")
        check_output_file(target, "--out")
        write_text_atomic(target, text)
        done.append((target, True))
    return done


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m planner.examples", description=__doc__.splitlines()[0][3:])
    p.add_argument("--out", default=".", metavar="DIR", help="folder to copy the examples into (default: here)")
    args = p.parse_args(argv)
    try:
        for target, written in copy_examples(args.out):
            print(f"wrote {target}" if written else f"{target} is already there")
    except ValidationError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
