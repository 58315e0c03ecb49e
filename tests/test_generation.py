"""Speech generation: golden greedy run, the sampling rules, RAS, seeds, batching, streaming, stopping, bad inputs."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import (
    EosTokenCriteria,
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
    RepetitionPenaltyLogitsProcessor,
    StoppingCriteria,
    StoppingCriteriaList,
    TopKLogitsWarper,
)
from transformers.generation import GenerateDecoderOnlyOutput
from transformers.generation.streamers import BaseStreamer

from transformers_drama3 import FishOmniForSpeech, generation_drama3
from transformers_drama3.generation.rules import Drama3EndOfSpeech, Drama3FrameLimit, Drama3FrameSampling
from transformers_drama3.generation import DRAMA3_GENERATION_DEFAULTS, generation_settings
from transformers_drama3.streaming import Drama3AudioStreamer
from transformers_drama3.generation.sampling import draw
from transformers_drama3.testing import write_tiny_checkpoint

from .conftest import FIXTURES, GOLDEN_TINY, left_padded
from .host_reads import device_reads
from .sampling_rules import ScalarRas, ScalarRule
from .tolerances import codec_decode_reductions, main_logit_reductions, reordering_tolerance


@pytest.fixture(scope="module")
def model(golden_model):
    return golden_model  # the session's (conftest.py): these tests only spy on it


@pytest.fixture(scope="module")
def prompt(expected):
    return expected["prompt_a_rows"][None]


# ---------------------------------------------------------------------------------------------------------------
# Golden
# ---------------------------------------------------------------------------------------------------------------


def test_greedy_generation_reproduces_golden(model, prompt, expected):
    out = model.generate(prompt, do_sample=False, max_new_tokens=16)
    assert out.finish_reason == ["eos"]
    assert torch.equal(out.codes[0].T, expected["greedy_codes"])
    generated = out.sequences[0, prompt.shape[1] :]
    assert torch.equal(generated, expected["greedy_frames"])
    assert out.audio[0].shape == (expected["greedy_codes"].shape[0] * 2048,) and out.audio[0].dtype == torch.float32


@pytest.mark.parametrize(
    "case", ["main_default", "main_t07_p07", "main_ras_redraw", "head_default", "head_flat_topk_binds", "head_t15_p08"]
)
def test_sampling_rule_keeps_the_golden_sets(expected, cases, case):
    settings = next(c for c in cases["sampling"] if c["name"] == case)
    warper = ScalarRule(settings["temperature"], settings["top_k"], settings["top_p"], settings["keep_crossing"])
    logits = expected[f"sampling_{case}_logits"][None]
    kept = warper(None, logits)[0] > float("-inf")
    assert torch.equal(kept, expected[f"sampling_{case}_kept"])


def test_draws_follow_the_kept_and_renormalised_distribution():
    """20 000 draws; each frequency within 5 standard deviations of its probability (a fair test fails ~1e-6)."""
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0]])
    warper = ScalarRule(temperature=0.8, top_k=5, top_p=0.9, keep_crossing=False)
    expected = warper(None, logits).softmax(-1)[0]
    samples = draw(warper(None, logits).expand(20_000, -1), torch.Generator().manual_seed(0))
    frequency = torch.bincount(samples, minlength=8).double() / samples.numel()
    sigma = (expected.double() * (1 - expected.double()) / samples.numel()).sqrt()
    assert ((frequency - expected).abs() <= 5 * sigma + 1e-12).all()
    assert frequency[expected == 0].sum() == 0


# ---------------------------------------------------------------------------------------------------------------
# Repetition-aware sampling
# ---------------------------------------------------------------------------------------------------------------


def _ras(window=16):
    return ScalarRas(
        ScalarRule(1.0, None, 0.9, keep_crossing=True), ScalarRule(1.0, 3, 0.95, keep_crossing=True), window
    )


def _peaked_logits(peak=5):
    """Column `peak` takes 92 % of the mass: the first rule (top_p 0.9, crossing kept) keeps it alone, the
    second (top_p 0.95, top_k 3) keeps it and the two next ones."""
    probs = torch.tensor([0.001, 0.02, 0.02, 0.01, 0.009, 0.0, 0.01, 0.01, 0.0])
    probs[peak] = 0.92
    return (probs / probs.sum()).clamp(min=1e-6).log()[None]  # [1, V + 1] with V = 8


def test_ras_redraws_a_repeated_semantic_token_with_its_own_settings():
    ras, logits = _ras(), _peaked_logits()
    history = torch.tensor([[-1, -1, 2, 5, 7]])  # column 5 was drawn recently
    probs = ras(history, logits).exp()[0]
    second = ras.second(None, logits).softmax(-1)[0]
    # the first draw is the repeat: all mass moves to the second draw (two softmaxes over V + 1 and the mixture)
    torch.testing.assert_close(probs, second, **reordering_tolerance(second, 2 * logits.shape[-1] + 2))
    assert (probs > 0).sum() == 3 and (ras.first(None, logits) > float("-inf")).sum() == 1


def test_ras_keeps_the_first_draw_when_not_repeated():
    ras, logits = _ras(), _peaked_logits()
    probs = ras(torch.tensor([[-1, 2, 7]]), logits).exp()[0]
    first = ras.first(None, logits).softmax(-1)[0]
    torch.testing.assert_close(probs, first, **reordering_tolerance(first, 2 * logits.shape[-1] + 2))


def test_ras_window_slides_and_eos_never_triggers():
    ras, logits = _ras(window=3), _peaked_logits()
    old_repeat = torch.tensor([[5, 1, 2, 3]])  # column 5 is 4 draws back: outside a window of 3
    first = ras.first(None, logits).softmax(-1)[0]
    torch.testing.assert_close(ras(old_repeat, logits).exp()[0], first, **reordering_tolerance(first, 2 * logits.shape[-1] + 2))
    eos_logits = _peaked_logits(peak=0)
    first = ras.first(None, eos_logits).softmax(-1)[0]
    torch.testing.assert_close(ras(torch.tensor([[0, 0, 0]]), eos_logits).exp()[0], first,
                               **reordering_tolerance(first, 2 * eos_logits.shape[-1] + 2))


def test_ras_mixture_matches_two_draws_statistically():
    """The single-draw mixture has the law of the official two-draw procedure (draw, redraw on a repeat)."""
    logits = torch.tensor([[0.2, 1.0, 1.3, 0.1, 0.8, 0.0, -0.3, 0.6, 0.4]])
    ras, history = _ras(), torch.tensor([[2, 4]])
    generator, n = torch.Generator().manual_seed(1), 20_000
    first = draw(ras.first(None, logits).expand(n, -1), generator)
    second = draw(ras.second(None, logits).expand(n, -1), generator)
    two_draws = torch.where((first == 2) | (first == 4), second, first)
    frequency = torch.bincount(two_draws, minlength=9).double() / n
    expected = ras(history, logits).exp()[0].double()
    assert ((frequency - expected).abs() <= 5 * (expected * (1 - expected) / n).sqrt() + 1e-12).all()


# ---------------------------------------------------------------------------------------------------------------
# Seeds, batching, streaming
# ---------------------------------------------------------------------------------------------------------------


def test_seeded_runs_are_identical(model, prompt):
    a = model.generate(prompt, seed=7, max_new_tokens=12)
    b = model.generate(prompt, seed=7, max_new_tokens=12)
    c = model.generate(prompt, generator=torch.Generator().manual_seed(7), max_new_tokens=12)
    assert torch.equal(a.sequences, b.sequences) and torch.equal(a.sequences, c.sequences)
    assert torch.equal(a.audio[0], b.audio[0])
    d = model.generate(prompt, seed=8, max_new_tokens=12)
    assert not torch.equal(a.sequences, d.sequences)


def test_greedy_batch_equals_single_and_finished_sequences_leave_the_batch(model, expected):
    a, b = expected["prompt_a_rows"], expected["prompt_b_rows"]
    batch, mask = left_padded(a, b)
    sizes = []
    original = model.tower.decode_codes

    def spy(hidden, *args, **kwargs):
        sizes.append(hidden.shape[0])
        return original(hidden, *args, **kwargs)

    model.tower.decode_codes = spy
    try:
        together = model.generate(batch, attention_mask=mask, do_sample=False, max_new_tokens=18, stop_check_interval=1)
    finally:
        del model.tower.decode_codes
    alone = [model.generate(p[None], do_sample=False, max_new_tokens=18) for p in (a, b)]
    for index, single in enumerate(alone):
        assert torch.equal(together.codes[index], single.codes[0])
        assert together.finish_reason[index] == single.finish_reason[0]
        torch.testing.assert_close(together.audio[index], single.audio[0],
                                   **reordering_tolerance(single.audio[0], codec_decode_reductions(model.codec)))
    assert together.finish_reason[0] == "eos"  # prompt a stops after 12 frames (golden run)
    assert sizes[:13] == [2] * 13 and set(sizes[13:]) == {1}  # after its EOS step, only one sequence runs


def test_streamed_audio_equals_the_one_shot_audio(model, prompt):
    streamer = Drama3AudioStreamer(model.codec, chunk_frames=3, first_chunk_frames=1)
    out = model.generate(prompt, seed=3, max_new_tokens=11, streamer=streamer)
    chunks = list(streamer)
    assert [c.numel() // 2048 for c in chunks] == [1, 3, 3, 3, 1]
    # Same codes, same codec: the streaming decoder only sums in another order (tests/tolerances.py).
    torch.testing.assert_close(torch.cat(chunks), out.audio[0],
                               **reordering_tolerance(out.audio[0], codec_decode_reductions(model.codec)))


def test_three_sequences_that_end_one_by_one_each_get_their_frames_alone(model, expected):
    """Three prompts ending after 12, 7 and 18 greedy frames: the batch shrinks twice (3 -> 2 -> 1 running), and every
    sequence keeps the frames it makes alone, so the running ones keep their own state rows when it shrinks."""
    a = expected["prompt_a_rows"]
    prompts = (a, torch.cat((a[:1], a[4:])), torch.cat((a[:1], a[8:])))
    batch, mask = left_padded(*prompts)
    together = model.generate(batch, attention_mask=mask, do_sample=False, max_new_tokens=30, stop_check_interval=1,
                              output_audio=False)
    for index, prompt_rows in enumerate(prompts):
        alone = model.generate(prompt_rows[None], do_sample=False, max_new_tokens=30, output_audio=False)
        assert torch.equal(together.codes[index], alone.codes[0]) and together.finish_reason[index] == "eos"
    assert [codes.shape[1] for codes in together.codes] == [12, 7, 18]


def test_right_padding_is_realigned_by_generate_and_refused_by_forward(model, expected):
    """`generate` moves padding on the right (transformers' pipeline collator pads that way) to the left; `forward`
    aligns its outputs with its inputs, so it refuses padding anywhere but on the left."""
    a, b = expected["prompt_a_rows"], expected["prompt_b_rows"]
    left, left_mask = left_padded(a, b)
    right, right_mask = torch.zeros_like(left), torch.zeros_like(left_mask)
    for index, rows in enumerate((a, b)):
        right[index, : rows.shape[0]], right_mask[index, : rows.shape[0]] = rows, 1
    settings = {"do_sample": False, "max_new_tokens": 6, "output_audio": False}
    assert torch.equal(model.generate(right, attention_mask=right_mask, **settings).sequences,
                       model.generate(left, attention_mask=left_mask, **settings).sequences)
    with pytest.raises(ValueError, match="padding .* after real rows"):
        model(right, attention_mask=right_mask)
    holes = left_mask.clone()
    longest = int(left_mask[:, 0].argmax())  # the sequence without padding
    holes[longest, 5] = 0  # padding inside a sequence
    with pytest.raises(ValueError, match="padding .* after real rows"):
        model.generate(left, attention_mask=holes, **settings)


def test_a_streamed_batch_gives_each_sequence_its_own_audio_as_soon_as_it_ends(model, expected):
    """Batch streaming with `on_audio`: each sequence's chunks join into its one-shot audio (the codec's streaming
    bound, as above), and a sequence's end mark comes right after its last frame, while the other one still runs."""
    batch, mask = left_padded(expected["prompt_a_rows"], expected["prompt_b_rows"])
    events = []
    streamer = Drama3AudioStreamer(model.codec, chunk_frames=3, on_audio=lambda i, chunk: events.append((i, chunk)))
    out = model.generate(batch, attention_mask=mask, do_sample=False, max_new_tokens=18, streamer=streamer)
    assert out.finish_reason[0] == "eos" and out.codes[0].shape[1] == 12 and out.codes[1].shape[1] > 12
    for index in range(2):
        chunks = [chunk for i, chunk in events if i == index]
        assert chunks[-1] is None and all(c is not None for c in chunks[:-1])
        torch.testing.assert_close(torch.cat(chunks[:-1]), out.audio[index],
                                   **reordering_tolerance(out.audio[index], codec_decode_reductions(model.codec)))
    end_of_a = events.index((0, None))
    assert any(i == 1 and chunk is not None for i, chunk in events[end_of_a:])  # b still streamed after a ended


