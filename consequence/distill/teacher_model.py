"""A frozen teacher model for distillation: loaded once, checked against the student's tokenizer.

Distillation compares the log-probabilities two models give to the *same token ids*, so
the teacher must tokenise text exactly as the student does: the same id for every token,
and the same rules that turn text into ids (merges, normalizer, pre-tokenizer, added and
special tokens). A mismatch is refused before any work (before the teacher's weights are
loaded, before the run folder is touched), naming the first component that differs. The
teacher is put in eval mode with ``requires_grad`` off: it is never in an optimizer.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # annotations only
    from transformers import PreTrainedModel

from consequence.policy.tiny import load_policy

__all__ = ["check_same_tokenizer", "load_teacher", "tokenizer_difference"]

# The roles a chat template and the sampler read (end of turn, padding, start of text, unknown).
SPECIAL_ROLES = ("eos", "pad", "bos", "unk")
# Components of the `tokenizers` JSON that decide which ids a text becomes (or what an id
# means), in the order they are compared; ``truncation`` and ``padding`` are call settings
# of the backend, not part of the mapping, and are left out.
PIPELINE = (
    ("normalizer", "normalizer"),
    ("pre_tokenizer", "pre-tokenizer"),
    ("post_processor", "post-processor"),
    ("decoder", "decoder"),
)
# A text with nested code (whitespace runs), digits, accents, CJK and emoji: compared encodings of
# tokenizers without a `tokenizers` backend (slow tokenizers), where no JSON can be compared.
PROBE = (
    "def f(xs):\n    for x in xs:\n        if x > 0:\n            return x  # done\n\n\tTabs, 12345 + 0.5e-3, "
    'café naïve, 日本語, 😀 \' "q" <b>&amp;</b>  trailing  '
)


def tokenizer_difference(student_tok, teacher_tok) -> str | None:
    """The first way ``teacher_tok`` tokenises differently from ``student_tok``, in words; None if none.

    Compared in this order (the first difference is reported):

    1. the vocabulary, id for id (``get_vocab()``, added tokens included);
    2. the added tokens: id, content and flags (special, lstrip, rstrip, normalized, single_word);
    3. the special-token roles eos, pad, bos, unk (the token each names);
    4. the model: its type (BPE, Unigram, WordPiece, WordLevel), for BPE the merges in
       rank order, then its other settings (unk token, byte fallback, prefixes, scores);
    5. normalizer, pre-tokenizer, post-processor, decoder.

    Items 2, 4 and 5 read the ``tokenizers`` backend's JSON (``backend_tokenizer.to_str()``)
    of fast tokenizers; both sides are serialised by the same library in this process, so
    defaults are written out alike whichever version saved the files. For a tokenizer
    without that backend (a "slow" one) the encodings of a fixed probe text are compared
    instead of items 2, 4 and 5.

    Args:
        student_tok, teacher_tok: Hugging Face tokenizers (``PreTrainedTokenizerBase``).

    Returns:
        e.g. ``"its BPE merges: merge #17 (counting from 0, in rank order) is 'a b' for the
        student and 'ab c' for the teacher (both have 505 merges)"``, or None when they
        tokenise alike.
    """
    s = {i: t for t, i in student_tok.get_vocab().items()}
    t = {i: tok for tok, i in teacher_tok.get_vocab().items()}
    if s != t:
        first = min(i for i in set(s) | set(t) if s.get(i) != t.get(i))
        return (
            f"its vocabulary: id {first} is {s.get(first, '(none)')!r} for the student and "
            f"{t.get(first, '(none)')!r} for the teacher ({len(s)} vs {len(t)} tokens)"
        )
    js, jt = _backend_json(student_tok), _backend_json(teacher_tok)
    if (
        js is not None
        and jt is not None
        and (found := _added_tokens_difference(js.get("added_tokens") or [], jt.get("added_tokens") or []))
    ):
        return found
    if found := _roles_difference(student_tok, teacher_tok):
        return found
    if js is None or jt is None:  # a slow tokenizer: no JSON to compare, compare what it does
        a, b = (tok.encode(PROBE, add_special_tokens=False) for tok in (student_tok, teacher_tok))
        if a != b:
            k = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            return (
                f"how it splits text: a probe text encodes to {len(a)} ids for the student and {len(b)} for the "
                f"teacher, first different at position {k} ({_at(a, k)} vs {_at(b, k)})"
            )
        return None
    if found := _model_difference(js.get("model") or {}, jt.get("model") or {}):
        return found
    for key, words in PIPELINE:
        if leaf := _first_leaf_difference(js.get(key), jt.get(key), key):
            path, a, b = leaf
            where = "" if path == key else f" ({path})"
            return f"its {words}{where} is {_show(a)} for the student and {_show(b)} for the teacher"
    return None


def check_same_tokenizer(student_tok, teacher_tok, teacher_name: str = "the teacher") -> None:
    """Refuse a teacher tokenizer that does not tokenise exactly as the student's.

    Raises:
        ValueError: "``teacher_name``: its tokenizer differs from the student's in …", naming
            the first difference found by :func:`tokenizer_difference` (the vocabulary id for
            id, then added tokens, special-token roles, BPE merges and other model settings,
            normalizer, pre-tokenizer, post-processor, decoder).
    """
    found = tokenizer_difference(student_tok, teacher_tok)
    if found is None:
        return
    raise ValueError(
        f"{teacher_name}: its tokenizer differs from the student's in {found}; distillation compares "
        "the log-probs both models give to the same token ids, so the teacher must tokenise text exactly "
        "as the student does: give a teacher built on the student's tokenizer"
    )


# ---- the parts compared ------------------------------------------------------------------
def _backend_json(tok) -> dict[str, Any] | None:
    """The `tokenizers` backend of a fast tokenizer as JSON, or None for a slow tokenizer."""
    backend = getattr(tok, "backend_tokenizer", None) or getattr(tok, "_tokenizer", None)
    to_str = getattr(backend, "to_str", None)
    return json.loads(to_str()) if callable(to_str) else None


def _added_tokens_difference(a: list[dict], b: list[dict]) -> str | None:
    """The first added token (by id) that is missing on one side or has other content or flags."""
    by_a, by_b = {x["id"]: x for x in a}, {x["id"]: x for x in b}
    for i in sorted(set(by_a) | set(by_b)):
        x, y = by_a.get(i), by_b.get(i)
        if x == y:
            continue
        if x is None or y is None:
            one = x if x is not None else y
            assert one is not None  # id i is in by_a or by_b
            return (
                f"its added tokens: {one['content']!r} (id {i}) is an added token of the "
                f"{'student' if y is None else 'teacher'} only"
            )
        key = next(k for k in sorted(set(x) | set(y)) if x.get(k) != y.get(k))
        return (
            f"its added tokens: the token with id {i} ({x['content']!r}) has {key}={_show(x.get(key))} for the "
            f"student and {key}={_show(y.get(key))} for the teacher"
        )
    return None


def _roles_difference(student_tok, teacher_tok) -> str | None:
    """The first special-token role (eos, pad, bos, unk) set to another token (or only on one side)."""
    for role in SPECIAL_ROLES:
        a, b = (getattr(tok, f"{role}_token", None) for tok in (student_tok, teacher_tok))
        a, b = (None if x is None else str(x) for x in (a, b))
        if a != b:
            return (
                f"its special tokens: the {role} token is {_show_token(a)} for the student and "
                f"{_show_token(b)} for the teacher"
            )
    return None


def _model_difference(a: dict, b: dict) -> str | None:
    """Model type, then BPE merges in rank order, then the model's other settings (its vocab,
    equal id for id by now, can still differ in a Unigram's scores)."""
    if a.get("type") != b.get("type"):
        return f"its model: {a.get('type')} for the student and {b.get('type')} for the teacher"
    ma, mb = a.get("merges"), b.get("merges")
    if ma != mb:
        ma, mb = ma or [], mb or []
        k = next((k for k, (x, y) in enumerate(zip(ma, mb)) if x != y), min(len(ma), len(mb)))
        return (
            f"its BPE merges: merge #{k} (counting from 0, in rank order) is {_merge(ma, k)} for the student and "
            f"{_merge(mb, k)} for the teacher ("
            + (f"both have {len(ma)} merges)" if len(ma) == len(mb) else f"{len(ma)} vs {len(mb)} merges)")
        )
    rest_a, rest_b = ({k: v for k, v in m.items() if k != "merges"} for m in (a, b))
    if found := _first_leaf_difference(rest_a, rest_b, "model"):
        path, x, y = found
        return f"its {a.get('type')} model ({path}) is {_show(x)} for the student and {_show(y)} for the teacher"
    return None


