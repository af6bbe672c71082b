"""What the entry points (launch/train.py, converters/*.py) share: the third-party notices they
filter, and the one-line form of a refusal. Nothing here runs at import; library modules never
filter warnings themselves."""
from __future__ import annotations

import os
import sys
import warnings

from mcore_rl.errors import OneLineParser, error_line  # noqa: F401 - the commands import them from here

# (category, message regex) of notices that say nothing a user of the job can act on
QUIET_WARNINGS = (
    (UserWarning, r"(Transformer Engine and )?Apex (is|are) not installed"),
    (UserWarning, r"Transformer Engine is not installed"),
    (UserWarning, r"full scope is deprecated"),  # megatron's own default for cuda_graph_scope
    (FutureWarning, r"`torch\.distributed\.\w+` is deprecated"),  # megatron calls the old names
    (FutureWarning, r"`load_state_dict` is deprecated"),  # megatron's torch_dist loader, old DCP name
    (FutureWarning, r"Please use DTensor instead and we are deprecating ShardedTensor"),  # megatron's loader
)


def quiet_third_party(rank: int) -> None:
    """Filters known notices on rank 0; non-zero ranks drop stdout and every warning (errors
    and tracebacks still go to stderr)."""
    if rank != 0:
        warnings.simplefilter("ignore")
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - lives as long as the process
        return
    for category, message in QUIET_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category)


def one_line_warnings() -> None:
    """A command's process prints warnings of mcore_rl's own categories as one ``warning: ...``
    line (no file and source line); other warnings keep Python's format."""
    default = warnings.formatwarning

    def form(message, category, filename, lineno, line=None) -> str:
        if category.__module__.startswith("mcore_rl."):
            return "warning: " + " ".join(str(message).split()) + "\n"
        return default(message, category, filename, lineno, line)

    warnings.formatwarning = form


def os_error_line(error: OSError, doing: str) -> str:
    """The one line for an operating-system error at a command's boundary (a full disk, a
    permission, a failing device): what the command was doing, the file and the system's words,
    e.g. ``error: writing the HF model to 'out' failed: [Errno 28] No space left on device:
    '/x/.out.staging-1/model.safetensors'; ...``."""
    where = f": {error.filename!r}" if error.filename else ""
    what = f"[Errno {error.errno}] {error.strerror}" if error.errno else str(error)
    return error_line(f"{doing} failed: {what}{where}; check free space, permissions and the device "
                      "where the files live, then run again (nothing was left behind).")


# set by launch/torchrun_job.py for its ranks: the file the first refusing rank writes its line to
REFUSAL_ENV = "MCORE_RL_REFUSAL_FILE"


def report_refusal(error: BaseException, rank: int) -> None:
    """Reports an error mcore_rl raised on purpose once per job, not once per rank: under
    ``launch/torchrun_job.py`` (``launch/run.sh``) the first rank to refuse writes its ``error:``
    line to the file ``$MCORE_RL_REFUSAL_FILE`` names (created exclusively; later ranks write
    nothing) and the launcher prints it; without it (a plain torchrun), rank 0 prints it."""
    line = error_line(error)
    path = os.environ.get(REFUSAL_ENV)
    if not path:
        if rank == 0:
            print(line, file=sys.stderr, flush=True)
        return
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:  # another rank refused first: its line is the job's
        return
    with os.fdopen(fd, "w") as f:
        f.write(line + "\n")
