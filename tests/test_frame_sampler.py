"""Per-row sampling settings (`FrameSampler`): a batch whose rows have different settings gives each row what a batch
of one with that row's settings gives, on random logits and through the real frame step.

Equalities here are exact: a row's kept set, probabilities and draw are computed by the same row-wise operations
(sort, softmax, cumsum along the candidates) whatever the other rows hold, so a batch of one gives the same bits.
"""

from types import SimpleNamespace

import pytest
import torch

from transformers_drama3.generation.rules import Drama3FrameSampling, frame_criteria
from transformers_drama3.generation.runner import FrameRunner
from transformers_drama3.generation import DRAMA3_GENERATION_DEFAULTS, generation_settings
from transformers_drama3.generation.sampling import (
    CODEBOOK_TOP_K_CAP,
    FrameSampler,
    kept_logits,
    ras_log_probs,
)

from .conftest import left_padded
from .sampling_rules import ScalarRas, ScalarRule

NUM_CANDIDATES = 33  # V + 1 main-token candidates (column 0: EOS), V = 32 codes per head
NUM_CODEBOOKS = 3
HISTORY = 6  # the mixed sampler's RAS history width
RULE = Drama3FrameSampling()  # holds no settings: it draws from a FrameSampler's per-row tensors
# One row each: greedy, several temperatures / top-p / top-k, RAS windows 0, shorter than and longer than the history.
ROW_SETTINGS = [
    dict(do_sample=False, temperature=0),  # a greedy row's other settings may be anything
    dict(temperature=0.7, top_p=0.8, ras_window=4),
    dict(temperature=1.3, top_k=5, ras_window=0, codebook_temperature=0.5),
    dict(top_p=1.0, top_k=3, ras_window=6, ras_temperature=0.5, ras_top_k=2, ras_top_p=0.6, codebook_top_k=0,
         codebook_top_p=1.0),
    dict(temperature=0.3, top_p=0.95, ras_window=16, codebook_top_k=3, codebook_top_p=0.5),
]


def settings(**changes) -> SimpleNamespace:
    return SimpleNamespace(**{**DRAMA3_GENERATION_DEFAULTS, **changes})


def mixed_sampler(rows=ROW_SETTINGS, history=HISTORY) -> FrameSampler:
    sampler = FrameSampler(len(rows), history)
    for index, changes in enumerate(rows):
        sampler.set_rows(torch.tensor([index]), settings(**changes))
    return sampler


def single_sampler(changes: dict) -> tuple[FrameSampler, int]:
    """A batch of one with these settings, as `generate` alone builds it (history as long as the window)."""
    width = min(changes.get("ras_window", DRAMA3_GENERATION_DEFAULTS["ras_window"]), HISTORY)
    sampler = FrameSampler(1, width)
    sampler.set_rows(slice(None), settings(**changes))
    return sampler, width


@pytest.fixture(scope="module")
def inputs():
    """Main logits `[R, V + 1]`, head logits `[R, V]` and a history `[R, HISTORY]` that holds each row's likely
    columns (so RAS redraws), EOS and text (-1)."""
    generator = torch.Generator().manual_seed(23)
    rows = len(ROW_SETTINGS)
    logits = 2 * torch.randn(rows, NUM_CANDIDATES, generator=generator)
    heads = 2 * torch.randn(rows, NUM_CANDIDATES - 1, generator=generator)
    likely = logits.argsort(dim=-1, descending=True)[:, :4]  # [R, 4]
    # [R, 6]: 1st, 2nd, text, EOS, 3rd, 4th (a window of 4 leaves out the two most likely)
    history = torch.cat((likely[:, :2], torch.tensor([[-1, 0]]).expand(rows, -1), likely[:, 2:]), dim=1)
    return logits, heads, history


def test_each_rows_kept_set_and_law_are_those_of_the_scalar_rules(inputs):
    logits, heads, history = inputs
    sampler = mixed_sampler()
    main = kept_logits(logits, sampler.temperature, sampler.top_k, sampler.top_p, keep_crossing=True)
    ras = kept_logits(logits, sampler.ras_temperature, sampler.ras_top_k, sampler.ras_top_p, keep_crossing=True)
    law = ras_log_probs(history, sampler.ras_window, main, ras)
    codebook = kept_logits(heads, sampler.codebook_temperature, sampler.codebook_top_k, sampler.codebook_top_p,
                           keep_crossing=False)
    for row, changes in enumerate(ROW_SETTINGS[1:], start=1):
        s = settings(**changes)
        first = ScalarRule(s.temperature, s.top_k or None, s.top_p, keep_crossing=True)
        second = ScalarRule(s.ras_temperature, s.ras_top_k or None, s.ras_top_p, keep_crossing=True)
        window = min(s.ras_window, HISTORY)
        assert torch.equal(main[row], first(None, logits[row : row + 1])[0])
        recent = history[row : row + 1, HISTORY - window :]  # the window cut out (the sampler masks it in place)
        scalar = ScalarRas(first, second, window)(recent, logits[row : row + 1])
        assert torch.equal(law[row], scalar[0])
        head = ScalarRule(s.codebook_temperature, min(s.codebook_top_k or CODEBOOK_TOP_K_CAP, CODEBOOK_TOP_K_CAP),
                              s.codebook_top_p, keep_crossing=False)
        assert torch.equal(codebook[row], head(None, heads[row : row + 1])[0])
    # The settings reach the rule: the rows keep different numbers of candidates.
    assert len({int(torch.isfinite(main[row]).sum()) for row in range(1, len(ROW_SETTINGS))}) > 2


