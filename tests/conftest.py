import os
import tempfile

import pytest
import torch

torch.set_num_threads(1)
# Module- and session-scoped fixtures run before the per-test ledger below: give them a
# ledger of the test session's own instead of the user's.
os.environ["CONSEQUENCE_LEDGER"] = os.path.join(tempfile.mkdtemp(prefix="ledger-"), "split-ledger.jsonl")


@pytest.fixture(autouse=True)
def _own_split_ledger(tmp_path, monkeypatch):
    """Each test gets its own split ledger, so no test reads another's (or the user's) touches."""
    monkeypatch.setenv("CONSEQUENCE_LEDGER", str(tmp_path / "split-ledger.jsonl"))


TOOLS = [
    {"type": "function", "function": {"name": "run_tests", "description": "Run the visible tests.",
                                      "parameters": {"type": "object", "properties": {}}}},
    {"type": "function", "function": {"name": "replace_line", "description": "Replace one line.",
                                      "parameters": {"type": "object",
                                                     "properties": {"line": {"type": "integer"}, "code": {"type": "string"}},
                                                     "required": ["line", "code"]}}},
    {"type": "function", "function": {"name": "finish", "description": "End the episode.",
                                      "parameters": {"type": "object", "properties": {}}}},
]


@pytest.fixture(scope="session")
def tiny_tokenizer():
    from consequence.policy.tiny import build_tokenizer

    corpus = ["def find_max(xs):\n    best = 0\n    for x in xs:\n        if x > best:\n            best = x\n    return best",
              '<tool_call>\n{"name": "run_tests", "arguments": {}}\n</tool_call>', "2/5 passed ab a b abab"] * 5
    return build_tokenizer(corpus, vocab_size=320)


@pytest.fixture(scope="session")
def renderer(tiny_tokenizer):
    from consequence.harness.renderer import Renderer

    return Renderer(tiny_tokenizer, TOOLS)