def test_a_batch_without_on_audio_is_a_clear_error(model, expected):
    batch, mask = left_padded(expected["prompt_a_rows"], expected["prompt_b_rows"])
    with pytest.raises(ValueError, match="on_audio"):
        model.generate(batch, attention_mask=mask, streamer=Drama3AudioStreamer(model.codec), max_new_tokens=2)


def test_a_seed_per_sequence_samples_each_sequence_as_it_samples_alone(model, expected):
    a, b = expected["prompt_a_rows"], expected["prompt_b_rows"]
    batch, mask = left_padded(a, b)
    together = model.generate(batch, attention_mask=mask, seed=[3, 5], max_new_tokens=10, output_audio=False)
    alone = [model.generate(p[None], seed=s, max_new_tokens=10, output_audio=False) for p, s in ((a, 3), (b, 5))]
    for index, single in enumerate(alone):
        assert torch.equal(together.codes[index], single.codes[0])
        assert together.finish_reason[index] == single.finish_reason[0]
    generators = [torch.Generator().manual_seed(3), torch.Generator().manual_seed(5)]
    again = model.generate(batch, attention_mask=mask, generator=generators, max_new_tokens=10, output_audio=False)
    assert torch.equal(again.sequences, together.sequences)
    with pytest.raises(ValueError, match="needs one per sequence"):
        model.generate(batch, attention_mask=mask, seed=[1], max_new_tokens=2)
    with pytest.raises(ValueError, match="either seed or generator"):
        model.generate(batch, attention_mask=mask, seed=1, generator=generators, max_new_tokens=2)


