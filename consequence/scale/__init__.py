"""Asynchronous rollouts on Ray: rollout workers with versioned policy snapshots, and the
trainer's queue with bounded staleness (docs/async.md)."""
