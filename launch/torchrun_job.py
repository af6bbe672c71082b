"""torchrun for launch/run.sh: the same command line and behaviour, except when the job ends on a
refusal (an error mcore_rl raises on purpose, e.g. a checkpoint it will not load): then the
first refusing rank's ``error:`` line is printed once and the exit code is 2, without a
traceback per rank or torchrun's failure report (the ranks write the line to a file this
launcher names, ``mcore_rl.entry.REFUSAL_ENV``). Any other failure keeps torchrun's report.

    python launch/torchrun_job.py [torchrun options] launch/train.py --config ... [overrides]
"""
from __future__ import annotations

import logging
import os
import sys
import tempfile


class _AfterRefusal(logging.Filter):
    """Drops torchrun's log records once a rank has refused (its stop of the other ranks and its
    failure notice say nothing the error line does not)."""

    def __init__(self, path: str) -> None:
        super().__init__()
        self.path = path

    def filter(self, record: logging.LogRecord) -> bool:
        return not os.path.exists(self.path)


def main(argv: list[str]) -> int:
    """Runs torchrun with ``argv``; 2 after a refusal (its line printed), torchrun's result otherwise."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if root not in sys.path:  # mcore_rl.entry from this checkout, as launch/train.py does
        sys.path.insert(0, root)
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    from mcore_rl.entry import REFUSAL_ENV

    with tempfile.TemporaryDirectory(prefix="mcore_rl_job_") as scratch:
        path = os.path.join(scratch, "refusal")
        os.environ[REFUSAL_ENV] = path  # the ranks inherit it
        quiet = _AfterRefusal(path)
        for name in list(logging.Logger.manager.loggerDict):
            if name.startswith("torch.distributed"):
                logging.getLogger(name).addFilter(quiet)
        try:
            torchrun(argv)
        except ChildFailedError:
            if not os.path.exists(path):
                raise  # not a refusal: torchrun's report
        if not os.path.exists(path):
            return 0
        with open(path) as f:
            sys.stderr.write(f.read())
        return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
