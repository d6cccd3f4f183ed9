"""The ``hetero`` command's entry point (``[project.scripts]``).

``hetero --help`` answers from here without importing torch: ``import torch`` alone takes 2-7 s on
a busy 2-core host, and any module of the ``hetero`` package imports the package, and with it
torch. So this launcher lives outside the package; every command imports hetero's command line
(:func:`hetero.cli.main`) and runs it.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

USAGE = """usage: hetero {train,plan,predict,export,data prepare,checkpoint merge} [--help] ...

Host/device heterogeneous training for PyTorch.

  train              train a model on a job's data (--config job.toml; --section.key or --flag overrides)
  plan               plan a job (placement and parallel strategy under memory budgets): --world-size, --out
  predict            score a file with a run's checkpoint (or its export)
  export             a run's checkpoint for serving (torch.export program, Parquet tables); --since: a delta
  data prepare       encode a job file's data once into a columnar cache
  checkpoint merge   merge a sharded checkpoint into one integrated file

`hetero COMMAND --help` lists a command's keys and flags; docs/job-file.md lists every job key."""


def main(argv: Sequence[str] | None = None) -> int:
    """``hetero``: the usage for ``--help``, else the command (:func:`hetero.cli.main`)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["-h"], ["--help"]):
        print(USAGE)
        return 0
    from hetero.cli import main as command  # (torch and all of hetero: only for a command)

    return command(argv)


if __name__ == "__main__":
    sys.exit(main())
