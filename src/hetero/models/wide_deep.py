"""Wide & Deep (Cheng et al., "Wide & Deep Learning for Recommender Systems", DLRS 2016).

* wide part: a linear model over sparse and crossed features = a sum of dim-1 host tables (one
  per feature; multi-hot features are summed) plus a linear map of the dense features;
* deep part: dim-``d`` host tables (multi-hot features mean-pooled), concatenated with the dense
  features and fed to an MLP on the device;
* logit = wide + deep, trained jointly with a logistic loss.

All tables are :class:`~hetero.embedding.HostEmbedding` (host memory, sparse optimizers); the MLP
and the wide dense/bias terms are ordinary parameters that follow ``model.to(device)``.

Pipelined (:mod:`hetero.parallel.pipeline`, split at :func:`pipeline_split_points`): stage 0
holds the tables, the wide terms and the first MLP layers (the lookups on the host, their sparse
gradients back to the host); the later stages hold the rest of the MLP.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import torch
from torch import Tensor, nn

from hetero.dynamic import DynamicConfig, Keys
from hetero.embedding import HostEmbeddingCollection, Pooling, TableConfig
from hetero.embedding.config import table_name
from hetero.parallel.operator_plan import ShardingPlan
from hetero.parallel.pipeline_plan import balanced_cuts
from hetero.placement import StorageTier, copy_to
from hetero.storage.config import SsdConfig


@dataclasses.dataclass(frozen=True)
class WideDeepConfig:
    embedding_dim: int = 16
    hidden: tuple[int, ...] = (256, 128)
    dropout: float = 0.0
    init_std: float = 0.01  # deep tables; wide tables start at zero (as FTRL expects)


@dataclasses.dataclass(frozen=True)
class FeatureSlot:
    """What the model needs to know of one input feature (decoupled from any dataset class)."""

    name: str
    vocab_size: int
    multi_hot: bool = False
    wide: bool = True
    deep: bool = True
    dynamic: DynamicConfig | None = None  # a dynamic feature's admission and eviction (its tables' keys are raw)


class Layers(nn.ModuleDict):
    """Layers applied in order, named ``"0"``, ``"1"``, ... as ``nn.Sequential`` names them; a
    ``ModuleDict`` so that a pipeline stage can hold some of them under their own names, with a
    ``forward`` so that FSDP2 can shard it as one unit."""

    def forward(self, x: Tensor) -> Tensor:
        for layer in self.values():
            x = layer(x)
        return x


def table_tier(ssd: SsdConfig | None, feature: FeatureSlot) -> dict:
    """The :class:`TableConfig` keywords of ``feature``'s table on the SSD tier ``ssd`` (``None``: in
    memory), dynamic if the feature is."""
    keys = {} if feature.dynamic is None else {"keys": Keys.DYNAMIC, "dynamic": feature.dynamic}
    return keys if ssd is None else {"storage": StorageTier.SSD, "ssd": ssd, **keys}


class WideDeep(nn.Module):
    """Wide & Deep over host tables.

    Args:
        features: the sparse features; each gets a wide table ``wide_<name>`` (dim 1) if ``wide``
            and a deep table ``deep_<name>`` (dim ``embedding_dim``) if ``deep``.
        num_dense: number of dense features ``K``.
        ssd: put every table on the SSD tier with these settings (``None``: host memory).

    Forward: ``features`` maps name -> int64 ``(B,)`` ids or ``(ids, offsets)`` bags (host);
    ``dense`` is float32 ``(B, K)`` (host or device). Returns float32 logits ``(B,)`` on the device
    of the MLP. As a later pipeline stage (no tables), the arguments are the previous stage's
    outputs instead: the MLP's activations ``(B, H)`` and the wide logit ``(B,)``; a stage
    without the MLP's last layer returns those two for the next.

    Raises:
        ValueError: (forward) a pipeline stage holding one table collection without the other.
    """

    def __init__(self, features: Sequence[FeatureSlot], num_dense: int, config: WideDeepConfig = WideDeepConfig(),
                 ssd: SsdConfig | None = None) -> None:
        super().__init__()
        self.config = config
        self.wide = HostEmbeddingCollection([
            TableConfig(table_name("wide", f.name), f.vocab_size, 1, feature=f.name,
                        pooling=Pooling.SUM if f.multi_hot else Pooling.NONE, init_std=0.0,
                        **table_tier(ssd, f))
            for f in features if f.wide
        ])
        deep = [
            TableConfig(table_name("deep", f.name), f.vocab_size, config.embedding_dim, feature=f.name,
                        pooling=Pooling.MEAN if f.multi_hot else Pooling.NONE, init_std=config.init_std,
                        **table_tier(ssd, f))
            for f in features if f.deep
        ]
        self.deep = HostEmbeddingCollection(deep)
        self.wide_dense = nn.Linear(num_dense, 1) if num_dense else None
        self.wide_bias = nn.Parameter(torch.zeros(1))
        layers: list[nn.Module] = []
        width = len(deep) * config.embedding_dim + num_dense
        for h in config.hidden:
            layers += [nn.Linear(width, h), nn.ReLU()]
            if config.dropout > 0:
                layers.append(nn.Dropout(config.dropout))
            width = h
        layers.append(nn.Linear(width, 1))
        self.mlp = Layers({str(i): layer for i, layer in enumerate(layers)})
        self.output_layer = str(len(layers) - 1)

    def forward(self, features: Mapping[str, Tensor | tuple[Tensor, Tensor]] | Tensor,
                dense: Tensor) -> Tensor | tuple[Tensor, Tensor]:
        if (self.wide is None) != (self.deep is None):
            raise ValueError("a Wide & Deep pipeline stage holds both table collections (wide, deep) or neither: split "
                             "at layers of mlp (hetero.models.wide_deep.pipeline_split_points)")
        if self.deep is not None:
            dense = copy_to(dense, self.wide_bias.device)  # host -> device, async on CUDA
            # the deep tables' rows on their way from parameter servers while the wide tables' come
            # (nothing where the rows are here: hetero.embedding.HostEmbeddingCollection.start)
            self.deep.start(features)
            terms = [v.reshape(-1) for v in self.wide(features).values()]
            # no wide feature (every one deep-only): the wide part is its bias (and dense term)
            wide = (torch.stack(terms, dim=1).sum(1) if terms else self.wide_bias.new_zeros(dense.shape[0])) \
                + self.wide_bias
            if self.wide_dense is not None:
                wide = wide + self.wide_dense(dense).squeeze(1)
            h = torch.cat([*self.deep(features).values(), dense], dim=1)
        else:  # a later pipeline stage: the previous stage's activations and wide logit
            h, wide = features, dense
        h = self.mlp(h)
        if self.output_layer in self.mlp:
            return wide + h.squeeze(1)
        return h, wide


def pipeline_split_points(model: WideDeep, stages: int) -> tuple[str, ...]:
    """Where pipeline stages ``1..stages-1`` begin: at Linear layers of the MLP, about equal MLP
    parameter bytes per stage, stage 0 holding the tables, the wide terms and at least the first
    Linear layer.

    Raises:
        ValueError: more stages than the MLP has Linear layers (naming both and the fix).
    """
    linears = [k for k, m in model.mlp.items() if isinstance(m, nn.Linear)]
    if stages > len(linears):
        raise ValueError(f"{stages} pipeline stages for a Wide & Deep MLP of {len(linears)} Linear layers: use at most "
                         f"{len(linears)} stages (--pp), or more layers (--hidden)")
    sizes = [sum(p.numel() for p in model.mlp[k].parameters()) for k in linears]
    return tuple(f"mlp.{linears[i]}" for i in balanced_cuts(sizes, stages))


def mlp_sharding_plan(model: WideDeep, tp: int) -> ShardingPlan:
    """The deep MLP operator-parallel over ``tp`` ranks, Megatron-style: its Linear layers in
    pairs, the first of a pair column-parallel (output units cut), the second row-parallel
    (its contraction cut; the partial sums all-reduced once) handing the next module the whole,
    replicated output; an unpaired last layer (the 1-unit output) stays whole. The host tables
    are untouched. Reference: Shoeybi et al. 2019 (Megatron-LM).

    Raises:
        ValueError: (when applied) a layer width that ``tp`` does not divide, naming the layer.
    """
    linears = [name for name, m in model.mlp.named_children() if isinstance(m, nn.Linear)]
    plan = ShardingPlan()
    for column, row in zip(linears[0::2], linears[1::2]):
        plan.module(f"mlp.{column}", ((1, 1), (1, tp)))
        plan.module(f"mlp.{row}", ((1, tp), (tp, 1)), (1, 1), use_local_output=True)
    return plan
