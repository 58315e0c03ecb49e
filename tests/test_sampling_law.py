"""`generate`'s sampled draws against their law, computed independently from `forward`'s logits.

One `generate` call runs `SAMPLES` copies of one short prompt, each with its own seed, for one frame. The law of that
frame is known exactly from the teacher-forced `forward` (docs/format.md, "Sampling"), recomputed here in float64
by a plain transcription of the rules (`draw_rule`), not by the package's samplers:

- the main token: the draw rule with (temperature, top_k, top_p), and the repetition-aware redraw: if the first draw
  is a semantic token among the main ids of the last `ras_window` rows, draw again with the `ras_*` settings. The
  prompt ends with `ras_window` audio rows (a reference filling the window) whose tokens carry much of the first
  draw's mass, so the redraw changes the law a lot;
- code 1 given the main token: the draw rule with the `codebook_*` settings (crossing token dropped) on the tower's
  head-0 logits of `forward` over the prompt plus a row with that c0.

Each sample is independent (its own generator), so the counts are multinomial and the law tests are Pearson's
chi-square goodness of fit, cells with an expected count below 5 pooled (Cochran's rule, under which the chi-square
law of the statistic is accurate). A test fails when the p-value is below `ALPHA = 1e-6`: a correct sampler fails one
run in a million. A draw in a cell of probability 0 fails at once. The independence test bounds a martingale with
Freedman's inequality at the same `ALPHA`.

Each test was checked red against three one-line bugs: temperature dropped from the logits drawn from (main law
p = 7e-24, joint law p = 1e-10), the RAS window's candidate columns one low (p = 2e-252), every codebook drawing from
the main token's uniforms (an excess of 723 coincidences against a bound of 79).

The laws come from float32 logits, which `generate`'s step computes in another order than `forward`: rounding could
only matter where a top-p or top-k decision sits on its boundary, so the tests check first that every decision is at
least `MARGIN` from flipping. Rounding errors grow like sqrt(n) * u (tests/tolerances.py): with about 3e4 terms on
the path from the embedding to a head that is about 1e-5 of the logit scale, and `MARGIN` is 100 times that.
"""

import math
from types import SimpleNamespace

import pytest
import torch

from tests.conftest import GOLDEN_TINY
from tests.stored_step_support import store_with_inline_compiles
from transformers_drama3 import FishOmniForSpeech
from transformers_drama3.cpu_path import resolve_cpu_path
from transformers_drama3.generation.stored_steps import MAX_SLOTS

SAMPLES = 512
ALPHA = 1e-6
MARGIN = 1e-3  # distance of every top-p decision from its threshold: float32 logits cannot flip one
MIN_EXPECTED = 5.0
SETTINGS = {
    "do_sample": True, "temperature": 0.5, "top_k": 20, "top_p": 0.9,
    "ras_window": 4, "ras_temperature": 2.0, "ras_top_k": 12, "ras_top_p": 0.97,
    "codebook_temperature": 0.8, "codebook_top_k": 25, "codebook_top_p": 0.8,
}
# The prompt: one text row, then four audio rows (c0..c9); their c0 tokens hold most of the first draw's mass.
TEXT_ID = 5
REFERENCE_CODES = torch.randint(0, 64, (4, 10), generator=torch.Generator().manual_seed(177))


