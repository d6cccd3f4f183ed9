"""Models built on hetero's host tables."""

from hetero.models.wide_deep import WideDeep, WideDeepConfig

__all__ = ["WideDeep", "WideDeepConfig"]
