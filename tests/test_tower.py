"""Tests of the codebook tower and its cache (docs/format.md, "The codebook tower"; `modeling_tower.py`).

Two kinds of tower:
- the golden tiny checkpoint's tower (weights read straight from the safetensors shards, upcast to float32),
  compared with the reference outputs in `fixtures/expected.safetensors`;
- small random towers (k = 0, 1, 2) run in float64, where cached, decoded, padded and plain passes must agree to
  the float64 rounding bound of `tolerances.py` (~1e-12 here): they compute the same math, so only float64 rounding
  separates them, while a leak of a padded or future row, a wrong position or a skipped cache row changes the
  logits by far more than 1e-3.
"""

import glob
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers.cache_utils import Cache

from transformers_drama3.configuration_drama3 import Drama3TowerConfig, FishOmniConfig
from transformers_drama3.modeling_tower import Drama3CodebookTower, Drama3TowerCache

from .tolerances import reordering_tolerance, tower_reductions

FIXTURES = Path(__file__).parent / "fixtures"
PREFIXES = {
    "audio_decoder.codebook_embeddings.": "codebook_embeddings.",
    "audio_decoder_mtp_shared.layers.": "shared_layers.",
    "audio_decoder_mtp.layers.": "residual_layers.",
    "audio_decoder_mtp.heads.": "heads.",
}
# Golden README, "tf_head_logits, tower fed the expected tf_hidden" and "tf_shared_out": >= 2x the float32 noise
# measured between two reference implementations on this fixture.
GOLDEN_TOL = {"atol": 5e-4, "rtol": 1e-4}
LONGEST_SEQUENCE = 12  # rows of the longest random sequence below


def exact_tol(reference: torch.Tensor, reductions: int | None = None) -> dict:
    """Random float64 towers: equal math in another order, so float64 rounding only (tolerances.py); by default
    the reductions of a pass through the whole tower over the longest sequence here."""
    if reductions is None:
        reductions = tower_reductions(tower_config(0), LONGEST_SEQUENCE)
    return reordering_tolerance(reference, reductions)

SEMANTIC_START = 100  # random towers: text ids 0..99, semantic band 100..131
TEXT_IDS = 100


# ---------------------------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def golden():
    """(tower, expected tensors) of the golden tiny checkpoint."""
    config = FishOmniConfig(**json.loads((FIXTURES / "tiny" / "config.json").read_text()))
    tower = Drama3CodebookTower(config.audio_decoder_config, config.semantic_start_token_id)
    state = {}
    for shard in sorted(glob.glob(str(FIXTURES / "tiny" / "*.safetensors"))):
        for name, tensor in load_file(shard).items():
            for old, new in PREFIXES.items():
                if name.startswith(old):
                    state[new + name[len(old) :]] = tensor.float()
    tower.load_state_dict(state, strict=True)
    return tower.eval(), load_file(str(FIXTURES / "expected.safetensors"))


def tower_config(k: int, shared: int = 2) -> Drama3TowerConfig:
    """A small tower: D 64, 4 query / 2 kv heads of 16 (RoPE on 4 dims), V 32, NCB 10, `shared` shared layers."""
    placement = "mtp_shared_pre" if k == 0 else "backbone_partial"
    return Drama3TowerConfig(
        dim=64, text_dim=64, n_head=4, n_local_heads=2, head_dim=16, intermediate_size=96, vocab_size=32,
        shared_enrichment_layers=shared, n_layer=shared, vq_feature_placement=placement, vq_backbone_codebooks=k,
    )


def random_tower(k: int = 1, seed: int = 0) -> Drama3CodebookTower:
    """A float64 tower with random weights; norm weights random too (std 0.15) so the `1 +` gain matters."""
    torch.manual_seed(seed)
    tower = Drama3CodebookTower(tower_config(k), SEMANTIC_START)
    with torch.no_grad():
        for name, param in tower.named_parameters():
            if name.endswith("norm.weight"):
                param.normal_(0.0, 0.15)
    return tower.double().eval()


