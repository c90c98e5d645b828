"""A frozen teacher model for distillation: loaded once, checked against the student's tokenizer.

Distillation compares the log-probabilities two models give to the *same token ids*, so
the teacher must share the student's tokenizer id for id; a mismatch is refused before any
work, naming the first id that differs. The teacher is put in eval mode with
``requires_grad`` off: it is never in an optimizer.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from consequence.policy.tiny import load_policy

__all__ = ["check_same_tokenizer", "load_teacher"]


def check_same_tokenizer(student_tok, teacher_tok, teacher_name: str = "the teacher") -> None:
    """Refuse two tokenizers that do not map every id to the same token.

    Raises:
        ValueError: naming the first id (in id order) whose token differs, or is missing on
            one side, and both vocabulary sizes.
    """
    s = {i: t for t, i in student_tok.get_vocab().items()}
    t = {i: tok for tok, i in teacher_tok.get_vocab().items()}
    if s == t:
        return
    first = min(i for i in set(s) | set(t) if s.get(i) != t.get(i))
    raise ValueError(f"{teacher_name} does not share the student's tokenizer: id {first} is "
                     f"{s.get(first, '(none)')!r} for the student and {t.get(first, '(none)')!r} for the teacher "
                     f"({len(s)} vs {len(t)} tokens); distillation compares log-probs of the same token ids, so give "
                     "a teacher built on the student's tokenizer")


def _out_rows(model: torch.nn.Module) -> int:
    """Rows of the model's output layer: the vocabulary its next-token distributions cover."""
    return int(model.get_output_embeddings().weight.shape[0])


def load_teacher(path: str | Path, student_tok, log: Callable[[str], None] = print,
                 student: torch.nn.Module | None = None) -> torch.nn.Module:
    """Load the teacher at ``path`` (a local model folder or a registered name), frozen.

    Args:
        path: a Hugging Face causal LM folder or a name of ``policy.named``.
        student_tok: the student's tokenizer (the teacher's must equal it id for id).
        log: progress lines (a registered model's first conversion).
        student: the student model; when given, the teacher's output layer must cover
            the same number of token ids (the same tokenizer files with a wider
            embedding would give distributions over different supports).

    Returns:
        the teacher in eval mode, every parameter with ``requires_grad = False``.

    Raises:
        ValueError: the folder cannot be loaded as a model, its tokenizer differs, or its
            output vocabulary differs from the student's.
    """
    from consequence.policy.named import model_folder

    folder = model_folder(str(path), log=log, option="--teacher")
    model, tok = load_policy(folder)
    check_same_tokenizer(student_tok, tok, f"--teacher {path}")
    if student is not None and _out_rows(model) != _out_rows(student):
        raise ValueError(f"--teacher {path} predicts over {_out_rows(model)} token ids, the student over "
                         f"{_out_rows(student)}: distillation compares their distributions id for id, so teacher and "
                         "student need the same vocabulary (the same tokenizer and output layer size)")
    return model.eval().requires_grad_(False)
