"""Helpers shared by the commands: the console, checks of paths given on the command line."""

from __future__ import annotations

import os
from pathlib import Path

from rich.console import Console

console = Console(soft_wrap=True, emoji=False)  # ":X:" in a module:attr is not an emoji


def quiet_libraries() -> None:
    """Our progress bar is the one to read: silence transformers' load/save bars."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def check_model_dir(model: str | None, option: str = "--model", chat_template: bool = True) -> None:
    """A local checkpoint needs its config and tokenizer files (checked before any work); a
    registered model name (consequence.policy.named) needs its package, not yet its conversion;
    a Hugging Face hub id is fetched (or refused offline: ``policy.named.hub_folder``) and checked."""
    if model is None:
        return
    from consequence.config import is_hub_id
    from consequence.policy.named import check_available, is_named, model_folder

    if is_named(model):
        return check_available(model, option)
    if is_hub_id(model):  # fetched now where online (else a clear error), then checked like any folder
        model = str(model_folder(model, log=console.print, option=option))
    p = Path(model)
    if not p.is_dir():
        raise ValueError(f"{option} {p}: no such directory (give a local Hugging Face checkpoint folder)")
    from consequence.policy.lora import is_adapter_folder

    # a LoRA checkpoint has adapter_config.json instead (its base folder holds config.json)
    missing = [n for n in ("config.json",) if not (p / n).is_file() and not is_adapter_folder(p)]
    if not any((p / n).is_file() for n in ("tokenizer.json", "tokenizer_config.json")):
        missing.append("tokenizer.json or tokenizer_config.json")
    if missing:
        raise ValueError(
            f"{option} {p}: not a Hugging Face checkpoint, missing {', '.join(missing)} "
            "(save both the model and its tokenizer with save_pretrained)"
        )
    from consequence.policy.tiny import check_model_folder

    check_model_folder(p, option)
    if chat_template and not has_chat_template(p):
        raise ValueError(
            f"{option} {p}: the tokenizer has no chat template, which the harness needs to render "
            "conversations and tool calls; set tokenizer.chat_template (e.g. "
            "consequence.policy.tiny.chat_template(), Qwen2.5 layout) and save_pretrained it again"
        )


def has_chat_template(p: Path) -> bool:
    """Where transformers looks for a chat template: its own files, or tokenizer_config.json."""
    import json

    if (p / "chat_template.jinja").is_file() or (p / "chat_template.json").is_file():
        return True
    if any((p / "additional_chat_templates").glob("*.jinja")):
        return True
    try:
        return bool(json.loads((p / "tokenizer_config.json").read_text()).get("chat_template"))
    except (OSError, ValueError, AttributeError):
        return False


def check_run_dir(run: Path, option: str = "--run-dir", keep: bool = True) -> None:
    """``run`` is a folder we can create and write in (checked with a probe file).

    Args:
        keep: leave the folder in place (else folders this check created are removed
            again, so a later refusal leaves nothing behind).

    Raises:
        ValueError: it is a file, or it cannot be created or written (names ``option``).
    """
    run = Path(run)
    new = []  # folders this check creates, deepest last
    p = run
    while not p.exists() and p != p.parent:
        new.append(p)
        p = p.parent
    if run.exists() and not run.is_dir():
        raise ValueError(f"{option} {run}: cannot write there (it is a file, not a folder); give a folder")
    try:
        run.mkdir(parents=True, exist_ok=True)
        probe = run / f".write-test-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise ValueError(f"{option} {run}: cannot write there ({e.strerror or e}); give a writable folder") from None
    finally:
        if not keep:
            for d in new:
                try:
                    d.rmdir()
                except OSError:
                    break


def check_out_file(path: Path, option: str = "--out") -> None:
    """The file ``path`` can be written: not a folder, and its folder is writable (nothing is left behind).

    Raises:
        ValueError: names ``option`` and the fix.
    """
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{option} {path}: is a folder; give the path of a file to write")
    try:
        check_run_dir(path.parent, option, keep=False)
    except ValueError as e:
        why = str(e).split("cannot write there", 1)[-1].split(";")[0].strip()
        raise ValueError(
            f"{option} {path}: cannot write there: its folder {path.parent} is not writable {why}; "
            "give a file in a writable folder"
        ) from None


def parse_list(text: str | list[str], option: str, example: str) -> list[str]:
    """A list option: comma-separated (the option may also be repeated), items stripped,
    duplicates dropped with the first order kept.

    Raises:
        ValueError: no item (names ``option`` and gives ``example``).
    """
    from consequence.config import comma_list

    try:
        return comma_list(text, "")
    except ValueError:
        raise ValueError(f"{option} {text!r}: give a comma-separated list, e.g. {example}") from None


def parse_ks(text: str) -> list[int]:
    """The ``-k`` list: comma-separated positive integers, duplicates dropped, order kept."""
    try:
        ks = [int(x) for x in parse_list(text, "-k", "1,4,16")]
    except ValueError:
        ks = []
    if not ks:
        raise ValueError(f"-k {text!r}: give comma-separated integers, e.g. 1,4,16")
    return ks


def parse_env_options(items: list[str] | dict) -> dict:
    """``--env-option key=value`` (repeatable) → ``{key: value}``; each value is read as YAML
    (``3`` → 3, ``0.5`` → 0.5, ``true`` → True, ``a,b`` → "a,b").

    Raises:
        ValueError: an item without ``=``, an empty key, a key given twice, or a value that is not YAML.
    """
    import yaml

    if isinstance(items, dict):
        return items
    out: dict = {}
    for item in items:
        key, eq, value = item.partition("=")
        key = key.strip()
        if not eq or not key:
            raise ValueError(f"--env-option {item!r}: give key=value (e.g. --env-option dataset=chain_sum)")
        if key in out:
            raise ValueError(f"--env-option {key}: given twice ({out[key]!r} and {value!r}); give it once")
        try:
            out[key] = yaml.safe_load(value) if value.strip() else ""
        except yaml.YAMLError as e:
            raise ValueError(f"--env-option {item!r}: the value is not readable ({str(e).splitlines()[0]})") from None
    return out