# ---------------------------------------------------------------------------------------------------------------
# Stopping
# ---------------------------------------------------------------------------------------------------------------


def test_length_stop_keeps_the_audio(model, prompt):
    # The golden tiny model draws EOS often; take the first seed whose run reaches the limit.
    runs = (model.generate(prompt, seed=seed, max_new_tokens=5, output_audio=True) for seed in range(20))
    out = next(run for run in runs if run.finish_reason != ["eos"])
    assert out.finish_reason == ["length"]
    assert out.codes[0].shape == (10, 5) and out.audio[0].shape == (5 * 2048,)


def test_context_limit_stop_keeps_the_audio(tmp_path, expected):
    """A prompt of 59 rows in a context of 64 rows: 5 frames fit (the last is kept but not fed back)."""
    small = FishOmniForSpeech.from_pretrained(
        write_tiny_checkpoint(tmp_path, seed=2, text_config={"max_position_embeddings": 64}), dtype=torch.float32
    )
    out = small.generate(expected["prompt_a_rows"][None], seed=0, max_new_tokens=50)
    assert out.finish_reason == ["context"]
    assert out.codes[0].shape == (10, 64 - 59 + 1)
    assert out.audio[0].shape == (out.codes[0].shape[1] * 2048,)


def test_greedy_needs_no_positive_temperature(model, prompt):
    out = model.generate(prompt, do_sample=False, temperature=0.0, max_new_tokens=3, output_audio=False)
    assert out.audio is None and out.codes[0].shape[1] == 3


