"""Errors the planner raises for user input.

Both are ``ValueError`` subclasses so callers that already catch ``ValueError`` keep working. The CLI turns
either into exit code 2 and one line on stderr; anything else is an internal error (exit 1).
"""

from __future__ import annotations


class ValidationError(ValueError):
    """A profile, plan or option is malformed. The message names the field, the value and the fix."""


class PlanError(ValueError):
    """The program has no solution for these inputs. The message names the binding constraint and its numbers."""