def _first_leaf_difference(a: Any, b: Any, path: str) -> tuple[str, Any, Any] | None:
    """The first place (a dotted path, ``[i]`` for list items) where two JSON values differ,
    with the two values there; a missing key or a type change is a difference of the whole value."""
    if a == b:
        return None
    if isinstance(a, dict) and isinstance(b, dict) and a.get("type") == b.get("type"):
        for k in list(a) + [k for k in b if k not in a]:
            if k in a and k in b:
                if found := _first_leaf_difference(a[k], b[k], f"{path}.{k}"):
                    return found
            elif a.get(k) != b.get(k):
                return f"{path}.{k}", a.get(k), b.get(k)
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b)):
            if found := _first_leaf_difference(x, y, f"{path}[{i}]"):
                return found
    return path, a, b


def _merge(merges: list, k: int) -> str:
    if k >= len(merges):
        return "(none)"
    m = merges[k]
    return repr(" ".join(m) if isinstance(m, list) else m)


def _at(ids: list[int], k: int) -> str:
    return f"id {ids[k]}" if k < len(ids) else "the end"


def _show_token(x: str | None) -> str:
    return "not set" if x is None else repr(x)


def _show(x: Any, limit: int = 120) -> str:
    """A JSON value, short: ``absent`` for null (the pipeline has no such step), JSON
    otherwise (cut after ``limit`` characters)."""
    if x is None:
        return "absent"
    text = json.dumps(x, ensure_ascii=False)
    return text if len(text) <= limit else text[:limit] + "…"


