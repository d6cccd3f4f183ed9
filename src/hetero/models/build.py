"""The main job's models built from features: the one place a feature becomes a table slot and
a model kind becomes a model, so training, planning and predict build the same network."""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from typing import Any

from torch import nn

from hetero.data.tabular import Feature, FeatureRole
from hetero.models.dlrm import DLRM, DLRMConfig
from hetero.models.wide_deep import FeatureSlot, WideDeep, WideDeepConfig
from hetero.storage.config import SsdConfig


class ModelKind(enum.Enum):
    """The main job's model."""

    WIDE_DEEP = "wide_deep"  # Cheng et al. 2016, "Wide & Deep Learning for Recommender Systems"
    DLRM = "dlrm"  # Naumov et al. 2019, "Deep Learning Recommendation Model for Personalization and Recommendation"

    @property
    def config_class(self) -> type:
        return DLRMConfig if self is ModelKind.DLRM else WideDeepConfig


def feature_slots(features: Sequence[Feature]) -> list[FeatureSlot]:
    """Each feature's table slot: wide unless the feature is deep-only, deep unless wide-only."""
    return [FeatureSlot(f.name, f.vocab_size, f.multi_hot, wide=f.role is not FeatureRole.DEEP,
                        deep=f.role is not FeatureRole.WIDE, dynamic=f.dynamic) for f in features]


def build_model(kind: ModelKind, config: WideDeepConfig | DLRMConfig, features: Sequence[Feature],
                num_dense: int, ssd: SsdConfig | None = None) -> nn.Module:
    """The model ``kind`` over ``features`` (host tables on the host, or on the SSD tier ``ssd``;
    the MLP on the CPU: the caller moves it)."""
    cls = DLRM if kind is ModelKind.DLRM else WideDeep
    return cls(feature_slots(features), num_dense, config, ssd)


def model_config(kind: ModelKind, fields: Mapping[str, Any]) -> WideDeepConfig | DLRMConfig:
    """``kind``'s config from recorded fields (lists as tuples)."""
    return kind.config_class(**{k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()})
