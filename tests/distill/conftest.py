"""Fixtures shared by the demonstration-source tests: the bundled student's tokenizer and the calculator."""

import pytest

from consequence.envs.registry import load_environment
from consequence.policy.tiny import BUNDLED, load_policy


@pytest.fixture(scope="module")
def tokenizer():
    return load_policy(BUNDLED)[1]


@pytest.fixture(scope="module")
def calc():
    return load_environment("calculator", 0)
