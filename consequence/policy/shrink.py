"""A smaller student built from a teacher: the same tokenizer and width, fewer layers.

Distillation needs teacher and student to share the tokenizer (they are compared id for
id). A student made by keeping a subset of the teacher's decoder layers shares it by
construction and starts from the teacher's embeddings, norms and kept layers rather than
from random weights (layer dropping as in DistilBERT's initialisation, Sanh et al. 2019 §3,
which keeps one layer in two; TinyLlama-style depth pruning keeps evenly spaced layers).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: transformers is imported by whoever built the model
    from transformers import PreTrainedModel

__all__ = ["evenly_spaced", "keep_layers", "shrink_model"]

_LAYER = re.compile(r"^(.*\.layers\.)(\d+)(\..*)$")


def evenly_spaced(n_layers: int, n_keep: int) -> list[int]:
    """``n_keep`` layer indices spread over ``range(n_layers)``, the first and the last included.

    >>> evenly_spaced(30, 10)
    [0, 3, 6, 10, 13, 16, 19, 23, 26, 29]

    Raises:
        ValueError: ``n_keep`` is not in 1 … ``n_layers``.
    """
    if not 1 <= n_keep <= n_layers:
        raise ValueError(f"--layers {n_keep}: keep between 1 and the model's {n_layers} layers")
    if n_keep == 1:
        return [0]
    return [round(i * (n_layers - 1) / (n_keep - 1)) for i in range(n_keep)]


def keep_layers(model: PreTrainedModel, keep: Sequence[int]) -> PreTrainedModel:
    """A new model of the same class with only the decoder layers ``keep`` (in that order).

    Every other weight (embeddings, final norm, LM head) is copied unchanged; layer
    ``keep[i]`` becomes layer ``i``. The model must store its decoder layers as
    ``….layers.<i>.…`` parameters and read ``config.num_hidden_layers`` (Llama, Qwen2,
    Mistral and the bundled tiny model do).

    Raises:
        ValueError: an index outside the model's layers, a repeated index, or a model without
            ``num_hidden_layers``.
    """
    cfg = model.config
    n = getattr(cfg, "num_hidden_layers", None)
    if n is None:
        raise ValueError(f"{type(model).__name__}: its config has no num_hidden_layers, so layers cannot be dropped")
    if not keep or len(set(keep)) != len(keep) or not all(0 <= k < n for k in keep):
        raise ValueError(f"layers {list(keep)}: give distinct indices in 0 … {n - 1}")
    new_cfg = cfg.__class__.from_dict({**cfg.to_dict(), "num_hidden_layers": len(keep)})
    if getattr(cfg, "layer_types", None):  # per-layer attention kinds follow their layers
        new_cfg.layer_types = [cfg.layer_types[k] for k in keep]
    student = type(model)(new_cfg)
    where = {k: i for i, k in enumerate(keep)}
    state = {}
    for name, value in model.state_dict().items():
        m = _LAYER.match(name)
        if m is None:
            state[name] = value
        elif int(m.group(2)) in where:
            state[f"{m.group(1)}{where[int(m.group(2))]}{m.group(3)}"] = value
    missing, unexpected = student.load_state_dict(state, strict=False)
    tied = {"lm_head.weight"} if getattr(new_cfg, "tie_word_embeddings", False) else set()
    if set(missing) - tied or unexpected:
        raise ValueError(
            f"{type(model).__name__}: the layer copy did not match the smaller model "
            f"(missing {sorted(set(missing) - tied)[:3]}, unexpected {sorted(unexpected)[:3]})"
        )
    if tied:
        student.tie_weights()
    return student.eval()


def shrink_model(path: str | Path, n_keep: int, out: str | Path) -> tuple[Path, list[int]]:
    """Load the model at ``path`` (a folder or registered name), keep ``n_keep`` evenly spaced
    layers, and save it with the same tokenizer to ``out`` (atomically).

    Returns:
        (``out``, the kept layer indices of the original model).

    Raises:
        ValueError: as :func:`evenly_spaced`, :func:`keep_layers`; the model is missing or cannot
            be loaded; ``out`` is the teacher's folder, inside or above it, a file, or a folder
            of other files (:func:`consequence.fileio.check_model_out`).
    """
    from consequence.fileio import check_model_out
    from consequence.policy.named import model_folder
    from consequence.policy.tiny import load_policy, save_policy

    folder = model_folder(str(path), option="MODEL")
    check_model_out(out, {"the teacher": folder}, "the student")  # before any work: nothing there is lost
    if not folder.exists():
        raise ValueError(
            f"{path}: no such model folder; give a model folder or a registered name (smollm2-135m-instruct)"
        )
    model, tok = load_policy(folder)
    keep = evenly_spaced(model.config.num_hidden_layers, n_keep)
    student = keep_layers(model, keep)
    out = Path(out).resolve()
    student.config.name_or_path = str(out)
    return save_policy(student, tok, out), keep
