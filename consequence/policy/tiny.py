"""The bundled tiny policy: a byte-level BPE tokenizer and a ~2M-parameter Llama, both
built by our code (no downloads), saved and loaded with the ordinary HF calls.

The chat template (``chat_template.jinja``) has the Qwen2.5 layout so that one harness
parser serves the tiny model and real Qwen-style models.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch

TEMPLATE_PATH = Path(__file__).with_name("chat_template.jinja")

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS: tuple[str, ...] = (PAD_TOKEN, IM_START, IM_END)
# Qwen2.5 keeps these as added, non-special tokens: never split by BPE, yet always shown
# by ``decode`` (also with ``skip_special_tokens=True``), so the harness finds the tags.
TOOL_TOKENS: tuple[str, ...] = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")

BUNDLED = Path(__file__).resolve().parents[1] / "assets" / "tiny-repair"  # the shipped warm start


def chat_template() -> str:
    """The Jinja chat template text shipped with the package."""
    return TEMPLATE_PATH.read_text()


def build_tokenizer(corpus: Iterable[str], vocab_size: int = 768):
    """Train a byte-level BPE tokenizer on ``corpus``.

    Args:
        corpus: texts to learn merges from (rendered conversations work best).
        vocab_size: total vocabulary size, special and tool tokens included.

    Returns:
        ``transformers.PreTrainedTokenizerFast`` with pad ``<|endoftext|>``, eos
        ``<|im_end|>``, ``<|im_start|>`` special, the four tool tags as single added
        tokens, and the package chat template.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    n_fixed = len(SPECIAL_TOKENS) + len(TOOL_TOKENS)
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < n_fixed + len(alphabet):
        raise ValueError(
            f"build_tokenizer: vocab_size={vocab_size} is below the {n_fixed + len(alphabet)} "
            "ids needed for the 256 byte symbols and the 7 special/tool tokens; raise it"
        )
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(TOOL_TOKENS),
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=alphabet,
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_TOKENS])

    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD_TOKEN,
        eos_token=IM_END,
        bos_token=None,
        unk_token=None,
        model_max_length=1024,
        padding_side="right",  # training rows are right-padded (token_logprobs)
        clean_up_tokenization_spaces=False,
    )
    hf.add_special_tokens({"additional_special_tokens": [IM_START]})
    hf.chat_template = chat_template()
    for t in SPECIAL_TOKENS + TOOL_TOKENS:
        ids = hf.encode(t, add_special_tokens=False)
        if len(ids) != 1:  # pragma: no cover - guards against tokenizers API drift
            raise RuntimeError(f"build_tokenizer: {t!r} encodes to {ids}, expected one id")
    return hf


def build_model(
    tokenizer,
    seed: int = 0,
    hidden_size: int = 192,
    num_layers: int = 4,
    num_heads: int = 4,
    intermediate_size: int = 512,
    max_position_embeddings: int = 1024,
):
    """A freshly initialised fp32 ``LlamaForCausalLM`` with tied embeddings (~2M params).

    The global torch RNG is left untouched (initialisation runs under ``fork_rng``).
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        rms_norm_eps=1e-6,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model = model.to(torch.float32)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.bos_token_id = None
    model.eval()
    return model


WEIGHT_FILES: tuple[str, ...] = (
    "model.safetensors",
    "pytorch_model.bin",
    "model.safetensors.index.json",
    "pytorch_model.bin.index.json",
)


def check_model_folder(path, option: str = "--model") -> None:
    """A checkpoint folder has weights and a ``config.json`` that names its ``model_type``
    (or is a LoRA adapter checkpoint whose base folder exists: ``policy.lora``).

    Raises:
        ValueError: no weights file (one of ``WEIGHT_FILES``), or config.json missing, not
            valid JSON, not an object, or without ``model_type``; the message starts with
            ``option`` and the folder and says what to fix.
    """
    import json

    from consequence.policy.lora import adapter_base, is_adapter_folder

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
    checkpoint loads as its base model with the adapter: ``policy.lora.load_adapter_policy``).

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
    from consequence.policy.lora import is_adapter_folder, load_adapter_policy

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
    import os
    import shutil
    import tempfile

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
