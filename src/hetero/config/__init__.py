"""The job configuration (:class:`~hetero.config.job.JobConfig`), its job files and its manager."""

from hetero.config.job import JobConfig
from hetero.config.manager import load_job
from hetero.config.toml import job_to_toml, read_job_file

__all__ = ["JobConfig", "job_to_toml", "load_job", "read_job_file"]