def draw_rule(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, keep_crossing: bool):
    """docs/format.md, "The draw rule", in float64 with a Python loop: softmax of `logits / temperature`, walk the
    candidates by decreasing probability, keep rank 0, stop at rank `top_k` or when the mass so far reaches `top_p`
    (`keep_crossing`: the token that crosses it stays; else a token whose inclusion would pass it is dropped),
    renormalise. Returns the law `[C]` and the smallest distance of a decision from flipping (a top-p decision's from
    its threshold, a binding top-k's relative gap between the last kept and the first dropped probability)."""
    probs = (logits.double() / temperature).softmax(-1)
    ranked = sorted(range(probs.numel()), key=lambda i: -probs[i].item())
    kept, mass, margin = [ranked[0]], probs[ranked[0]].item(), float("inf")
    for rank, index in enumerate(ranked[1:], start=1):
        if rank >= top_k:  # a near tie at the top-k boundary would be as fragile as one at top-p's
            margin = min(margin, 1 - probs[index].item() / probs[ranked[rank - 1]].item())
            break
        crossing = mass if keep_crossing else mass + probs[index].item()
        margin = min(margin, abs(crossing - top_p))
        if (crossing >= top_p) if keep_crossing else (crossing > top_p):
            break
        kept.append(index)
        mass += probs[index].item()
    law = torch.zeros_like(probs)
    law[kept] = probs[kept] / mass
    return law, margin


def chi_square_p_value(counts: torch.Tensor, expected: torch.Tensor) -> float:
    """Pearson's goodness-of-fit p-value of `counts` against `expected` counts (same shape, same total); cells with
    an expected count below `MIN_EXPECTED` are pooled into one (itself merged into the smallest other cell if it
    stays below). A count in a cell of expected 0 gives 0."""
    counts, expected = counts.flatten().double(), expected.flatten().double()
    if (counts[expected == 0] > 0).any():
        return 0.0
    small = expected < MIN_EXPECTED
    cells_counts, cells_expected = list(counts[~small]), list(expected[~small])
    pooled_count, pooled_expected = counts[small].sum(), expected[small].sum()
    if pooled_expected >= MIN_EXPECTED:
        cells_counts.append(pooled_count)
        cells_expected.append(pooled_expected)
    elif pooled_expected > 0:
        smallest = min(range(len(cells_expected)), key=lambda i: cells_expected[i])
        cells_counts[smallest] += pooled_count
        cells_expected[smallest] += pooled_expected
    observed, wanted = torch.stack(cells_counts), torch.stack(cells_expected)
    statistic = ((observed - wanted) ** 2 / wanted).sum()
    dof = len(cells_counts) - 1
    return torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), statistic / 2).item()


@pytest.fixture(scope="module", params=["float32", "cpu path", "stored step"])
def golden_model(request, tmp_path_factory):
    """The golden tiny model in float32 (the suite's fixture), then on the CPU path a plain load takes on this CPU
    (float16 weights, cpu_path.py), run eagerly and by its stored compiled step (generation/stored_steps.py: compiled
    by a first call, before `samples` draws with it): the laws are computed from each model's own `forward`."""
    if request.param == "float32":
        yield request.getfixturevalue("golden_model")
        return
    model = FishOmniForSpeech.from_pretrained(GOLDEN_TINY, cpu_path=resolve_cpu_path("auto"))
    if request.param == "cpu path":
        yield model
        return
    with store_with_inline_compiles(tmp_path_factory.mktemp("steps")) as store:
        model.generate(law_prompt(model).expand(MAX_SLOTS, -1, -1), max_new_tokens=1, output_audio=False, **SETTINGS)
        yield model
        assert store.used, "the stored step never ran"


def law_prompt(model) -> torch.Tensor:
    """The prompt `[1, 5, 11]`: one text row, then the reference's four audio rows."""
    start = model.config.semantic_start_token_id
    rows = torch.zeros(1 + len(REFERENCE_CODES), 11, dtype=torch.long)
    rows[0, 0] = TEXT_ID
    rows[1:, 0], rows[1:, 1:] = start + REFERENCE_CODES[:, 0], REFERENCE_CODES
    return rows[None]


@pytest.fixture(scope="module")
def prompt(golden_model):
    return law_prompt(golden_model)  # [1, 5, 11]


