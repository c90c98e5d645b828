"""Policy checkpoints on disk: check, load and save a model folder (``save_pretrained``
layout) or a LoRA adapter checkpoint (PEFT's layout, naming its base model's folder).

Both kinds live here because loading is mutually recursive: an adapter checkpoint loads
its base folder with :func:`load_policy`, and :func:`load_policy` hands an adapter
checkpoint to :func:`load_adapter_policy`. ``policy.tiny`` (the bundled model) and
``policy.lora`` (wrapping and merging adapters) both import from here, and re-export
these names where their callers import them.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import warnings
from pathlib import Path

import torch

ADAPTER_CONFIG = "adapter_config.json"
WEIGHT_FILES: tuple[str, ...] = (
    "model.safetensors",
    "pytorch_model.bin",
    "model.safetensors.index.json",
    "pytorch_model.bin.index.json",
)


def is_adapter_folder(path) -> bool:
    """Whether ``path`` is a PEFT adapter checkpoint (has ``adapter_config.json``)."""
    return (Path(path) / ADAPTER_CONFIG).is_file()


def is_model_folder(path) -> bool:
    """A Hugging Face model folder (``config.json``) or a LoRA adapter checkpoint."""
    return (Path(path) / "config.json").is_file() or is_adapter_folder(path)


def check_model_folder(path, option: str = "--model") -> None:
    """A checkpoint folder has weights and a ``config.json`` that names its ``model_type``
    (or is a LoRA adapter checkpoint whose base folder exists: :func:`is_adapter_folder`).

    Raises:
        ValueError: no weights file (one of ``WEIGHT_FILES``), or config.json missing, not
            valid JSON, not an object, or without ``model_type``; the message starts with
            ``option`` and the folder and says what to fix.
    """
    p = Path(path)
    if is_adapter_folder(p):  # a LoRA checkpoint: the adapter, and the base folder it names
        adapter_base(p)
        if not (p / "adapter_model.safetensors").is_file():
            raise ValueError(f"{option} {p}: a LoRA checkpoint without adapter_model.safetensors; save it again")
        return
    cfg = p / "config.json"
    if not cfg.is_file():
        raise ValueError(f"{option} {p}: no config.json (save the model with save_pretrained)")
    try:
        data = json.loads(cfg.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(
            f"{option} {p}: config.json is not valid JSON ({e}); save the model again with save_pretrained"
        ) from None
    if not isinstance(data, dict) or not data.get("model_type"):
        raise ValueError(
            f"{option} {p}: config.json has no model_type, so transformers cannot tell which "
            "architecture to build; save the model again with save_pretrained"
        )
    if not any((p / n).is_file() for n in WEIGHT_FILES):
        raise ValueError(
            f"{option} {p}: no weights ({', '.join(WEIGHT_FILES)}); save the model with "
            "save_pretrained into that folder"
        )


def load_policy(path):
    """Load ``(model, tokenizer)`` saved with ``save_pretrained`` at ``path`` (a LoRA adapter
    checkpoint loads as its base model with the adapter: :func:`load_adapter_policy`).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: the folder lacks weights or a usable config.json
            (:func:`check_model_folder`), transformers cannot load it (its message is
            kept), or the tokenizer has no chat template.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(
            f"load_policy: no policy at {p}; build one (consequence.policy.tiny.build_tokenizer "
            "+ build_model, then save_pretrained both to that folder) or fix the path"
        )
    check_model_folder(p, "model folder")
    if is_adapter_folder(p):
        return load_adapter_policy(p)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(p))
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"model folder {p}: transformers cannot load its tokenizer ({e})") from None
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"load_policy: the tokenizer at {p} has no chat template; set "
            "tokenizer.chat_template (e.g. consequence.policy.tiny.chat_template()) and "
            "save_pretrained it again"
        )
    try:
        model = AutoModelForCausalLM.from_pretrained(str(p), dtype=torch.float32)
    except (OSError, ValueError, KeyError, TypeError, RuntimeError) as e:
        raise ValueError(f"model folder {p}: transformers cannot load the model ({str(e).splitlines()[0]})") from None
    model.eval()
    return model, tokenizer