class StopAt(StoppingCriteria):
    """Stops sequence 0 once it has `frames` frames (a criterion sees the prompt rows and the frames so far)."""

    def __init__(self, rows: int, frames: int):
        self.rows, self.frames, self.calls = rows, frames, []

    def __call__(self, input_ids, scores, **kwargs):
        self.calls.append((tuple(input_ids.shape), tuple(scores.shape)))
        stop = torch.zeros(input_ids.shape[0], dtype=torch.bool)
        stop[0] = input_ids.shape[1] - self.rows >= self.frames
        return stop


def test_a_stopping_criterion_stops_its_sequence_at_its_frame(model, expected):
    a, b = expected["prompt_a_rows"], expected["prompt_b_rows"]
    batch, mask = left_padded(a, b)
    criterion = StopAt(batch.shape[1], 3)
    out = model.generate(batch, attention_mask=mask, do_sample=False, max_new_tokens=14,
                         stopping_criteria=StoppingCriteriaList([criterion]), output_audio=False)
    alone = model.generate(b[None], do_sample=False, max_new_tokens=14, output_audio=False)
    assert out.finish_reason[0] == "stop" and out.codes[0].shape[1] == 3
    assert torch.equal(out.codes[1], alone.codes[0]) and out.finish_reason[1] == alone.finish_reason[0]
    rows, candidates = batch.shape[1], model.config.codebook_size + 1
    assert criterion.calls[0] == ((2, rows + 1, 11), (2, candidates)) and criterion.calls[2] == ((2, rows + 3, 11), (2, candidates))


