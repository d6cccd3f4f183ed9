"""Run ``hetero train`` under torchrun in a parameter-server job; a server is SIGKILLed once.

Worker rank 0 writes TRIGGER after step KILL_AT_STEP; every server process watches for it and
the server of rank VICTIM kills itself (a failure from outside the library: no hook in it). The
marker file makes the kill happen in the first attempt only, so the restarted job finishes.
"""

import os
import signal
import sys
import threading
import time
from pathlib import Path

from hetero.cli import main

KILL_AT_STEP = int(os.environ["KILL_AT_STEP"])
MARKER = Path(os.environ["KILL_MARKER"])
TRIGGER = MARKER.with_name(MARKER.name + ".trigger")
VICTIM = os.environ["VICTIM_RANK"]


def trigger(trainer):
    if trainer.global_step == KILL_AT_STEP and os.environ.get("RANK") == "0" and not MARKER.exists():
        TRIGGER.write_text("now")
        time.sleep(30)  # the server dies meanwhile; this worker's next pull fails


def watch():
    while not MARKER.exists():
        if TRIGGER.exists():
            MARKER.write_text("killed")
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(0.05)


if os.environ.get("RANK") == VICTIM and not MARKER.exists():
    threading.Thread(target=watch, daemon=True).start()
sys.exit(main(sys.argv[1:], on_step=trigger))