def random_frames(rows: int, config: Drama3TowerConfig, seed: int) -> torch.Tensor:
    """Frame rows `[rows, 1 + NCB]`: about 2/3 audio rows `[start + c0, c0..]`, the rest text rows `[id, 0, ...]`."""
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, config.vocab_size, (rows, config.num_codebooks), generator=gen)
    audio = torch.rand(rows, generator=gen) < 0.67
    main = torch.where(audio, SEMANTIC_START + codes[:, 0], torch.randint(0, TEXT_IDS, (rows,), generator=gen))
    return torch.cat((main[:, None], codes * audio[:, None]), dim=1)


def random_sequence(tower: Drama3CodebookTower, rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Frames `[rows + 1, 1 + NCB]` and hidden states `[rows, D]` (float64) of one random sequence."""
    frames = random_frames(rows + 1, tower.config, seed)
    hidden = torch.randn(rows, tower.config.dim, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return frames, hidden


def teacher_forced(tower, frames, hidden, **kwargs):
    """Tower over rows 0..T-1 of one or more sequences `frames [.., T + 1, 11]`, `hidden [.., T, D]`."""
    if frames.dim() == 2:
        frames, hidden = frames[None], hidden[None]
    with torch.no_grad():
        return tower(hidden, frames[:, :-1], frames[:, 1:], **kwargs)


def label_sampler(labels: torch.Tensor, seen: list):
    """A "sampler" returning the known codes `labels [B, NCB]`, recording what it was called with."""

    def sample(logits: torch.Tensor, codebook: int) -> torch.Tensor:
        seen.append((logits.dtype, tuple(logits.shape), codebook))
        return labels[:, 1 + codebook]

    return sample


def decode_rows(tower, frames, hidden, start, cache, attention_mask=None, position_ids=None):
    """decode_frame for rows start..T-1 (labels = next rows) after a prefill of rows 0..start-1.

    frames `[B, T + 1, 11]`, hidden `[B, T, D]`; `attention_mask` `[B, T]` and `position_ids` `[B, T]` cover all
    rows. Returns the head logits `[B, T - start, NCB-1, V]` and the codes `[B, T - start, NCB]`.
    """
    logits, codes = [], []
    for t in range(start, hidden.shape[1]):
        labels = frames[:, t + 1]
        mask = None if attention_mask is None else attention_mask[:, : t + 1]
        positions = torch.full((frames.shape[0],), t) if position_ids is None else position_ids[:, t]
        with torch.no_grad():
            frame_codes, frame_logits = tower.decode_frame(
                hidden[:, t], frames[:, t], labels[:, 0], positions, mask, cache, label_sampler(labels, [])
            )
        logits.append(frame_logits)
        codes.append(frame_codes)
    return torch.stack(logits, dim=1), torch.stack(codes, dim=1)


def left_pad(sequences: list[tuple[torch.Tensor, torch.Tensor]]):
    """Left-pad (frames, hidden) pairs with random garbage rows; returns frames, hidden, mask, positions."""
    rows = max(h.shape[0] for _, h in sequences)
    batch_frames, batch_hidden, masks = [], [], []
    for index, (frames, hidden) in enumerate(sequences):
        pad = rows - hidden.shape[0]
        junk_frames, junk_hidden = random_frames(pad, TOWER_CONFIG, 1000 + index), torch.randn(pad, hidden.shape[1])
        batch_frames.append(torch.cat((junk_frames, frames)))
        batch_hidden.append(torch.cat((junk_hidden.double(), hidden)))
        masks.append(torch.cat((torch.zeros(pad, dtype=torch.long), torch.ones(hidden.shape[0], dtype=torch.long))))
    mask = torch.stack(masks)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    return torch.stack(batch_frames), torch.stack(batch_hidden), mask, positions


TOWER_CONFIG = tower_config(1)


# ---------------------------------------------------------------------------------------------------------------
# Golden checkpoint
# ---------------------------------------------------------------------------------------------------------------


def test_golden_teacher_forced(golden):
    tower, expected = golden
    out = teacher_forced(tower, expected["tf_rows"], expected["tf_hidden"][:-1])
    torch.testing.assert_close(out.logits[0], expected["tf_head_logits"], **GOLDEN_TOL)
    torch.testing.assert_close(out.shared_hidden[0], expected["tf_shared_out"], **GOLDEN_TOL)
    assert out.cache is None


def test_golden_prefill_then_decode_frames(golden):
    """Cached prefill of rows 0..139, then decode_frame (labels as the "sampler") for rows 140..148.

    Covers a text label (row 143 = `<|voice|>`) and the six audio labels; matches the golden teacher forcing.
    """
    tower, expected = golden
    frames, hidden = expected["tf_rows"][None], expected["tf_hidden"][None, :-1]
    cache = Drama3TowerCache(tower.config, max_length=4096)
    prefill = teacher_forced(tower, frames[:, :141], hidden[:, :140], cache=cache)
    assert prefill.cache is cache and cache.get_seq_length() == 140
    logits, codes = decode_rows(tower, frames, hidden, 140, cache)
    torch.testing.assert_close(logits[0], expected["tf_head_logits"][140:], **GOLDEN_TOL)
    labels = frames[0, 141:, 1:]
    audio = tower.is_audio(frames[0, 141:, 0])
    assert torch.equal(codes[0][audio], labels[audio])
    assert cache.get_seq_length() == 149


# ---------------------------------------------------------------------------------------------------------------
# Random towers: cached / decoded / padded == plain teacher forcing
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("k", [0, 1, 2])
def test_cached_incremental_equals_full(k):
    tower = random_tower(k)
    frames, hidden = random_sequence(tower, 12, seed=k)
    full = teacher_forced(tower, frames, hidden)
    cache = Drama3TowerCache(tower.config, max_length=64)
    parts = [teacher_forced(tower, frames[:6], hidden[:5], cache=cache)]
    for t in range(5, 12):  # one row at a time through forward
        parts.append(teacher_forced(tower, frames[t : t + 2], hidden[t : t + 1], cache=cache,
                                    position_ids=torch.tensor([[t]])))
    torch.testing.assert_close(torch.cat([p.logits for p in parts], 1), full.logits, **exact_tol(full.logits))
    torch.testing.assert_close(torch.cat([p.shared_hidden for p in parts], 1), full.shared_hidden,
                               **exact_tol(full.shared_hidden))
    assert cache.get_seq_length() == 12


@pytest.mark.parametrize("k", [0, 1, 2])
def test_decode_frame_equals_teacher_forcing(k):
    tower = random_tower(k)
    frames, hidden = random_sequence(tower, 12, seed=10 + k)
    frames[-4:, 0] = 50  # the last labels are a text row / EOS: embeddings zeroed, tower still runs
    frames[-4:, 1:] = 0
    full = teacher_forced(tower, frames, hidden)
    cache = Drama3TowerCache(tower.config, max_length=64)
    teacher_forced(tower, frames[:5], hidden[:4], cache=cache)
    logits, codes = decode_rows(tower, frames[None], hidden[None], 4, cache)
    torch.testing.assert_close(logits, full.logits[:, 4:], **exact_tol(full.logits[:, 4:]))
    assert torch.equal(codes[0, :, 1:], frames[5:, 2:])  # c1..c9 come from the sampler
    assert torch.equal(codes[0, :, 0], (frames[5:, 0] - SEMANTIC_START).clamp(0, 31))  # c0 from the main token


def test_decode_frame_calls_sampler_per_codebook():
    tower = random_tower()
    frames, hidden = random_sequence(tower, 3, seed=3)
    cache = Drama3TowerCache(tower.config, max_length=16)
    teacher_forced(tower, frames[:3], hidden[:2], cache=cache)
    seen = []
    with torch.no_grad():
        tower.decode_frame(hidden[None, 2], frames[None, 2], frames[None, 3, 0], torch.tensor([2]), None, cache,
                           label_sampler(frames[None, 3], seen))
    assert seen == [(torch.float32, (1, 32), j) for j in range(1, 10)]


def test_left_padded_batch_equals_each_alone():
    tower = random_tower()
    long_seq, short_seq = random_sequence(tower, 12, seed=20), random_sequence(tower, 7, seed=21)
    frames, hidden, mask, positions = left_pad([long_seq, short_seq])
    # prefill 9 padded rows (the short sequence has 4 real ones), then decode the last 3 rows
    cache = Drama3TowerCache(tower.config, max_length=64, chunk_size=4)
    prefill = teacher_forced(tower, frames[:, :10], hidden[:, :9], cache=cache, attention_mask=mask[:, :9],
                             position_ids=positions[:, :9])
    decoded, _ = decode_rows(tower, frames, hidden, 9, cache, attention_mask=mask, position_ids=positions)
    for index, (seq_frames, seq_hidden) in enumerate([long_seq, short_seq]):
        alone = teacher_forced(tower, seq_frames, seq_hidden).logits[0]
        rows = seq_hidden.shape[0]
        batched = torch.cat((prefill.logits[index], decoded[index]))[-rows:]
        torch.testing.assert_close(batched, alone, **exact_tol(alone))


# ---------------------------------------------------------------------------------------------------------------
# Cache
# ---------------------------------------------------------------------------------------------------------------


def test_cache_is_a_transformers_cache_with_one_layer_per_tower_layer():
    tower = random_tower()
    cache = Drama3TowerCache(tower.config, max_length=100)
    assert isinstance(cache, Cache)
    assert len(cache.layers) == tower.num_layers == 2 + 9
    assert cache.get_seq_length() == 0 and cache.get_max_length() == 100


def test_cache_grows_in_chunks_up_to_max_length():
    tower = random_tower()
    frames, hidden = random_sequence(tower, 10, seed=30)
    full = teacher_forced(tower, frames, hidden)
    cache = Drama3TowerCache(tower.config, max_length=10, chunk_size=4)
    parts, capacities = [], []
    for start, stop in [(0, 3), (3, 5), (5, 9), (9, 10)]:
        parts.append(teacher_forced(tower, frames[start : stop + 1], hidden[start:stop], cache=cache,
                                    position_ids=torch.arange(start, stop)[None]).logits)
        capacities.append(cache.layers[0].keys.shape[2])
    assert capacities == [4, 8, 10, 10]  # chunk multiples, capped at max_length
    torch.testing.assert_close(torch.cat(parts, 1), full.logits, **exact_tol(full.logits))


def test_cache_past_max_length_is_a_clear_error():
    tower = random_tower()
    frames, hidden = random_sequence(tower, 12, seed=40)
    cache = Drama3TowerCache(tower.config, max_length=10, chunk_size=4)
    teacher_forced(tower, frames[:9], hidden[:8], cache=cache)
    with pytest.raises(ValueError, match="max_length = 10"):
        teacher_forced(tower, frames[8:12], hidden[8:11], cache=cache, position_ids=torch.tensor([[8, 9, 10]]))
    assert cache.get_seq_length() == 8  # nothing was written
    teacher_forced(tower, frames[8:11], hidden[8:10], cache=cache, position_ids=torch.tensor([[8, 9]]))
    with pytest.raises(ValueError, match="max_length = 10"):
        decode_rows(tower, frames[None], hidden[None], 10, cache)


def test_cache_reset_reuse_gives_identical_results():
    tower = random_tower()
    frames, hidden = random_sequence(tower, 8, seed=50)
    cache = Drama3TowerCache(tower.config, max_length=32, chunk_size=4)

    def run():
        prefill = teacher_forced(tower, frames[:6], hidden[:5], cache=cache).logits
        return torch.cat((prefill, decode_rows(tower, frames[None], hidden[None], 5, cache)[0]), 1)

    first = run()
    cache.reset()
    assert cache.get_seq_length() == 0
    assert torch.equal(run(), first)
    cache.reset()  # a reset cache also takes another batch size
    teacher_forced(tower, frames[:6].expand(3, -1, -1), hidden[:5].expand(3, -1, -1), cache=cache)
    assert cache.layers[0].keys.shape[0] == 3


def test_cache_select_and_reorder_batch_entries():
    tower = random_tower()
    seqs = [random_sequence(tower, 8, seed=60), random_sequence(tower, 8, seed=61)]
    frames, hidden = torch.stack([f for f, _ in seqs]), torch.stack([h for _, h in seqs])
    alone = [teacher_forced(tower, f, h).logits[0] for f, h in seqs]

    cache = Drama3TowerCache(tower.config, max_length=32)
    teacher_forced(tower, frames[:, :6], hidden[:, :5], cache=cache)
    cache.reorder_cache(torch.tensor([1, 0]))
    swapped, _ = decode_rows(tower, frames.flip(0), hidden.flip(0), 5, cache)
    torch.testing.assert_close(swapped[0], alone[1][5:], **exact_tol(alone[1][5:]))
    torch.testing.assert_close(swapped[1], alone[0][5:], **exact_tol(alone[0][5:]))

    cache = Drama3TowerCache(tower.config, max_length=32)
    teacher_forced(tower, frames[:, :6], hidden[:, :5], cache=cache)
    cache.batch_select_indices(torch.tensor([1]))
    selected, _ = decode_rows(tower, frames[1:], hidden[1:], 5, cache)
    torch.testing.assert_close(selected[0], alone[1][5:], **exact_tol(alone[1][5:]))


def test_cache_with_another_batch_size_is_a_clear_error():
    tower = random_tower()
    frames, hidden = random_sequence(tower, 6, seed=70)
    cache = Drama3TowerCache(tower.config, max_length=32)
    teacher_forced(tower, frames[:4].expand(2, -1, -1), hidden[:3].expand(2, -1, -1), cache=cache)
    with pytest.raises(ValueError, match="holds 2 sequence"):
        teacher_forced(tower, frames[3:5].expand(3, -1, -1), hidden[3:4].expand(3, -1, -1), cache=cache)
    assert cache.get_seq_length() == 3


def test_cache_from_another_tower_is_rejected():
    tower = random_tower()
    other = tower_config(1, shared=1)
    frames, hidden = random_sequence(tower, 3, seed=80)
    with pytest.raises(ValueError, match="Drama3TowerCache with 11 layers"):
        teacher_forced(tower, frames, hidden, cache=Drama3TowerCache(other, max_length=8))


# ---------------------------------------------------------------------------------------------------------------
# Inputs, clamping, gradients
# ---------------------------------------------------------------------------------------------------------------


def test_codes_out_of_range_are_clamped():
    tower = random_tower(k=2)
    frames, hidden = random_sequence(tower, 6, seed=90)
    wild = frames.clone()
    wild[:, 2::2] += 1000  # above V - 1 on every other codebook
    wild[:, 3::2] -= 1000  # below 0 on the others
    clamped = frames.clone()
    clamped[:, 2::2] = 31
    clamped[:, 3::2] = 0
    expected = teacher_forced(tower, clamped, hidden).logits
    torch.testing.assert_close(teacher_forced(tower, wild, hidden).logits, expected, **exact_tol(expected))
    assert torch.equal(tower.embed_codes(wild, range(0, 10)), tower.embed_codes(clamped, range(0, 10)))


def test_embed_codes_sums_the_chosen_codebooks():
    tower = random_tower()
    frames = random_frames(4, tower.config, seed=100)
    table = tower.codebook_embeddings.weight  # codebook i: rows i * V + code, V = 32
    expected = table[32 + frames[:, 2]] + table[64 + frames[:, 3]] + table[96 + frames[:, 4]]
    torch.testing.assert_close(tower.embed_codes(frames, range(1, 4)), expected, **exact_tol(expected, reductions=3))
    assert torch.equal(tower.embed_codes(frames, range(3, 3)), torch.zeros(4, 64, dtype=torch.float64))


def test_bad_inputs_are_clear_errors():
    tower = random_tower()
    frames, hidden = random_sequence(tower, 4, seed=110)
    with pytest.raises(ValueError, match="last dimension 11"):
        tower(hidden[None], frames[None, :-1, :10], frames[None, 1:])
    with pytest.raises(ValueError, match="share \\[batch, rows\\]"):
        tower(hidden[None, :3], frames[None, :-1], frames[None, 1:])
    with pytest.raises(ValueError, match="attention_mask must be"):
        teacher_forced(tower, frames, hidden, attention_mask=torch.ones(1, 3))
    with pytest.raises(ValueError, match="max_length"):
        Drama3TowerCache(tower.config, max_length=0)


def test_gradients_flow_through_teacher_forcing():
    tower = random_tower().float().train()
    frames, hidden = random_sequence(tower, 10, seed=120)
    hidden = hidden.float().requires_grad_()
    targets = frames[1:, 2:]  # codebooks 1..9 of the label frames

    def loss():
        logits = tower(hidden[None], frames[None, :-1], frames[None, 1:]).logits[0]  # [T, 9, V]
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())

    before = loss()
    before.backward()
    for name, param in tower.named_parameters():
        assert param.grad is not None and torch.isfinite(param.grad).all(), name
        assert param.grad.abs().sum() > 0, name
    assert hidden.grad.abs().sum() > 0
    torch.optim.SGD(tower.parameters(), lr=0.05).step()
    assert loss().item() < before.item()
