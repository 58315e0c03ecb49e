"""Stored compiled frame steps in tests (generation/stored_steps.py): a temporary store, and its background compiles
run at once in the test's process.

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
