"""The package's one error base class: every error mcore_rl raises on purpose derives from it,
and the one-line form a command prints a refusal in (``error_line``, ``OneLineParser``).

Trainers can catch ``McoreRLError`` for anything mcore_rl refuses (bad layout, config, batch,
weights, checkpoint); each subclass also derives from the builtin it refines (mostly
``ValueError``), so existing ``except ValueError`` code keeps working.
"""
from __future__ import annotations

import argparse
from typing import NoReturn


class McoreRLError(Exception):
    """Base of every mcore_rl error; the message names the bad value and the fix."""


class CheckpointError(McoreRLError, ValueError):
    """A checkpoint or model directory on disk cannot be written or read safely.

    Raised by the checkpoint manager, the converters and the file layer they share; the
    message names the file or value and the fix.
    """


def positive_int(text: str) -> int:
    """argparse ``type``: an integer >= 1 (a parallel size, a thread count); else a usage error
    naming the value."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer >= 1")
    return value


def error_line(error: BaseException) -> str:
    """``error: <message>`` on one line (a refusal's message names the value and the fix)."""
    return "error: " + " ".join(str(error).split())


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors are one ``error: ...`` line (exit code 2) naming the
    command, the problem and where the usage is, instead of argparse's usage block; subcommand
    parsers made by ``add_subparsers`` inherit it."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {self.prog}: {' '.join(message.split())} (see {self.prog} --help)\n")