class ForceEos(LogitsProcessor):
    def __init__(self):
        self.calls = []

    def __call__(self, input_ids, scores):
        self.calls.append(tuple(input_ids.shape))
        forced = torch.full_like(scores, float("-inf"))
        forced[:, 0] = 0.0  # column 0 is EOS
        return forced


def test_a_logits_processor_that_forces_eos_ends_at_the_first_frame(model, prompt):
    processor = ForceEos()
    out = model.generate(prompt, seed=0, max_new_tokens=8, logits_processor=LogitsProcessorList([processor]))
    assert out.finish_reason == ["eos"] and out.codes[0].shape == (10, 0) and out.audio[0].shape == (0,)
    assert processor.calls == [(1, prompt.shape[1], 11)]  # the rows before the frame


def test_output_scores_are_the_main_token_candidate_logits_of_each_frame(model, prompt):
    out = model.generate(prompt, do_sample=False, max_new_tokens=16, output_scores=True, output_audio=False)
    frames = out.codes[0].shape[1]
    assert len(out.scores) == frames + 1  # the last frame drew EOS
    columns = [int(scores[0].argmax()) for scores in out.scores]
    assert columns[-1] == 0 and columns[:-1] == (out.codes[0][0] + 1).tolist()  # column 1 + c0 is <|semantic:c0|>
    with torch.no_grad():
        full = model(out.sequences).main_logits[0, prompt.shape[1] - 1 :]  # the rows that predicted each frame
    # The step's cached logits against one uncached pass: the same sums in another order (tests/tolerances.py).
    tolerance = reordering_tolerance(full[:-1], main_logit_reductions(model.config, out.sequences.shape[1]))
    torch.testing.assert_close(torch.stack([s[0] for s in out.scores[:-1]]), full[:-1], **tolerance)
    assert model.generate(prompt, do_sample=False, max_new_tokens=2, output_audio=False).scores is None


def test_settings_that_do_not_apply_are_named(model, prompt):
    with pytest.raises(ValueError, match=r"\['num_beams'\]"):
        model.generate(prompt, generation_config=GenerationConfig(num_beams=4), max_new_tokens=2)
    with pytest.raises(TypeError, match="max_length"):
        model.generate(prompt, max_length=20)
    out = model.generate(prompt, generation_config=model.generation_config, do_sample=False, max_new_tokens=2)
    assert out.codes[0].shape[1] == 2
    beams = GenerationConfig(**DRAMA3_GENERATION_DEFAULTS, num_beams=4)  # a model's own config that asks for beams
    with pytest.raises(ValueError, match="greedily .* or by sampling, not by beam_sample"):
        generation_settings(beams)


