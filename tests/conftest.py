import os
import tempfile

import pytest
import torch

from tool_specs import TOOLS

torch.set_num_threads(1)
# No test may reach the Hugging Face hub (a hub id is resolved offline: from the cache, or a
# clear error); huggingface_hub reads this once, at its import, which comes after this file.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Module- and session-scoped fixtures run before the per-test ledger below: give them a
# ledger of the test session's own instead of the user's.
os.environ["CONSEQUENCE_LEDGER"] = os.path.join(tempfile.mkdtemp(prefix="ledger-"), "split-ledger.jsonl")


@pytest.fixture(autouse=True)
def _own_split_ledger(tmp_path, monkeypatch):
    """Each test gets its own split ledger, so no test reads another's (or the user's) touches."""
    monkeypatch.setenv("CONSEQUENCE_LEDGER", str(tmp_path / "split-ledger.jsonl"))


@pytest.fixture(scope="session")
def tiny_tokenizer():
    from consequence.policy.tiny import build_tokenizer

    corpus = [
        "def find_max(xs):\n    best = 0\n    for x in xs:\n        if x > best:\n            best = x\n    return best",
        '<tool_call>\n{"name": "run_tests", "arguments": {}}\n</tool_call>',
        "2/5 passed ab a b abab",
    ] * 5
    return build_tokenizer(corpus, vocab_size=320)


@pytest.fixture(scope="session")
def renderer(tiny_tokenizer):
    from consequence.harness.renderer import Renderer

    return Renderer(tiny_tokenizer, TOOLS)


@pytest.fixture(scope="session")
def teacher_dir(tmp_path_factory):
    """A teacher for the distillation tests: the bundled policy with its LM head perturbed
    (0.1 × N(0, 1), seed 0), so the same tokenizer with another next-token distribution."""
    import torch

    from consequence.policy.tiny import BUNDLED, load_policy, save_policy

    model, tok = load_policy(BUNDLED)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        model.lm_head.weight.add_(0.1 * torch.randn(model.lm_head.weight.shape, generator=g))
    out = tmp_path_factory.mktemp("teacher") / "t"
    save_policy(model, tok, out)
    return out