def test_each_rows_draws_are_those_of_a_batch_of_one_with_its_settings(inputs):
    logits, heads, history = inputs
    sampler = mixed_sampler()
    assert sampler.key == (True,) and sampler.sampled_rows == [False, True, True, True, True]
    singles = [single_sampler(changes) for changes in ROW_SETTINGS]
    generator = torch.Generator().manual_seed(5)
    differ = 0
    for _ in range(64):
        noise = torch.rand(len(ROW_SETTINGS), NUM_CODEBOOKS, NUM_CANDIDATES, generator=generator)
        main = RULE.main(logits, history, sampler, noise)  # [R]
        codes = RULE.codebook(heads, 2, sampler, noise)
        for row, (single, width) in enumerate(singles):
            window = history[row : row + 1, HISTORY - width :]
            assert main[row] == RULE.main(logits[row : row + 1], window, single, noise[row : row + 1])[0]
            assert codes[row] == RULE.codebook(heads[row : row + 1], 2, single, noise[row : row + 1])[0]
        assert main[0] == logits[0].argmax() and codes[0] == heads[0].argmax()  # the greedy row
        differ += int(main[1] != logits[1].argmax())
    assert differ > 0  # the sampled rows do draw


def test_a_greedy_sampler_is_a_plain_argmax_and_changing_settings_keeps_the_key_and_addresses(inputs):
    logits, heads, history = inputs
    sampler = FrameSampler(len(ROW_SETTINGS), HISTORY)
    assert sampler.key == (False,)
    assert torch.equal(RULE.main(logits, history, sampler, None), logits.argmax(-1))
    assert torch.equal(RULE.codebook(heads, 1, sampler, None), heads.argmax(-1))
    noise = torch.full((len(ROW_SETTINGS), NUM_CODEBOOKS, NUM_CANDIDATES), 0.5)
    sampler.fill_noise(noise, torch.Generator().manual_seed(0))
    assert (noise == 0.5).all()  # greedy: no noise drawn

    addresses = {name: getattr(sampler, name).data_ptr() for name in ("do_sample", "temperature", "ras_window")}
    sampler.set_rows(slice(1, 3), settings(temperature=0.4))
    key = sampler.key
    sampler.set_rows(torch.tensor([2, 4]), settings(temperature=1.7, top_k=None, ras_window=100))
    assert sampler.key == key == (True,)
    assert sampler.temperature.tolist() == pytest.approx([1.0, 0.4, 1.7, 1.0, 1.7])
    assert sampler.top_k.tolist() == [0, 0, 0, 0, 0] and sampler.ras_window.tolist() == [0, HISTORY, HISTORY, 0, HISTORY]
    assert sampler.codebook_top_k.tolist() == [0, 30, 30, 0, 30]
    assert {name: getattr(sampler, name).data_ptr() for name in addresses} == addresses
    sampler.set_rows(slice(None), settings(do_sample=False))
    assert sampler.key == (False,)


def test_copied_rows_draw_as_the_rows_they_copy(inputs):
    logits, heads, history = inputs
    sampler = mixed_sampler()
    order = torch.tensor([3, 0, 1])
    moved = FrameSampler(4, HISTORY)
    moved.copy_rows(sampler, order)
    assert moved.sampled_rows == [True, False, True, False]
    noise = torch.rand(len(ROW_SETTINGS), NUM_CODEBOOKS, NUM_CANDIDATES, generator=torch.Generator().manual_seed(2))
    expected = RULE.main(logits, history, sampler, noise)[order]
    padded = torch.cat((order, order[:1]))  # the fourth row keeps its (greedy) settings
    assert torch.equal(RULE.main(logits[padded], history[padded], moved, noise[padded])[:3], expected)
    narrow = FrameSampler(2, 2)  # a shorter history cuts the windows
    narrow.copy_rows(sampler, torch.tensor([4, 1]))
    assert narrow.ras_window.tolist() == [2, 2]


