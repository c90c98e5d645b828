"""The bundled tiny policy: a byte-level BPE tokenizer and a ~2M-parameter Llama, both
built by our code (no downloads), saved and loaded with the ordinary HF calls.

The chat template (``chat_template.jinja``) has the Qwen2.5 layout so that one harness
parser serves the tiny model and real Qwen-style models.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch

# Saving and loading checkpoints lives in policy.checkpoint (shared with policy.lora); the
# names stay importable from here, where most callers use them.
from consequence.policy.checkpoint import WEIGHT_FILES as WEIGHT_FILES
from consequence.policy.checkpoint import check_model_folder as check_model_folder
from consequence.policy.checkpoint import load_policy as load_policy
from consequence.policy.checkpoint import save_policy as save_policy

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
    # transformers wraps PreTrainedModel.to with functools.wraps(Module.to), which mypy reads as unbound
    model = model.to(torch.float32)  # type: ignore[arg-type]
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.bos_token_id = None
    model.eval()
    return model
