"""``hetero``'s command line (:mod:`hetero.cli.main`)."""

from hetero.cli.errors import report_error, run_main
from hetero.cli.main import main, merge
from hetero.cli.train import build_trainer

__all__ = ["build_trainer", "main", "merge", "report_error", "run_main"]
