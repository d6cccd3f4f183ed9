"""How the command line reports an error: one line for an error hetero raised itself, the
traceback for anything else."""

from __future__ import annotations

import linecache
import sys
import traceback
from collections.abc import Callable
from pathlib import Path


def report_error(e: BaseException, *own: Path) -> None:
    """One line for an error hetero raised itself (bad input, a bad checkpoint, a NaN loss: the
    message names the thing and the fix); the full traceback for anything else (a CUDA or NCCL
    failure, a bug), which a one-liner would hide. ``own``: more source files or directories
    whose ``raise`` statements count as hetero's (an example script's)."""
    if _raised_by(e, (_PACKAGE, *(p.resolve() for p in own))):
        print(f"hetero: error: {e}", file=sys.stderr)
    else:
        traceback.print_exception(e, file=sys.stderr)


def run_main(main: Callable[[], object], script: str) -> None:
    """Run a script's ``main()`` (the examples'): on an error, :func:`report_error` (the script's
    own ``raise`` statements count as hetero's) and exit with status 1."""
    try:
        main()
    except Exception as e:  # noqa: BLE001 - reported, then the exit status says it failed
        report_error(e, Path(script))
        sys.exit(1)


def _raised_by(e: BaseException, sources: tuple[Path, ...]) -> bool:
    """Whether ``e`` comes from a ``raise`` statement in ``sources``: the innermost frame of its
    traceback is there, at a ``raise`` (a failing torch call made from hetero's code has its
    innermost Python frame there too, but at the call)."""
    tb = e.__traceback__
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    filename = tb.tb_frame.f_code.co_filename
    where = Path(filename).resolve()
    if not any(where == src or where.is_relative_to(src) for src in sources):
        return False
    return linecache.getline(filename, tb.tb_lineno).lstrip().startswith("raise")


_PACKAGE = Path(__file__).resolve().parents[1]  # hetero/, whose raise statements are hetero's own
