"""Helpers shared by the commands: the console, checks of paths given on the command line."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console

console = Console(soft_wrap=True)


def quiet_libraries() -> None:
    """Our progress bar is the one to read: silence transformers' load/save bars."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def check_model_dir(model: str | None, option: str = "--model", chat_template: bool = True) -> None:
    """A local checkpoint needs its config and tokenizer files (checked before any work)."""
    if model is None:
        return
    p = Path(model)
    if not p.is_dir():
        raise ValueError(f"{option} {p}: no such directory (give a local Hugging Face checkpoint folder)")
    missing = [n for n in ("config.json",) if not (p / n).is_file()]
    if not any((p / n).is_file() for n in ("tokenizer.json", "tokenizer_config.json")):
        missing.append("tokenizer.json or tokenizer_config.json")
    if missing:
        raise ValueError(f"{option} {p}: not a Hugging Face checkpoint, missing {', '.join(missing)} "
                         "(save both the model and its tokenizer with save_pretrained)")
    if chat_template and not has_chat_template(p):
        raise ValueError(f"{option} {p}: the tokenizer has no chat template, which the harness needs to render "
                         "conversations and tool calls; set tokenizer.chat_template (e.g. "
                         "consequence.policy.tiny.chat_template(), Qwen2.5 layout) and save_pretrained it again")


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


def check_run_dir(run: Path, option: str = "--run-dir") -> None:
    try:
        run.mkdir(parents=True, exist_ok=True)
        probe = run / ".write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise ValueError(f"{option} {run}: cannot write there ({e.strerror or e})") from None


def parse_ks(text: str) -> list[int]:
    try:
        ks = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        ks = []
    if not ks:
        raise ValueError(f"-k {text!r}: give comma-separated integers, e.g. 1,4,16")
    return ks


