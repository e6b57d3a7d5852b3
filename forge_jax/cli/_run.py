"""What every command shares at its edge: the usage-error class, and the runner that turns
the errors a user can cause into one line on stderr and an exit code."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable


class UsageError(Exception):
    """A problem with the user's input to a command (a flag, a prompt, a checkpoint that does
    not fit the request): one line on stderr, exit code 2.

    ``prog`` names the (sub)command for an error raised before the command is known (an
    argparse error); otherwise the runner names the command it ran.
    """

    def __init__(self, message: str, *, prog: str | None = None):
        super().__init__(message)
        self.prog = prog


# The name this class had when only ``generate`` raised it; kept for one release.
GenerateError = UsageError


def report(prog: str, error: BaseException, code: int) -> int:
    """Writes ``{prog}: error: {error}`` on stderr and returns ``code``."""
    print(f"{prog}: error: {error}", file=sys.stderr)
    return code


def run_command(command: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    """``command(args)``'s exit code, with the errors a user can cause reported as one line
    ``forge-jax COMMAND: error: ...`` on stderr instead of a traceback: bad input (a
    :class:`UsageError`, an unreadable or unsupported checkpoint) exits with 2, a model that
    does not fit in memory with 1. A closed stdout (``forge-jax generate | head``) stops the
    command quietly with 1, as Unix tools do. Ctrl-C that the command does not handle itself
    (while a model loads) is one line, ``forge-jax COMMAND: interrupted``, and exit code 130,
    as a shell reports SIGINT. Anything else propagates."""
    prog = f"forge-jax {args.command}"
    try:
        return command(args)
    except KeyboardInterrupt:
        print(f"\n{prog}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except Exception as e:
        code = _exit_code(e)
        if code is None:
            raise
        return report(prog, e, code)


def _exit_code(error: Exception) -> int | None:
    """2 for bad input, 1 for a model too large for the device, None for an error that is
    not the user's (a bug: its traceback is wanted). Imports the model's error class only
    here, so that ``forge-jax info`` never loads Flax."""
    from forge_jax.memory import InsufficientMemoryError
    from forge_jax.models import llama

    if isinstance(error, (UsageError, llama.CheckpointError)):
        return 2
    if isinstance(error, InsufficientMemoryError):
        return 1
    return None
