"""Shared fixtures: the golden tiny checkpoint (a copy of shared/golden) and its expected outputs."""

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file

FIXTURES = Path(__file__).parent / "fixtures"
GOLDEN_TINY = FIXTURES / "tiny"


@pytest.fixture(scope="session")
def expected():
    """Tensors of `fixtures/expected.safetensors` (see fixtures/README.md for names and tolerances)."""
    return load_file(FIXTURES / "expected.safetensors")


@pytest.fixture(scope="session")
def cases():
    with open(FIXTURES / "cases.json") as f:
        return json.load(f)
