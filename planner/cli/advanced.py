"""Advanced options: parsed like any other, left out of ``--help``, listed by ``--help-all``.

A command keeps the options a user needs in its ``--help`` and puts the switches kept for experiments and
measurements (emulated heterogeneity, loader and timing variants) in advanced groups::

    adv = add_help_all(parser)                    # --help-all, right after -h
    emu = adv.group("emulated heterogeneity")
    emu.add_argument("--emulate-slowdown", ...)   # parsed as usual; its help only under --help-all

An advanced option still parses, is still checked, and its help text is written once, where it is added.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any


class _Hidden:
    """An argument group whose options' help shows only under ``--help-all``."""

    def __init__(self, group: argparse._ArgumentGroup, description: str | None) -> None:
        self._group = group
        self._description = description
        self._helps: list[tuple[argparse.Action, str | None]] = []

    def add_argument(self, *names: str, **kwargs: Any) -> argparse.Action:
        action = self._group.add_argument(*names, **kwargs)
        self._helps.append((action, action.help))
        action.help = argparse.SUPPRESS
        return action

    def show(self) -> None:
        self._group.description = self._description
        for action, text in self._helps:
            action.help = text


class Advanced:
    """The advanced groups of one parser (``add_help_all`` makes it)."""

    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self._parser = parser
        self._groups: list[_Hidden] = []

    def group(self, title: str, description: str | None = None) -> _Hidden:
        # A group's description prints even when all its options are hidden: it is set only under --help-all.
        hidden = _Hidden(self._parser.add_argument_group(title), description)
        self._groups.append(hidden)
        return hidden

    def show(self) -> None:
        for g in self._groups:
            g.show()


class _HelpAll(argparse.Action):
    def __init__(self, option_strings: Sequence[str], dest: str, advanced: Advanced, help: str | None = None) -> None:
        super().__init__(option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, nargs=0, help=help)
        self.advanced = advanced

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        self.advanced.show()
        parser.print_help()
        parser.exit()


def add_help_all(parser: argparse.ArgumentParser) -> Advanced:
    """Add ``--help-all`` (this help with the advanced options, and exit) and return the registry of the advanced
    groups; call it first in ``add_arguments`` so that ``--help-all`` is listed right after ``-h``."""
    advanced = Advanced(parser)
    parser.add_argument("--help-all", action=_HelpAll, advanced=advanced,
                        help="show this help with the advanced options too, and exit")
    return advanced
