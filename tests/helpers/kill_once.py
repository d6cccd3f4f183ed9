"""Run ``hetero train`` under torchrun; rank 1 SIGKILLs itself once, after step KILL_AT_STEP.

The marker file makes the kill happen in the first attempt only, so the restarted job (torchrun
--max-restarts) finishes.
"""

import os
import signal
import sys
from pathlib import Path

from hetero.cli import main

KILL_AT_STEP = int(os.environ["KILL_AT_STEP"])
MARKER = Path(os.environ["KILL_MARKER"])


def maybe_die(trainer):
    if trainer.global_step == KILL_AT_STEP and os.environ.get("RANK") == "1" and not MARKER.exists():
        MARKER.write_text("killed")
        os.kill(os.getpid(), signal.SIGKILL)


sys.exit(main(sys.argv[1:], on_step=maybe_die))
