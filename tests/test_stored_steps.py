"""Stored compiled frame steps (generation/stored_steps.py): the CPU path's step compiled once, ahead of time, and run
by later calls and later processes.

Exactness. A stored step is inductor's compile of the float16 CPU path's step: the same products (float16 weights,
torch's own kernels for them) with the float32 work between them fused and reordered. Reordering n float32 terms moves
a result by about sqrt(n) * 2^-24 of its scale: with about 3e4 terms on the path from the embedding to a head, about
1e-5 of the logit scale (tests/test_sampling_law.py), and the margin rule's `MARGIN` (1e-3) covers it 100 times. So:
- against the float32 reference, the stored step's greedy frames obey the CPU path's rule (tests/test_cpu_path.py:
  equal up to the first frame whose reference top-2 margin is within twice the largest logit difference between the
  float16 and float32 teacher-forced passes, plus `MARGIN`);
- against the eager float16 step they differ by that reordering only: equal up to the first frame where a top-2
  margin of the eager path's own teacher-forced logits is within 2 * `MARGIN`.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import GOLDEN_TINY
from tests.stored_step_support import (KERNELS, check_equal_to_the_eager_step_up_to_reordering,
                                      store_with_inline_compiles)
from tests.test_cpu_path import check_margin_rule
from transformers_drama3 import FishOmniForSpeech
from transformers_drama3.generation import stored_steps
from transformers_drama3.generation.rules import Drama3FrameSampling, frame_criteria
from transformers_drama3.generation.settings import generation_settings
from transformers_drama3.generation.state import FrameState

FRAMES = 16
TEXT = "Hello there, how are you today?"


@pytest.fixture(scope="module")
def compiled(tmp_path_factory, golden_processor):
    """A store holding the golden model's greedy step (compiled by the first call, inline), and the frames a later
    call made with it: (store, model, inputs, frames)."""
    directory = tmp_path_factory.mktemp("steps")
    with store_with_inline_compiles(directory) as store:
        model = FishOmniForSpeech.from_pretrained(GOLDEN_TINY, cpu_path="float16")
        inputs = golden_processor(TEXT)
        first = model.generate(**inputs, max_new_tokens=1, do_sample=False, output_audio=False)  # asks for the step
        assert len(store.used) == 0 and len(first.codes[0][0]) == 1
        frames = model.generate(**inputs, max_new_tokens=FRAMES, do_sample=False, output_audio=False).sequences[0]
        yield store, model, inputs, frames


def test_a_step_is_compiled_once_from_the_configuration_and_stored_with_what_its_key_covers(compiled):
    store, model, _, _ = compiled
    (step,) = store.directory.glob("*/*.step")
    description = json.loads(step.with_suffix(".json").read_text())
    assert description["model"] == json.loads(json.dumps(stored_steps.model_description(model), default=str))
    assert description["state"]["sizes"][0] == 1 and description["state"]["variant"][0] == [False]  # batch 1, greedy
    assert description["kernels"] == str(KERNELS)
    assert not list(store.directory.glob("*/*.lock")) and not list(store.directory.glob("*/*.failed"))
    assert store.used == {step}


def test_stored_greedy_frames_follow_the_margin_rule_against_float32(compiled):
    _, model, inputs, frames = compiled
    reference = FishOmniForSpeech.from_pretrained(GOLDEN_TINY, cpu_path="float32")
    expected = reference.generate(**inputs, max_new_tokens=FRAMES, do_sample=False, output_audio=False).sequences[0]
    covered = check_margin_rule(reference, model, expected, frames, inputs["input_ids"].shape[1])
    assert covered > 0.5, covered


def test_stored_greedy_frames_equal_the_eager_float16_step_up_to_its_reordering(compiled, monkeypatch):
    _, model, inputs, frames = compiled
    monkeypatch.setenv(stored_steps.STORE_VARIABLE, "off")
    check_equal_to_the_eager_step_up_to_reordering(model, inputs, frames)


def test_a_later_process_loads_the_stored_step_at_its_load(compiled):
    store, _, _, _ = compiled
    script = (
        "import torch, transformers_drama3\n"
        "from transformers_drama3 import FishOmniForSpeech\n"
        "from transformers_drama3.generation.stored_steps import store_for\n"
        f"model = FishOmniForSpeech.from_pretrained({str(GOLDEN_TINY)!r}, cpu_path='float16')\n"
        "print(len(store_for(model).used))\n"
    )
    environment = {**os.environ, stored_steps.STORE_VARIABLE: str(store.directory),
                   stored_steps.INDUCTOR_VARIABLE: str(KERNELS)}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=environment, check=True)
    assert done.stdout.split()[-1] == "1", done.stderr[-2000:]


def test_the_key_changes_with_what_the_compiled_code_depends_on(compiled, monkeypatch):
    _, model, _, _ = compiled
    sampling, stopping = Drama3FrameSampling(), frame_criteria(model, generation_settings(model.generation_config))
    with torch.no_grad():
        template = model(torch.zeros(1, 2, 11, dtype=torch.long), use_cache=True).cache
    state = FrameState(model, 1, 256, 16, template)
    base = stored_steps.state_description(state, 256, sampling, stopping)
    assert stored_steps.state_description(state, 512, sampling, stopping) != base
    assert stored_steps.state_description(FrameState(model, 2, 256, 16, template), 256, sampling, stopping) != base
    assert stored_steps.state_description(state, 256, sampling, stopping[:1]) != base
    model_part = stored_steps.model_description(model)
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)
    try:
        assert stored_steps.model_description(model) != model_part
    finally:
        torch.set_num_threads(threads)
    monkeypatch.setattr(stored_steps, "source_digest", lambda: "edited")
    assert stored_steps.model_description(model) != model_part


def test_damaged_or_unreachable_steps_fall_back_to_the_eager_step(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv(stored_steps.INDUCTOR_VARIABLE, str(tmp_path / "kernels"))
    store = stored_steps.StepStore(tmp_path)
    key = ("model", "state")
    store.path(key).parent.mkdir()
    store.path(key).write_bytes(b"not a compiled step")
    store.path(key).with_suffix(".json").write_text(json.dumps({"kernels": store.kernel_folder()}))
    assert store.load(key) is None and "could not be loaded" in caplog.text
    other = stored_steps.StepStore(tmp_path)
    store.path(key).with_suffix(".json").write_text(json.dumps({"kernels": str(tmp_path / "elsewhere")}))
    assert other.load(key) is None and "is not used" in caplog.text


def test_one_background_compile_at_a_time_and_a_failed_one_is_not_tried_again(tmp_path, monkeypatch):
    started = []
    monkeypatch.setattr(stored_steps, "start_compile", lambda lock, environment: started.append(lock) or 1)
    store = stored_steps.StepStore(tmp_path)
    request = {"threads": 1}
    assert store.compile_later(request, ("model", "a"))
    assert not store.compile_later(request, ("model", "b"))  # "a" compiles: "b" waits ...
    assert json.loads(started[0].read_text())["key"] == ["model", "a"]
    started[0].unlink()  # ... until "a" is done; then "b" starts when asked again
    assert store.compile_later(request, ("model", "b"))
    store.path(("model", "c")).with_suffix(".failed").write_text("RuntimeError: no")
    assert not store.compile_later(request, ("model", "c")) and len(started) == 2
    # "b"'s process died without removing its lock (killed): its lock does not hold "d" back.
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    started[1].with_suffix(".pid").write_text(ended.stdout.strip())
    assert stored_steps.compiling(started[1]) is False
    assert store.compile_later(request, ("model", "d")) and not started[1].exists()


def test_the_store_is_off_by_its_variable_and_for_other_paths(monkeypatch):
    model = FishOmniForSpeech.from_pretrained(GOLDEN_TINY, cpu_path="float32")
    assert stored_steps.store_for(model) is None
    model.cpu_path = "float16"
    monkeypatch.setenv(stored_steps.STORE_VARIABLE, "off")
    assert stored_steps.store_for(model) is None
    monkeypatch.setenv(stored_steps.STORE_VARIABLE, "/some/folder")
    assert stored_steps.store_for(model).directory == Path("/some/folder")


def test_a_store_that_cannot_be_written_leaves_the_eager_step(tmp_path, caplog):
    blocked = tmp_path / "a file"
    blocked.write_text("")
    store = stored_steps.StepStore(blocked)  # its folders cannot be made
    assert not store.compile_later({"threads": 1}, ("model", "state")) and "eager step runs" in caplog.text
    assert store.load(("model", "state")) is None
    store.preload("model")
