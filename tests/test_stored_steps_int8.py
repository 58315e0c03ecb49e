"""The int8 CPU path's stored compiled frame step (generation/stored_steps.py, cpu_weights.py): compiled once, run by a
later call, and equal to the eager int8 step up to its reordering.

A file of its own so that its compile (a minute) runs beside tests/test_stored_steps.py's under `-n 2`, not after it.
Exactness: the routed experts' int8 products take their inputs rounded to bfloat16, so besides reordering float32
work (about 1e-5 of the logit scale, tests/test_stored_steps.py) the compiled step can move one input of a product
across a bfloat16 rounding step: 2^-8 of that input, which moves the product's outputs by 2^-8 |x_i| |W[:, i]|, about
1e-4 of the logit scale on this model's unit-scale weights and activations (the linears' fbgemm products, where torch
has them, round an input by at most 1 / 2,000,376 of its row's largest, far less); the rule's 2 * `MARGIN` (2e-3)
covers both.
"""

from tests.conftest import GOLDEN_TINY
from tests.stored_step_support import check_equal_to_the_eager_step_up_to_reordering, store_with_inline_compiles
from transformers_drama3 import FishOmniForSpeech

FRAMES = 16
TEXT = "Hello there, how are you today?"


def test_the_int8_path_runs_its_stored_step_and_equals_its_eager_step_up_to_its_reordering(tmp_path,
                                                                                          golden_processor):
    with store_with_inline_compiles(tmp_path) as store:
        model = FishOmniForSpeech.from_pretrained(GOLDEN_TINY, cpu_path="int8")
        inputs = golden_processor(TEXT)
        model.generate(**inputs, max_new_tokens=1, do_sample=False, output_audio=False)  # asks for the step
        frames = model.generate(**inputs, max_new_tokens=FRAMES, do_sample=False, output_audio=False).sequences[0]
        assert len(store.used) == 1
    check_equal_to_the_eager_step_up_to_reordering(model, inputs, frames)  # (the store is off again here)
