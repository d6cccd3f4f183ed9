"""Dynamic loss scaling for fp16 training (Micikevicius et al., "Mixed Precision Training", 2018).

The semantics of ``torch.amp.GradScaler``: the loss is multiplied by ``scale`` before backward; a
step whose gradients are not all finite is skipped and the scale is multiplied by
``backoff_factor``; after ``growth_interval`` finite steps in a row it is multiplied by
``growth_factor``.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class DynamicLossScaler:
    scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    good_steps: int = 0

    def update(self, finite: bool) -> None:
        if not finite:
            self.scale *= self.backoff_factor
            self.good_steps = 0
            return
        self.good_steps += 1
        if self.good_steps >= self.growth_interval:
            self.scale *= self.growth_factor
            self.good_steps = 0

    def state_dict(self) -> dict:
        return dataclasses.asdict(self)

    def load_state_dict(self, state: dict) -> None:
        for k, v in state.items():
            setattr(self, k, v)