def test_generate_runs_transformers_generate_with_the_drama3_hooks(model, prompt, monkeypatch):
    """`generate` is `GenerationMixin.generate`: its hooks give `_sample` the merged settings, the user's processors
    then Drama 3's sampling rule, and the user's criteria then EOS and the frame limit; and the objects `_sample`
    receives are the ones that run (each is seen called on its own instance during the frames)."""
    seen, ran = [], []
    sample = type(model)._sample

    def spy(self, input_ids, logits_processor, stopping_criteria, generation_config, **kwargs):
        seen.append((list(logits_processor), list(stopping_criteria), generation_config))
        return sample(self, input_ids, logits_processor, stopping_criteria, generation_config, **kwargs)

    def record(cls, name):
        original = getattr(cls, name)

        def called(self, *args, **kwargs):
            ran.append(self)
            return original(self, *args, **kwargs)

        monkeypatch.setattr(cls, name, called)

    monkeypatch.setattr(type(model), "_sample", spy)
    for cls, name in ((Drama3FrameSampling, "main"), (Drama3FrameSampling, "codebook"),
                      (Drama3EndOfSpeech, "__call__"), (Drama3FrameLimit, "__call__")):
        record(cls, name)

    class Never(StoppingCriteria):  # a user's own criterion: called on the host after each frame
        def __call__(self, input_ids, scores, **kwargs):
            ran.append(self)
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    user, never = TopKLogitsWarper(top_k=1), Never()  # the warper reads only the scores: it applies to frames
    record(TopKLogitsWarper, "__call__")
    out = model.generate(prompt, seed=0, max_new_tokens=3, logits_processor=[user], stopping_criteria=[never],
                         output_scores=True, ras_window=4, output_audio=False)
    processors, criteria, settings = seen[-1]
    assert isinstance(out, GenerateDecoderOnlyOutput) and settings.ras_window == 4 and settings.top_p == 0.9
    assert processors[0] is user and isinstance(processors[1], Drama3FrameSampling) and len(processors) == 2
    assert criteria[0] is never and [type(c) for c in criteria[1:]] == [Drama3EndOfSpeech, Drama3FrameLimit]
    assert {id(item) for item in ran} == {id(item) for item in processors + criteria}  # all ran, nothing else did
    assert criteria[-1].limit(prompt.shape[1]) == (3, "length")
    assert all(int(torch.isfinite(scores[0]).sum()) == 1 for scores in out.scores)  # top-1 after the user's warper
    ran.clear()
    model.generate(prompt, do_sample=False, max_new_tokens=10**9, output_audio=False)
    processors, criteria, _ = seen[-1]
    assert [type(p) for p in processors] == [Drama3FrameSampling] and len(criteria) == 2
    assert {id(item) for item in ran} == {id(item) for item in processors + criteria}
    context = model.config.text_config.max_position_embeddings
    assert criteria[-1].limit(prompt.shape[1]) == (context + 1 - prompt.shape[1], "context")


def test_transformers_processors_and_criteria_for_text_tokens_are_refused(model, prompt, monkeypatch):
    monkeypatch.setattr(model, "prefill", lambda *args: pytest.fail("the prefill ran"))
    with pytest.raises(ValueError, match=r"\['RepetitionPenaltyLogitsProcessor'\].*candidate logits"):
        model.generate(prompt, logits_processor=LogitsProcessorList([RepetitionPenaltyLogitsProcessor(1.2)]))
    with pytest.raises(ValueError, match=r"\['EosTokenCriteria'\].*EOS frame"):
        model.generate(prompt, stopping_criteria=StoppingCriteriaList([EosTokenCriteria(eos_token_id=3)]))
    with pytest.raises(TypeError, match="assistant_model"):
        model.generate(prompt, assistant_model=model)


