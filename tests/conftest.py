"""Shared fixtures: the golden tiny checkpoint (a copy of shared/golden) and its expected outputs."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

FIXTURES = Path(__file__).parent / "fixtures"
GOLDEN_TINY = FIXTURES / "tiny"


def golden_generation_model():
    """The golden tiny checkpoint in float32 with the eager per-expert loop its golden values were computed with."""
    from transformers_drama3 import FishOmniForSpeech

    model = FishOmniForSpeech.from_pretrained(GOLDEN_TINY, dtype=torch.float32)
    model.set_experts_implementation("eager")
    return model


def left_padded(*prompts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts `[T_i, 11]` as one left-padded batch `[B, max T_i, 11]` and its attention mask `[B, max T_i]`."""
    rows = max(p.shape[0] for p in prompts)
    batch = torch.zeros(len(prompts), rows, 11, dtype=torch.long)
    mask = torch.zeros(len(prompts), rows, dtype=torch.long)
    for index, p in enumerate(prompts):
        batch[index, rows - p.shape[0] :], mask[index, rows - p.shape[0] :] = p, 1
    return batch, mask


@pytest.fixture(scope="session")
def expected():
    """Tensors of `fixtures/expected.safetensors` (see fixtures/README.md for names and tolerances)."""
    return load_file(FIXTURES / "expected.safetensors")


@pytest.fixture(scope="session")
def cases():
    with open(FIXTURES / "cases.json") as f:
        return json.load(f)


@pytest.fixture(scope="module")
def prompt():
    """`[1, 10, 11]` frame rows for the golden tiny checkpoint: 4 text rows, then 6 audio rows with random codes
    (a short reference)."""
    codes = torch.randint(0, 32, (6, 10), generator=torch.Generator().manual_seed(0))  # [frames, NCB]
    rows = torch.zeros(10, 11, dtype=torch.long)
    rows[:4, 0] = torch.tensor([1, 5, 7, 9])
    rows[4:, 0], rows[4:, 1:] = 421 + codes[:, 0], codes  # semantic_start = 421
    return rows[None]
