"""Stored compiled frame steps in tests (generation/stored_steps.py): a temporary store, its background compiles run
at once in the test's process, and the check that a stored step's greedy frames are the eager step's.

The suite runs with the store off (conftest.py); these helpers turn it on for one model's tests. A compile asked for
by a step runs `compile_into_store` on the request the background process would get (the model rebuilt from its
configuration, its key checked, inductor's compile stored), in the test's process and before the step goes on, so the
next state that looks for it finds it.
"""

from __future__ import annotations

import contextlib
import json
import tempfile
from pathlib import Path

import pytest
import torch

from tests.test_cpu_path import MARGIN
from transformers_drama3.generation import stored_steps

# Inductor's kernels of the tests' steps: one folder kept between runs (a compile that finds its kernels there takes
# a third of the time), not the user's store.
KERNELS = Path(tempfile.gettempdir()) / "transformers-drama3-test-kernels"


@contextlib.contextmanager
def store_with_inline_compiles(directory: Path):
    """Within: the step store is `directory`, its kernels go to `KERNELS` and its background compiles run inline
    (module docstring)."""

    def compile_now(lock: Path, environment: dict) -> int:
        try:
            stored_steps.compile_into_store(json.loads(lock.read_text()))
        finally:
            lock.unlink(missing_ok=True)
        return 0

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(stored_steps.STORE_VARIABLE, str(directory))
        patch.setenv(stored_steps.INDUCTOR_VARIABLE, str(KERNELS))
        patch.setattr(stored_steps, "start_compile", compile_now)
        yield stored_steps.store_at(directory)


def check_equal_to_the_eager_step_up_to_reordering(model, inputs, frames: torch.Tensor) -> None:
    """Greedy `frames` `[P + n, 1 + NCB]` made by `model`'s stored step equal the eager step's up to the first frame
    where a top-2 margin of the eager path's own teacher-forced logits is within 2 * `MARGIN` (reordering float32 work
    moves a logit by far less: tests/test_stored_steps.py's docstring). Call it with the store off."""
    prompt = inputs["input_ids"].shape[1]
    count = len(frames) - prompt
    eager = model.generate(**inputs, max_new_tokens=count, do_sample=False, output_audio=False).sequences[0]
    with torch.no_grad():
        logits = model(eager[None])
    main, heads = logits.main_logits[0, prompt - 1 : -1], logits.codebook_logits[0, prompt:]
    top_main, top_heads = main.topk(2).values, heads.topk(2).values
    margins = torch.minimum(top_main[:, 0] - top_main[:, 1], (top_heads[..., 0] - top_heads[..., 1]).amin(-1))
    close = (margins < 2 * MARGIN).nonzero()
    decided = int(close[0, 0]) if len(close) else count
    assert decided > 0  # the comparison is not empty on this model
    assert torch.equal(frames[: prompt + decided], eager[: prompt + decided])