@pytest.fixture(scope="module")
def main_law(golden_model, prompt):
    """The law `[V + 1]` of the first frame's main token (column 0 EOS, column 1 + c `<|semantic:c|>`), from
    `forward` alone; and the first draw's mass on the window's tokens and on the tokens one below them."""
    model = golden_model
    with torch.no_grad():
        logits = model(prompt).main_logits[0, -1]  # [V + 1]
    first, margin_1 = draw_rule(logits, SETTINGS["temperature"], SETTINGS["top_k"], SETTINGS["top_p"], True)
    second, margin_2 = draw_rule(logits, SETTINGS["ras_temperature"], SETTINGS["ras_top_k"], SETTINGS["ras_top_p"], True)
    assert min(margin_1, margin_2) > MARGIN
    candidates = model.main_candidate_ids().tolist()
    window = prompt[0, -SETTINGS["ras_window"] :, 0].tolist()
    repeated = torch.zeros_like(first, dtype=torch.bool)  # semantic tokens among the window's main ids
    for token in window:
        if token != model.config.eos_token_id and token in candidates:
            repeated[candidates.index(token)] = True
    law = first * ~repeated + (first * repeated).sum() * second
    below = torch.roll(repeated, -1)
    below[0] = False
    return law, (first * repeated).sum().item(), (first * below).sum().item()


@pytest.fixture(scope="module")
def samples(golden_model, prompt):
    """`SAMPLES` first frames, one seed each, from `generate` calls of `MAX_SLOTS` sequences (the most a stored step
    runs; one seed per sequence makes each draw independent of the batch it is in): main candidate column `[N]` (0:
    EOS), code 1 `[N]` (-1 after EOS) and the frame rows `[N, 11]`."""
    codes, rows = [], []
    for first in range(0, SAMPLES, MAX_SLOTS):
        out = golden_model.generate(prompt.expand(MAX_SLOTS, -1, -1), seed=list(range(first, first + MAX_SLOTS)),
                                    max_new_tokens=1, output_audio=False, **SETTINGS)
        codes += out.codes
        rows.append(out.sequences[:, prompt.shape[1]])
    column = torch.tensor([1 + int(frame[0, 0]) if frame.shape[1] else 0 for frame in codes])
    code_1 = torch.tensor([int(frame[1, 0]) if frame.shape[1] else -1 for frame in codes])
    return column, code_1, torch.cat(rows)


def codebook_laws(model, prompt, columns: list[int]) -> dict[int, torch.Tensor]:
    """Law `[V]` of code 1 given each main column in `columns` (>= 1), from `forward` over the prompt and a row with
    that c0 (the later codes of the row do not reach head 0: the tower is causal over codebooks)."""
    start, limit = model.config.semantic_start_token_id, min(SETTINGS["codebook_top_k"], 30)
    rows = torch.cat([prompt] * len(columns))
    new = torch.zeros(len(columns), 1, 11, dtype=torch.long)
    for index, column in enumerate(columns):
        new[index, 0, 0], new[index, 0, 1] = start + column - 1, column - 1
    with torch.no_grad():
        head_logits = model(torch.cat((rows, new), dim=1)).codebook_logits[:, -1, 0]  # [n, V]
    laws = {}
    for index, column in enumerate(columns):
        laws[column], margin = draw_rule(head_logits[index], SETTINGS["codebook_temperature"], limit,
                                         SETTINGS["codebook_top_p"], False)
        assert margin > MARGIN
    return laws


def test_the_first_main_token_follows_the_law_from_forward(main_law, samples):
    """Temperature, top-k, top-p and the repetition-aware redraw with a reference filling the window."""
    law, window_mass, below_mass = main_law
    # What gives the test its power: the redraw moves much mass, and a window one column off would move other mass.
    assert window_mass > 0.5 and abs(window_mass - below_mass) > 0.3
    column = samples[0]
    counts = torch.bincount(column, minlength=law.numel())
    assert chi_square_p_value(counts, SAMPLES * law) > ALPHA


