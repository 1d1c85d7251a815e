"""The layout grammar: mesh axes outermost first, each with its size, joined by `x`.

    single | dp8 | fsdp8 | tp8 | fsdp4xtp2 | fsdp2xtp4 | dp2xfsdp2xtp2 | ...

The axis names and what each must divide come from the role registry (layers/roles.py).
Parsing and validation import no jax (the CLI must force host devices before jax loads).
"""
from __future__ import annotations

import dataclasses
import math
import re

from engine.config import ConfigError
from layers import roles

AXIS_ROLES = tuple(roles.ROLES)


class LayoutError(ConfigError):
    """A layout that cannot be parsed or does not fit the model; the message is one line."""


@dataclasses.dataclass(frozen=True)
class Layout:
    axes: tuple[tuple[str, int], ...]  # ((name, size), ...) outermost first

    @classmethod
    def parse(cls, text: str) -> "Layout":
        if text == "single":
            return cls(())
        problems, axes, seen = [], [], set()
        for token in text.split("x") if text else [""]:
            m = re.fullmatch(r"([a-z]+)(-?\d+)", token)
            if not m:
                problems.append(f"cannot read {token!r} (want an axis name and a size, e.g. fsdp4)")
                continue
            name, size = m.group(1), int(m.group(2))
            if name not in AXIS_ROLES:
                problems.append(f"unknown axis {name!r} (known: {', '.join(AXIS_ROLES)})")
            if name in seen:
                problems.append(f"axis {name!r} repeated")
            if size < 1:
                problems.append(f"{name} size {size} < 1")
            seen.add(name)
            axes.append((name, size))
        if problems:
            raise LayoutError(f"bad layout {text!r}: " + "; ".join(problems))
        return cls(tuple(axes))

    def __str__(self) -> str:
        return "x".join(f"{n}{s}" for n, s in self.axes) or "single"

    @property
    def size(self) -> int:
        return math.prod(s for _, s in self.axes)

    def degree(self, role: str) -> int:
        return dict(self.axes).get(role, 1)

    def role_axes(self, **strategies):
        """The `layers.axes.Axes` of this layout: axis names by role, axes of size 1
        counting as absent (no collective over them); `strategies` (tp_comm, weights,
        prefetch) say how bytes move over them."""
        from layers.axes import Axes

        names = {r: (r if self.degree(r) > 1 else None) for r in AXIS_ROLES}
        return Axes(**names, **{f"{r}_size": self.degree(r) for r in AXIS_ROLES},
                    **strategies)

    def problems(self, cfg, batch: int) -> list[str]:
        """Every dim of the model (a ModelConfig) or the batch that an axis size does not
        divide, as the role registry says."""
        degrees = {r: self.degree(r) for r in AXIS_ROLES}
        dims = {dim: batch if dim == "batch" else getattr(cfg, field)
                for dim, field in roles.DIM_FIELDS.items()}
        return (roles.divisibility_problems(degrees, dims)
                + roles.kv_heads_problems(degrees, cfg.n_kv_heads))

    def describe(self) -> str:
        """`layout fsdp4xtp2 (dp=1 fsdp=4 tp=2, 8 devices)`."""
        sizes = " ".join(f"{r}={self.degree(r)}" for r in AXIS_ROLES)
        return f"layout {self} ({sizes}, {self.size} devices)"

    def check(self, cfg, batch: int) -> None:
        """Raise LayoutError naming every factor if the model or batch does not divide."""
        if problems := self.problems(cfg, batch):
            raise LayoutError(f"{self.describe()} does not fit: " + "; ".join(problems))

    def mesh_axes(self) -> tuple[tuple[str, int], ...]:
        """Axes of the device mesh; `single` is a one-device mesh with one size-1 axis."""
        return self.axes or (("dp", 1),)

    def mesh(self, devices=None):
        """A concrete jax Mesh over the first `size` devices (Auto axis types)."""
        import jax
        import numpy as np

        devices = jax.devices() if devices is None else devices
        if len(devices) < self.size:
            raise LayoutError(f"layout {self} needs {self.size} devices, "
                              f"{len(devices)} {devices[0].platform} devices available")
        names, shape = zip(*self.mesh_axes())
        grid = np.asarray(devices[: self.size]).reshape(shape)
        return jax.sharding.Mesh(grid, names, axis_types=(jax.sharding.AxisType.Auto,) * len(names))

    def abstract_mesh(self):
        """An AbstractMesh of this layout's shape: traces without the devices."""
        import jax

        names, shape = zip(*self.mesh_axes())
        return jax.sharding.AbstractMesh(shape, names,
                                         axis_types=(jax.sharding.AxisType.Auto,) * len(names))
