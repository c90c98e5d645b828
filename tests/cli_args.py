"""`consequence train` options of the tests' tiny smoke runs, shared across folders."""

# `consequence train` options of a one-iteration smoke run (2 tasks × 2 rollouts, 2 greedy final episodes)
ONE_TINY_ITERATION = [
    "--iterations",
    "1",
    "--tasks-per-iteration",
    "2",
    "--group-size",
    "2",
    "--eval-every",
    "0",
    "--final-eval-episodes",
    "2",
    "--final-eval-decoding",
    "greedy",
]

# ... and of a run without any evaluation (max 2 turns of 24 tokens)
TINY_NO_EVAL = [
    "--iterations",
    "1",
    "--tasks-per-iteration",
    "2",
    "--group-size",
    "2",
    "--final-eval-episodes",
    "0",
    "--eval-every",
    "0",
    "--max-turns",
    "2",
    "--max-new-tokens",
    "24",
]