def test_noise_is_drawn_for_sampled_rows_from_their_own_generators():
    sampler = mixed_sampler()
    noise = torch.full((len(ROW_SETTINGS), NUM_CODEBOOKS, NUM_CANDIDATES), 2.0)
    generators = [torch.Generator().manual_seed(row) for row in range(len(ROW_SETTINGS))]
    generators[3] = None  # a padding row
    sampler.fill_noise(noise, generators)
    assert (noise[0] == 2.0).all() and (noise[3] == 2.0).all()  # the greedy row and the padding row are left
    for row in (1, 2, 4):
        assert torch.equal(noise[row], torch.rand(NUM_CODEBOOKS, NUM_CANDIDATES, generator=torch.Generator().manual_seed(row)))


def test_bad_sampler_sizes_and_rows_are_refused():
    with pytest.raises(ValueError, match="rows >= 1"):
        FrameSampler(0, 4)
    with pytest.raises(ValueError, match="history width >= 0"):
        FrameSampler(2, -1)
    sampler = FrameSampler(3, 4)
    for rows in (torch.tensor([True, False, True]), [0, 1], torch.tensor(1)):
        with pytest.raises(TypeError, match="1-D LongTensor"):
            sampler.set_rows(rows, settings())
    with pytest.raises(TypeError, match="1-D LongTensor"):
        sampler.copy_rows(mixed_sampler(), torch.tensor([0.0]))
    with pytest.raises(IndexError):
        sampler.set_rows(torch.tensor([3]), settings())
    assert sampler.key == (False,) and not sampler.do_sample.any()  # nothing was written


# ---------------------------------------------------------------------------------------------------------------
# Through the frame step
# ---------------------------------------------------------------------------------------------------------------

STEP_SETTINGS = [  # per sequence: greedy; sampled with a short RAS window; sampled with the default window of 16
    dict(do_sample=False),
    dict(temperature=0.7, top_p=0.8, ras_window=4, codebook_temperature=0.5),
    dict(top_k=5, codebook_top_p=0.95),
]
SEEDS = [3, 5, 9]
FRAMES = 8


@torch.no_grad()
def test_a_batch_with_settings_per_sequence_gives_each_its_frames_alone(golden_model, expected):
    """One frame state runs three sequences of one left-padded prefill with three settings (one sampler); each gets
    the frames that `generate` gives it alone with its settings and seed."""
    model = golden_model
    a = expected["prompt_a_rows"]
    prompts = [a, torch.cat((a[:1], a[4:])), torch.cat((a[:1], a[8:]))]
    batch, mask = left_padded(*prompts)
    checked = [generation_settings(model.generation_config, **changes) for changes in STEP_SETTINGS]
    prefill = model.prefill(batch, mask)
    runner = FrameRunner(model, RULE, frame_criteria(model, model.generation_config))  # eager
    generators = [torch.Generator().manual_seed(seed) for seed in SEEDS]
    runner.admit([0, 1, 2], prefill, batch, mask, checked, generators, [FRAMES] * 3)
    frames = [[] for _ in prompts]
    for step in range(FRAMES):
        runner.step()
        slots, keys = runner.taken()
        for slot, key in zip(slots, keys):
            if runner.state.made[slot]:
                frames[key].append(runner.state.new_rows[slot, 1:].clone())
    for index, (prompt, changes, seed) in enumerate(zip(prompts, STEP_SETTINGS, SEEDS)):
        alone = model.generate(prompt[None], seed=seed, max_new_tokens=FRAMES, output_audio=False, **changes)
        made = torch.stack(frames[index], dim=1) if frames[index] else alone.codes[0][:, :0]
        assert torch.equal(made, alone.codes[0]), index


@pytest.mark.parametrize("keep_crossing", [True, False])
def test_ordering_only_the_ranks_a_top_k_bound_allows_keeps_the_same_candidates(keep_crossing):
    """`rank_limit` (the codebooks' cap) orders the first ranks with `topk` instead of sorting all: the same kept set
    and scaled logits, row by row, for top-k values up to the limit and top-p values that cut before it or not."""
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 4096, generator=generator) * 3
    temperature = torch.tensor([1.0, 0.5, 2.0, 1.0, 0.8, 1e-6])
    top_k = torch.tensor([30, 1, 7, 30, 12, 30])
    top_p = torch.tensor([0.9, 0.9, 1.0, 0.05, 0.99, 0.9])
    full = kept_logits(logits, temperature, top_k, top_p, keep_crossing)
    limited = kept_logits(logits, temperature, top_k, top_p, keep_crossing, rank_limit=30)
    assert torch.equal(torch.isinf(full), torch.isinf(limited))
    assert torch.equal(full[~torch.isinf(full)], limited[~torch.isinf(limited)])