def _out_rows(model: PreTrainedModel) -> int:
    """Rows of the model's output layer: the vocabulary its next-token distributions cover."""
    return int(model.get_output_embeddings().weight.shape[0])


def _teacher_tokenizer(folder: Path):
    """The teacher's tokenizer alone (cheap), so that a mismatch is refused before its weights load;
    None when it cannot be loaded on its own (``load_policy`` then reports why)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(folder))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def load_teacher(
    path: str | Path, student_tok, log: Callable[[str], None] = print, student: PreTrainedModel | None = None
) -> PreTrainedModel:
    """Load the teacher at ``path`` (a local model folder or a registered name), frozen.

    Args:
        path: a Hugging Face causal LM folder or a name of ``policy.named``.
        student_tok: the student's tokenizer (the teacher's must tokenise exactly as it
            does: :func:`check_same_tokenizer`).
        log: progress lines (a registered model's first conversion).
        student: the student model; when given, the teacher's output layer must cover
            the same number of token ids (the same tokenizer files with a wider
            embedding would give distributions over different supports).

    Returns:
        the teacher in eval mode, every parameter with ``requires_grad = False``.

    Raises:
        ValueError: the folder cannot be loaded as a model, its tokenizer differs (checked
            before the weights are loaded), or its output vocabulary differs from the student's.
    """
    from consequence.policy.named import model_folder

    folder = model_folder(str(path), log=log, option="--teacher")
    early = _teacher_tokenizer(folder)
    if early is not None:
        check_same_tokenizer(student_tok, early, f"--teacher {path}")
    model, tok = load_policy(folder)
    check_same_tokenizer(student_tok, tok, f"--teacher {path}")
    if student is not None and _out_rows(model) != _out_rows(student):
        raise ValueError(
            f"--teacher {path} predicts over {_out_rows(model)} token ids, the student over "
            f"{_out_rows(student)}: distillation compares their distributions id for id, so teacher and "
            "student need the same vocabulary (the same tokenizer and output layer size)"
        )
    return model.eval().requires_grad_(False)
