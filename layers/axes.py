"""The mesh axes a layer may talk over, by role. A static (hashable) dataclass."""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Axes:
    """Axis names by role; `None` when the layout has no such axis (or it has size 1).

    dp:   params replicated, batch sharded.
    fsdp: params, grads, optimizer state and batch sharded (ZeRO-3).
    tp:   heads, MLP hidden and vocab sharded (Megatron).
    """

    dp: str | None = None
    fsdp: str | None = None
    tp: str | None = None
    dp_size: int = 1
    fsdp_size: int = 1
    tp_size: int = 1

    @property
    def batch(self) -> tuple[str, ...]:
        """Axes the batch is sharded over, outermost first."""
        return tuple(a for a in (self.dp, self.fsdp) if a is not None)

    @property
    def batch_size(self) -> int:
        return self.dp_size * self.fsdp_size