def save_policy(model, tokenizer, path, extra_files: dict[str, str] | None = None) -> Path:
    """Save ``model`` and ``tokenizer`` with ``save_pretrained`` atomically.

    Everything is written into a temporary sibling folder, then renamed over ``path``, so
    a crash never leaves a half-written checkpoint (a failed write, e.g. a full disk,
    removes the temporary folder and raises an OSError with the errno). ``extra_files`` maps file names to
    text written beside the weights (e.g. build metadata).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.tmp-"))
    try:
        model.save_pretrained(tmp)
        if hasattr(model, "peft_config"):  # PEFT also writes an empty model-card template
            (tmp / "README.md").unlink(missing_ok=True)
        tokenizer.save_pretrained(tmp)
        for name, text in (extra_files or {}).items():
            (tmp / name).write_text(text)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it owner-only; a checkpoint is shared
    except BaseException as e:  # e.g. disk full: drop the partial copy, keep the previous checkpoint
        shutil.rmtree(tmp, ignore_errors=True)
        from consequence.fileio import as_write_error

        err = as_write_error(e, tmp)
        if err is not None and err is not e:
            raise err from e  # safetensors reports a full disk as SafetensorError("... os error 28")
        raise
    if path.exists():
        shutil.rmtree(path)
    os.replace(tmp, path)
    return path


@contextlib.contextmanager
def quiet_peft():
    """PEFT 0.21 calls a transformers method that transformers 5 deprecates (a FutureWarning
    on every load that says nothing about the user's run)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        yield


def adapter_base(path) -> Path:
    """The base model folder an adapter checkpoint was trained on.

    Raises:
        ValueError: ``adapter_config.json`` is unreadable or names no existing local folder.
    """
    p = Path(path)
    try:
        base = json.loads((p / ADAPTER_CONFIG).read_text(encoding="utf-8")).get("base_model_name_or_path")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError) as e:
        raise ValueError(f"adapter checkpoint {p}: {ADAPTER_CONFIG} is not a readable JSON object ({e})") from None
    if not base or not Path(base).is_dir():
        raise ValueError(
            f"adapter checkpoint {p}: its base model {base!r} ({ADAPTER_CONFIG}: "
            "base_model_name_or_path) is not a folder here; put the base model there or edit that field"
        )
    return Path(base)


def load_adapter_policy(path, trainable: bool = True):
    """``(PeftModel, tokenizer)`` of an adapter checkpoint: its base folder, then the adapter.

    Args:
        path: a folder written by ``save_policy`` of a LoRA policy (adapter + tokenizer).
        trainable: leave the adapter's parameters requiring gradients (resume); ``False``
            for evaluation.

    Raises:
        ValueError: as :func:`adapter_base`, or the base / adapter cannot be loaded.
    """
    from peft import PeftModel
    from transformers import AutoTokenizer

    p = Path(path)
    if not (p / "adapter_model.safetensors").is_file():
        raise ValueError(f"adapter checkpoint {p}: no adapter_model.safetensors (the adapter's weights); save it again")
    base, _ = load_policy(adapter_base(p))
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(p))
        with quiet_peft():
            model = PeftModel.from_pretrained(base, str(p), is_trainable=trainable)
    except (OSError, ValueError, KeyError, TypeError, RuntimeError) as e:
        raise ValueError(f"adapter checkpoint {p}: cannot load it ({str(e).splitlines()[0]})") from None
    except Exception as e:  # safetensors' own error for a damaged weights file
        if type(e).__name__ != "SafetensorError":
            raise
        raise ValueError(f"adapter checkpoint {p}: adapter_model.safetensors is damaged ({e}); save it again") from None
    model.eval()
    return model, tokenizer
