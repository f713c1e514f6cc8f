"""Where ``fit``'s batches come from: arrays, iterables, a ``Rollout``."""