def test_code_1_follows_its_law_given_the_main_token(golden_model, prompt, main_law, samples):
    """The joint law of (main token, code 1) is law(main) x law(code 1 | main): Pearson's test over the joint cells
    catches a wrong codebook rule and a code 1 that depends on more than the main token's value."""
    law, _, _ = main_law
    column, code_1 = samples[:2]
    drawable = [c for c in range(1, law.numel()) if law[c] > 0]
    laws = codebook_laws(golden_model, prompt, drawable)
    vocab = golden_model.config.codebook_size
    joint = torch.zeros(law.numel(), vocab + 1, dtype=torch.float64)  # [V + 1, V + 1]: code 1 + 1 (0: after EOS)
    joint[0, 0] = law[0]
    for c in drawable:
        joint[c, 1:] = law[c] * laws[c]
    counts = torch.zeros_like(joint)
    counts.index_put_((column, code_1 + 1), torch.ones(SAMPLES, dtype=torch.float64), accumulate=True)
    assert chi_square_p_value(counts, SAMPLES * joint) > ALPHA


def test_codebook_draws_are_independent_of_the_main_tokens_and_of_each_others_noise(golden_model, prompt, samples):
    """Every draw of a frame is an exponential race over its own uniforms. Were two draws to share uniforms, the
    second would tend to pick the index that won the first (the index of the smallest exponential), so code j would
    equal the main column or an earlier code far more often than its law says.

    For each sample and codebook j = 1..NCB-1, the event "code j is the main column or one of codes 1..j-1" has,
    given the frame so far, the probability p that code j's law (the draw rule on `forward`'s teacher-forced head
    logits for that sample's row) gives to those indices. The sum of (event - p) over all draws is a martingale with
    increments in [-1, 1] and predictable variance v = sum p (1 - p); Freedman's inequality bounds it by
    a = L / 3 + sqrt((L / 3)^2 + 2 v L), L = ln(1 / ALPHA), except with probability ALPHA."""
    column, _, frames = samples
    made = column > 0
    rows = frames[made]  # [n, 11] the first frame's rows
    start, limit = golden_model.config.semantic_start_token_id, min(SETTINGS["codebook_top_k"], 30)
    with torch.no_grad():
        head_logits = golden_model(torch.cat((prompt.expand(len(rows), -1, -1), rows[:, None]), dim=1)).codebook_logits[:, -1]
    excess, variance = 0.0, 0.0
    for index, row in enumerate(rows.tolist()):
        earlier = {row[0] - start + 1}  # the main column, as an index into a draw's uniforms
        for j in range(1, golden_model.config.num_codebooks):
            code_law, margin = draw_rule(head_logits[index, j - 1], SETTINGS["codebook_temperature"], limit,
                                         SETTINGS["codebook_top_p"], False)
            if margin > MARGIN:  # (draws with a decision near its boundary are left out: chosen before the draw)
                p = code_law[[i for i in earlier if i < code_law.numel()]].sum().item()
                excess += (row[1 + j] in earlier) - p
                variance += p * (1 - p)
            earlier.add(row[1 + j])
    log_alpha = -math.log(ALPHA)
    bound = log_alpha / 3 + math.sqrt((log_alpha / 3) ** 2 + 2 * variance * log_alpha)
    assert excess <= bound, f"draws equal earlier indices {excess:.0f} times more than their law says (bound {bound:.0f})"


# One `FrameSampler` over blocks of rows with different settings: the greedy block, RAS windows 3, 0 and 5, top-k
# with and without a limit, crossing kept (main) and dropped (codebook).
MIXED_SETTINGS = [
    dict(do_sample=False),
    dict(temperature=0.8, top_p=0.9, top_k=0, ras_window=3, ras_temperature=2.0, ras_top_k=6, ras_top_p=0.97,
         codebook_temperature=1.5, codebook_top_k=8, codebook_top_p=0.9),
    dict(temperature=1.5, top_p=1.0, top_k=6, ras_window=0, ras_temperature=1.0, ras_top_k=30, ras_top_p=0.95,
         codebook_temperature=0.7, codebook_top_k=0, codebook_top_p=0.95),
    dict(temperature=1.0, top_p=0.7, top_k=0, ras_window=5, ras_temperature=0.6, ras_top_k=3, ras_top_p=0.9,
         codebook_temperature=1.0, codebook_top_k=30, codebook_top_p=0.8),
]
MIXED_SAMPLES = 4000  # rows per block
MIXED_CANDIDATES = 25  # V + 1