def test_the_streamer_gets_the_prompt_rows_first_as_transformers_streamers_do(model, prompt):
    class Recorder(BaseStreamer):
        def __init__(self):
            self.shapes = []

        def put(self, value):
            self.shapes.append(tuple(value.shape))

        def end(self):
            self.shapes.append("end")

    recorder, audio = Recorder(), Drama3AudioStreamer(model.codec)
    out = model.generate(prompt, seed=1, max_new_tokens=2, streamer=recorder)
    model.generate(prompt, seed=1, max_new_tokens=2, streamer=audio)
    assert recorder.shapes == [(1, prompt.shape[1], 11), (1, 10), (1, 10), "end"]
    assert torch.cat(audio.chunks).shape == out.audio[0].shape  # the prompt rows are no frames
    assert out["audio"] is out.audio and "audio" in out.keys()  # a ModelOutput field, not only an attribute


def test_a_split_model_s_rules_decide_the_seed_and_refuse_fast_decode(model, prompt, monkeypatch):
    """Generation asks `model.split_rules` (set by a split load, parallel.py) and imports nothing from parallel.py."""

    class Rules:
        def shared_seed(self, model, seed, generator):
            return 5 if seed is None else seed

        def check_fast_decode(self):
            raise RuntimeError("not on a split model")

    monkeypatch.setattr(model, "split_rules", Rules(), raising=False)
    shared = model.generate(prompt, max_new_tokens=3, output_audio=False)
    with pytest.raises(RuntimeError, match="not on a split model"):
        model.generate(prompt, fast_decode=True, max_new_tokens=3)
    monkeypatch.delattr(model, "split_rules")
    assert torch.equal(shared.sequences, model.generate(prompt, seed=5, max_new_tokens=3, output_audio=False).sequences)
    source = Path(generation_drama3.__file__).read_text()
    assert not [node for node in ast.walk(ast.parse(source))
                if isinstance(node, ast.ImportFrom) and node.module and "parallel" in node.module]


def test_memory_follows_the_frames_made_not_max_new_tokens(tmp_path):
    """A fresh process's peak memory (ru_maxrss) after a call with `max_new_tokens=10**9` exceeds its peak after the
    same greedy take (12 frames) with `max_new_tokens=64` by less than 32 MiB. Sizing any buffer by max_new_tokens
    would need about 88 GB for the output rows alone (10**9 x 11 int64); buffers sized by the frames made (in chunks
    of 256 frames) need a few MiB at most."""
    script = tmp_path / "peak.py"
    script.write_text(
        "import resource, sys, torch\n"
        "from safetensors.torch import load_file\n"
        "from transformers_drama3 import FishOmniForSpeech\n"
        f"model = FishOmniForSpeech.from_pretrained({str(GOLDEN_TINY)!r}, dtype=torch.float32)\n"
        f"prompt = load_file({str(FIXTURES / 'expected.safetensors')!r})['prompt_a_rows'][None]\n"
        "model.generate(prompt, do_sample=False, max_new_tokens=64, output_audio=False)\n"
        "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "out = model.generate(prompt, do_sample=False, max_new_tokens=10**9, output_audio=False)\n"
        "after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "print(out.codes[0].shape[1], (after - before) // 1024)\n"
    )
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    frames, grown_mib = map(int, result.stdout.split())
    assert frames == 12
    assert grown_mib < 32, f"peak memory grew by {grown_mib} MiB for max_new_tokens=10**9"


def test_settings_live_on_the_generation_config(model, prompt):
    assert model.generation_config.ras_window == 16 and model.generation_config.codebook_top_k == 30
    assert model.generation_config.top_k == 0 and model.generation_config.top_p == 0.9
    sequences = model.generate(prompt, do_sample=False, max_new_tokens=2, return_dict_in_generate=False)
    assert sequences.shape == (1, prompt.shape[1] + 2, 11)


# ---------------------------------------------------------------------------------------------------------------
# Bad inputs
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs,error,needle",
    [
        ({"max_new_tokens": 0}, ValueError, "max_new_tokens"),
        ({"temperature": 0.0}, ValueError, r"temperature must be a number in \(0, 3.4028235e\+38\]"),
        ({"temperature": float("nan")}, ValueError, r"temperature must be a number in \(0, 3.4028235e\+38\]"),
        ({"codebook_temperature": float("inf")}, ValueError, "codebook_temperature must be a number in"),
        ({"codebook_temperature": -1.0}, ValueError, "codebook_temperature"),
        ({"top_p": 0.0}, ValueError, r"top_p must be a number in \(0, 1\]"),
        ({"max_new_tokens": "3"}, ValueError, "max_new_tokens"),
        ({"seed": 2**70}, ValueError, r"seed must be an integer in \[-9223372036854775808, "),
        ({"ras_top_p": 1.5}, ValueError, "ras_top_p"),
        ({"temprature": 0.5}, TypeError, "temprature"),
        ({"num_beams": 4}, TypeError, "num_beams"),
    ],
)
def test_bad_settings(model, prompt, kwargs, error, needle):
    with pytest.raises(error, match=needle):
        model.generate(prompt, **kwargs)


