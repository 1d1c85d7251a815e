"""Per-shard model math. Layers get axis names (`Axes`), never a mesh."""