def test_a_batch_with_different_settings_per_row_draws_each_row_from_its_own_law():
    """Each block of rows of one mixed `FrameSampler` (one draw per row, one frame's noise) follows the law of its own
    settings: main tokens the draw rule with the RAS redraw, codes the codebook rule, both recomputed in float64 by
    `draw_rule` (the rule with one setting for all rows gives each row the same kept set and
    law bit for bit: tests/test_frame_sampler.py). Pearson's test per sampled block and kind at `ALPHA`: six tests, so
    a correct sampler fails fewer than 6e-6 of runs; the greedy block takes the argmax."""
    from transformers_drama3.generation.rules import Drama3FrameSampling
    from transformers_drama3.generation.sampling import FrameSampler

    generator = torch.Generator().manual_seed(31)
    blocks, n = len(MIXED_SETTINGS), MIXED_SAMPLES
    logits = 1.5 * torch.randn(blocks, MIXED_CANDIDATES, generator=generator)  # [blocks, V + 1] one per block
    heads = 1.5 * torch.randn(blocks, MIXED_CANDIDATES - 1, generator=generator)  # [blocks, V]
    likely = logits.argsort(dim=-1, descending=True)[:, :3]
    history = torch.cat((likely, torch.tensor([[-1, 0]]).expand(blocks, -1)), dim=1)  # [blocks, 5]
    history = history[:, [3, 1, 4, 2, 0]]  # text, 2nd, EOS, 3rd, 1st: a window of 3 holds EOS, 3rd, 1st
    sampler = FrameSampler(blocks * n, history.shape[1])
    for block, changes in enumerate(MIXED_SETTINGS):
        sampler.set_rows(torch.arange(block * n, (block + 1) * n), SimpleNamespace(**{"do_sample": True, **changes}))
    noise = torch.rand(blocks * n, 2, MIXED_CANDIDATES, generator=generator)
    rows = torch.arange(blocks).repeat_interleave(n)  # block of each row
    main = Drama3FrameSampling().main(logits[rows], history[rows], sampler, noise).view(blocks, n)
    codes = Drama3FrameSampling().codebook(heads[rows], 1, sampler, noise).view(blocks, n)
    assert (main[0] == logits[0].argmax()).all() and (codes[0] == heads[0].argmax()).all()
    for block, s in enumerate(MIXED_SETTINGS[1:], start=1):
        s = SimpleNamespace(**s)
        first, margin_1 = draw_rule(logits[block], s.temperature, s.top_k or MIXED_CANDIDATES, s.top_p, True)
        second, margin_2 = draw_rule(logits[block], s.ras_temperature, s.ras_top_k, s.ras_top_p, True)
        window = history[block, history.shape[1] - s.ras_window :].tolist() if s.ras_window else []
        repeated = torch.zeros_like(first, dtype=torch.bool)
        repeated[[column for column in window if column > 0]] = True  # semantic columns (EOS never redraws)
        law = first * ~repeated + (first * repeated).sum() * second
        code_law, margin_3 = draw_rule(heads[block], s.codebook_temperature, min(s.codebook_top_k or 30, 30),
                                       s.codebook_top_p, False)
        assert min(margin_1, margin_2, margin_3) > MARGIN
        assert (first * repeated).sum() > 0.2 or not s.ras_window  # the redraw moves mass where there is a window
        for drawn, expected in ((main[block], law), (codes[block], code_law)):
            counts = torch.bincount(drawn, minlength=expected.numel())
            assert chi_square_p_value(counts, n * expected) > ALPHA, block