def test_bad_input_rows(model):
    with pytest.raises(ValueError, match=r"frame rows \[batch, rows, 11\]"):
        model.generate(torch.zeros(1, 4, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="at least one prompt row"):
        model.generate(torch.zeros(1, 0, 11, dtype=torch.long))
    rows = torch.zeros(1, 4, 11, dtype=torch.long)
    with pytest.raises(TypeError, match=r"attention_mask must be a torch.Tensor"):
        model.generate(rows, attention_mask=[[1, 1, 1, 1]])
    with pytest.raises(ValueError, match=r"attention_mask must be \[batch, cached rows \+ new rows\] = \[1, 4\]"):
        model.generate(rows, attention_mask=torch.ones(1, 5))  # all ones: transformers would drop it unchecked
    with pytest.raises(ValueError, match="0 \\(left padding\\) and 1"):
        model.generate(rows, attention_mask=torch.full((1, 4), 0.5))


def test_overlapped_streaming_gives_the_same_chunks(model, prompt):
    """`overlap=True` decodes in a worker thread: the same chunks in the same order as decoding in line."""
    inline = Drama3AudioStreamer(model.codec, chunk_frames=3, first_chunk_frames=1)
    overlapped = Drama3AudioStreamer(model.codec, chunk_frames=3, first_chunk_frames=1, overlap=True)
    a = model.generate(prompt, seed=3, max_new_tokens=11, streamer=inline)
    b = model.generate(prompt, seed=3, max_new_tokens=11, streamer=overlapped)
    assert torch.equal(a.sequences, b.sequences)
    assert [c.shape for c in overlapped.chunks] == [c.shape for c in inline.chunks] and len(inline.chunks) > 2
    assert all(torch.equal(x, y) for x, y in zip(overlapped.chunks, inline.chunks))
    assert [c.shape for c in overlapped] == [c.shape for c in inline.chunks]  # the iterator ends after the last


def test_overlapped_streaming_reraises_a_codec_error(model, prompt, monkeypatch):
    streamer = Drama3AudioStreamer(model.codec, chunk_frames=2, overlap=True)

    def broken(codes):
        raise RuntimeError("codec failed")

    monkeypatch.setattr(streamer.decoder, "decode", broken)
    with pytest.raises(RuntimeError, match="codec failed"):
        model.generate(prompt, seed=3, max_new_tokens=6, streamer=streamer)
    assert list(streamer) == []  # a consumer still sees the end of the stream


def test_streaming_generate_reads_each_frame_back_once(model, prompt):
    """With an audio streamer, each frame's codes, its end flags and its count are read to the host in one read (the
    streamer and the retirement of ended sequences use that read): six more frames, six more reads."""
    def reads(frames: int) -> int:
        streamer = Drama3AudioStreamer(model.codec, chunk_frames=64, first_chunk_frames=64, overlap=False)
        run = lambda: model.generate(prompt, seed=3, max_new_tokens=frames, streamer=streamer, output_audio=False)
        return device_reads(run)

    assert reads(11) - reads(5) == 11 - 5  # both runs end at their limit (seed 3 makes 11 frames before any EOS)
