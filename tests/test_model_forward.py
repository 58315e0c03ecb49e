"""FishOmniForSpeech: backbone input embedding, teacher-forced forward, caches, batching, loss, golden values.

Tolerances are the golden README's (atol/rtol chosen at 2x the float32 noise between two independent references);
self-consistency checks (cached vs full, batched vs single, another experts kernel, the loss against its formula)
run the same math in another order, so they differ by float32 rounding only: their tolerance is the rounding bound
of `tolerances.py` for the reductions on the path to the compared values, far below the O(0.1-1) change of any
wrong formula.
"""

import pytest
import torch

from transformers_drama3 import FishOmniForSpeech
from transformers_drama3.quantization_bsgemm import BsgemmMoeConfig
from transformers_drama3.testing import write_tiny_checkpoint

from .conftest import GOLDEN_TINY
from .tolerances import codebook_logit_reductions, main_logit_reductions, reordering_tolerance


def _load(path, **kwargs):
    model = FishOmniForSpeech.from_pretrained(path, dtype=torch.float32, **kwargs)
    model.set_experts_implementation("eager")  # the golden values used the eager per-expert loop
    return model


def _column_order(model, expected):
    """Our `main_logits` columns reordered to the golden `main_candidate_ids` order."""
    ours = model.main_candidate_ids().tolist()
    return torch.tensor([ours.index(i) for i in expected["main_candidate_ids"].tolist()])


# ---------------------------------------------------------------------------------------------------------------
# Golden values
# ---------------------------------------------------------------------------------------------------------------


def test_input_embeddings_match_golden(golden_model, expected):
    with torch.no_grad():
        embeds = golden_model.embed_frames(expected["tf_rows"][None])[0]
    torch.testing.assert_close(embeds, expected["tf_input_embeds"], atol=1e-5, rtol=1e-5)


def test_teacher_forced_forward_matches_golden(golden_model, expected):
    rows = expected["tf_rows"][None]
    with torch.no_grad():
        out = golden_model(rows)
    torch.testing.assert_close(out.last_hidden_state[0], expected["tf_hidden"], atol=1e-4, rtol=1e-4)
    main = out.main_logits[0][:, _column_order(golden_model, expected)]
    torch.testing.assert_close(main, expected["tf_main_logits"], atol=1e-4, rtol=1e-4)
    # codebook_logits are aligned with the row they predict: row t + 1 <-> golden tf_head_logits[t].
    torch.testing.assert_close(out.codebook_logits[0, 1:], expected["tf_head_logits"], atol=2e-3, rtol=1e-4)
    assert torch.equal(out.codebook_logits[0, 0], torch.zeros_like(out.codebook_logits[0, 0]))


def test_greedy_decoding_reproduces_golden_frames(golden_model, expected):
    """Backbone steps + main-token argmax + tower decode_frame with argmax heads: the golden greedy run exactly."""
    model, prompt = golden_model, expected["prompt_a_rows"][None]
    candidates = model.main_candidate_ids()
    with torch.no_grad():
        out = model(prompt, use_cache=True)
        cache, tower_cache = out.cache, out.tower_cache
        tower_cache.pending_row = None  # decode_frame writes the last prompt row's tower step itself
        hidden, row, position = out.last_hidden_state[:, -1], prompt[:, -1], prompt.shape[1] - 1
        mains, frames, head_logits, hiddens, main_logits = [], [], [], [], []
        for _ in range(16):
            logits = model.lm_head(hidden)[:, candidates]  # [1, V + 1]
            main = candidates[logits.argmax(-1)]
            codes, heads = model.tower.decode_frame(
                hidden, row, main, torch.tensor([position]), None, tower_cache,
                lambda head, index: head.argmax(-1),
            )
            mains.append(main), head_logits.append(heads[0]), hiddens.append(hidden[0]), main_logits.append(logits[0])
            if main.item() == model.config.eos_token_id:
                break
            row = torch.cat((main[:, None], codes), dim=1)  # [1, 11]
            frames.append(row[0])
            position += 1
            hidden = model.run_backbone(row[:, None], torch.tensor([[position]]), cache=cache)[:, -1]
    assert torch.equal(torch.cat(mains), expected["greedy_main_tokens"])
    assert torch.equal(torch.stack(frames), expected["greedy_frames"])
    order = _column_order(model, expected)
    torch.testing.assert_close(torch.stack(hiddens), expected["greedy_hidden"], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(torch.stack(main_logits)[:, order], expected["greedy_main_logits"], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(torch.stack(head_logits), expected["greedy_head_logits"], atol=5e-4, rtol=1e-4)


# ---------------------------------------------------------------------------------------------------------------
# Independent formulations: cached vs full, batched vs single, every k
# ---------------------------------------------------------------------------------------------------------------


def _assert_same_logits(ours, reference, config, rows):
    """(main, codebook) logits equal to `reference`'s up to the float32 rounding of a pass over `rows` rows
    (tolerances.py)."""
    for actual, wanted, reductions in zip(ours, reference, (main_logit_reductions, codebook_logit_reductions)):
        torch.testing.assert_close(actual, wanted, **reordering_tolerance(wanted, reductions(config, rows)))


def _incremental(model, rows, prefill):
    """Prefill `prefill` rows, then one row at a time, through both caches; concatenated outputs."""
    outs = [model(rows[:, :prefill], use_cache=True)]
    for t in range(prefill, rows.shape[1]):
        outs.append(model(rows[:, t : t + 1], cache=outs[-1].cache, tower_cache=outs[-1].tower_cache))
    return (torch.cat([o.main_logits for o in outs], 1), torch.cat([o.codebook_logits for o in outs], 1))


@pytest.fixture(scope="module")
def dequantised_model():
    """transformers' own experts (the FP8 experts dequantised at load), whose implementations can differ."""
    return _load(GOLDEN_TINY, quantization_config=BsgemmMoeConfig(dequantize=True))


@pytest.mark.parametrize("implementation", ["grouped_mm", "batched_mm"])
def test_expert_implementations_agree(dequantised_model, expected, implementation):
    golden_model = dequantised_model
    rows = expected["tf_rows"][None, -40:]
    with torch.no_grad():
        eager = golden_model(rows).main_logits
        golden_model.set_experts_implementation(implementation)
        try:
            other = golden_model(rows).main_logits
        finally:
            golden_model.set_experts_implementation("eager")
    assert golden_model.config.text_config._experts_implementation == "eager"
    tolerance = reordering_tolerance(eager, main_logit_reductions(golden_model.config, rows.shape[1]))
    torch.testing.assert_close(other, eager, **tolerance)


def test_cached_incremental_equals_full_pass(golden_model, expected):
    rows = expected["tf_rows"][None, :150]
    with torch.no_grad():
        full = golden_model(rows)
        main, codebooks = _incremental(golden_model, rows, prefill=140)
    _assert_same_logits((main, codebooks), (full.main_logits, full.codebook_logits), golden_model.config, rows.shape[1])


@pytest.mark.parametrize("k", [0, 1, 2])
def test_every_k_runs_and_caching_is_exact(tmp_path, expected, k):
    placement = "mtp_shared_pre" if k == 0 else "backbone_partial"
    model = _load(write_tiny_checkpoint(
        tmp_path, seed=11 + k, audio_decoder_config={"vq_backbone_codebooks": k, "vq_feature_placement": placement}
    ))
    rows = expected["tf_rows"][None, 100:150]  # text rows then reference and random audio rows
    with torch.no_grad():
        full = model(rows)
        main, codebooks = _incremental(model, rows, prefill=40)
        # The backbone embedding really depends on k: codebooks 1..k enter it, the rest enter the tower.
        audio = model.is_audio_row(rows[..., 0])
        shifted = rows.clone()
        shifted[..., 2] = (shifted[..., 2] + 1) % model.config.codebook_size * audio
        changed = (model.embed_frames(shifted) - model.embed_frames(rows)).abs().amax(-1)[audio]
    assert bool((changed > 0).all()) == (k >= 1)
    _assert_same_logits((main, codebooks), (full.main_logits, full.codebook_logits), model.config, rows.shape[1])


def test_left_padded_batch_equals_each_sequence_alone(golden_model, expected):
    long_rows, short_rows = expected["prompt_c_rows"][-80:], expected["tf_rows"][-50:]
    pad = long_rows.shape[0] - short_rows.shape[0]
    batch = torch.stack((long_rows, torch.cat((torch.zeros(pad, 11, dtype=torch.long), short_rows))))
    mask = torch.ones(2, long_rows.shape[0], dtype=torch.long)
    mask[1, :pad] = 0
    with torch.no_grad():
        together = golden_model(batch, attention_mask=mask)
        alone = [golden_model(long_rows[None]), golden_model(short_rows[None])]
    for index, (single, start) in enumerate(zip(alone, (0, pad))):
        _assert_same_logits(
            (together.main_logits[index, start:], together.codebook_logits[index, start + 1 :]),
            (single.main_logits[0], single.codebook_logits[0, 1:]),
            golden_model.config,
            batch.shape[1],
        )


# ---------------------------------------------------------------------------------------------------------------
# Loss and training
# ---------------------------------------------------------------------------------------------------------------


def test_loss_definition(golden_model, expected):
    rows = expected["tf_rows"][None]
    with torch.no_grad():
        out = golden_model(rows, labels=rows)
    start = golden_model.config.semantic_start_token_id
    main_ids = rows[0, :, 0]
    audio = golden_model.is_audio_row(main_ids)
    # Main token: rows whose next row is audio (target column 1 + c0) or is the <|im_end|> right after the
    # reference audio (end of speech, column 0); the other <|im_end|> rows follow text and are not counted.
    ends_speech = (main_ids[1:] == golden_model.config.eos_token_id) & audio[:-1]
    assert ends_speech.sum() == 1
    counted = audio[1:] | ends_speech
    targets = torch.where(ends_speech, 0, main_ids[1:] - start + 1)[counted]
    reference_main = torch.nn.functional.cross_entropy(out.main_logits[0, :-1][counted], targets)
    # Float32 rounding of a log-softmax over the candidates plus a mean over the counted terms (tolerances.py).
    reductions = out.main_logits.shape[-1] + targets.numel()
    torch.testing.assert_close(out.main_loss, reference_main, **reordering_tolerance(reference_main, reductions))
    code_logits = out.codebook_logits[0][audio].reshape(-1, golden_model.config.codebook_size)
    reference_codes = torch.nn.functional.cross_entropy(code_logits, rows[0, audio, 2:].reshape(-1))
    reductions = code_logits.shape[-1] + code_logits.shape[0]
    torch.testing.assert_close(out.codebook_loss, reference_codes, **reordering_tolerance(reference_codes, reductions))
    assert torch.equal(out.loss, out.main_loss + out.codebook_loss)


def test_ignored_labels_and_eos_target(golden_model, expected):
    """An EOS label right after an audio row ends speech: target column 0. Rows labelled -100 do not count."""
    rows = expected["tf_rows"][None, -60:]
    assert golden_model.is_audio_row(rows[0, 55:, 0]).all()
    labels = torch.full_like(rows, -100)
    labels[0, 57, 0] = golden_model.config.eos_token_id
    with torch.no_grad():
        out = golden_model(rows, labels=labels)
    reference = -torch.log_softmax(out.main_logits[0, 56], -1)[0]
    # One term: the float32 rounding of a log-softmax over the candidates, plus the mean's division (tolerances.py).
    tolerance = reordering_tolerance(reference, out.main_logits.shape[-1] + 1)
    torch.testing.assert_close(out.main_loss, reference, **tolerance)
    assert out.codebook_loss.item() == 0.0  # no audio label rows left


def test_one_optimisation_step_lowers_the_loss(tmp_path, expected):
    # Training the routed experts needs them dequantised at load (FP8 experts kept as shipped are frozen).
    model = _load(write_tiny_checkpoint(tmp_path, seed=5), quantization_config=BsgemmMoeConfig(dequantize=True))
    model.train()
    rows = expected["tf_rows"][None, 90:150]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    before = model(rows, labels=rows).loss
    before.backward()
    assert model.tower.heads[0].weight.grad is not None and model.backbone.layers[0].mlp.experts.gate_up_proj.grad is not None
    assert model.lm_head.weight.grad.abs().sum() > 0
    optimizer.step()
    with torch.no_grad():
        after = model(rows, labels=rows).loss
    assert after < before


# ---------------------------------------------------------------------------------------------------------------
# Bad inputs
# ---------------------------------------------------------------------------------------------------------------


def test_wrong_last_dimension(golden_model):
    with pytest.raises(ValueError, match=r"frame rows \[batch, rows, 11\]"):
        golden_model(torch.zeros(1, 5, 10, dtype=torch.long))


def test_float_input_ids(golden_model):
    with pytest.raises(ValueError, match="integer ids"):
        golden_model(torch.zeros(1, 5, 11))


def test_main_id_outside_vocabulary(golden_model):
    rows = torch.zeros(1, 3, 11, dtype=torch.long)
    rows[0, 1, 0] = 10_000
    with pytest.raises(ValueError, match=r"input_ids\[0, 1, 0\] = 10000: main ids must lie in the text vocabulary"):
        golden_model(rows)


def test_codes_on_a_text_row(golden_model):
    rows = torch.zeros(1, 3, 11, dtype=torch.long)
    rows[0, 1, 0], rows[0, 1, 5] = 17, 3
    with pytest.raises(ValueError, match=r"input_ids\[0, 1, 5\] = 3: a text row .* must have all codes 0"):
        golden_model(rows)


@pytest.mark.parametrize("column,value", [(3, -7), (1, -1), (10, 64), (5, 10_000)])
def test_out_of_range_codes_are_refused_naming_the_row_and_column(golden_model, expected, column, value):
    """Codes of an audio row outside [0, V) (V = 64 here) are refused, the first offending entry named."""
    rows = expected["tf_rows"][None, -20:].clone()
    row = int(golden_model.is_audio_row(rows[0, :, 0]).nonzero()[2, 0])
    rows[0, row, column] = value
    if column == 1:  # c0 is also the main id's offset: keep the row consistent so the range check is what fires
        rows[0, row, 0] = golden_model.config.semantic_start_token_id + value
    with pytest.raises(ValueError, match=rf"input_ids\[0, {row}, {column}\] = {value}"):
        golden_model(rows)
    with pytest.raises(ValueError, match=rf"input_ids\[0, {row}, {column}\] = {value}"):
        golden_model.generate(rows, max_new_tokens=1)


def test_an_all_zero_attention_mask_row_is_refused(golden_model, expected):
    rows = expected["tf_rows"][None, :6].expand(2, -1, -1)
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[1] = 0
    with pytest.raises(ValueError, match="attention_mask row 1 is all zeros"):
        golden_model(rows, attention_mask=mask)
    with pytest.raises(ValueError, match="attention_mask row 1 is all zeros"):
        golden_model.generate(rows, attention_mask=mask, max_new_tokens=1)


def test_cache_from_another_batch_size(golden_model, expected):
    rows = expected["tf_rows"][None, :10]
    with torch.no_grad():
        out = golden_model(rows, use_cache=True)
        with pytest.raises(ValueError, match="sequence"):
            golden_model(rows[:, :1].expand(2, 1, 11), cache=out.cache, tower_cache=out.tower_cache,
                         attention_mask=torch.ones(2, 11, dtype=torch.long))


def test_only_one_cache(golden_model, expected):
    rows = expected["tf_rows"][None, :10]
    with torch.no_grad():
        out = golden_model(rows, use_cache=True)
        with pytest.raises(ValueError, match="both caches"):
            golden_model(rows[:, :1], cache=out.cache)


def test_positions_past_the_context_limit(tmp_path):
    model = _load(write_tiny_checkpoint(tmp_path, text_config={"max_position_embeddings": 16}))
    rows = torch.zeros(1, 12, 11, dtype=torch.long)
    with torch.no_grad():
        out = model(rows, use_cache=True)
        with pytest.raises(ValueError, match="exceed the backbone's context of 16 rows"):
            model(torch.zeros(1, 5, 11, dtype=torch.long), cache=out.cache, tower_cache=out.tower_cache)
        with pytest.raises(ValueError, match="exceed the backbone's context"):
            model(torch.zeros(1, 17, 11, dtype=torch.long))


def test_unknown_keyword(golden_model):
    with pytest.raises(TypeError, match="unexpected arguments"):
        golden_model(torch.zeros(1, 2, 11, dtype=torch.long), temprature=0.5)


# ---------------------------------------------------------------------------------------------------------------
# Host reads
# ---------------------------------------------------------------------------------------------------------------


def package_host_reads(function) -> int:
    """How many times this package's code reads a tensor's value back to the host while `function` runs (on a GPU
    each read waits for the device). Reads by transformers' backbone (its mask builders, the eager experts loop) are
    not counted."""
    import traceback

    count = 0
    originals = {name: getattr(torch.Tensor, name) for name in ("__bool__", "item", "tolist", "__int__", "__float__")}

    def counting(original):
        def read(self, *args, **kwargs):
            nonlocal count
            count += "transformers_drama3" in traceback.extract_stack(limit=2)[0].filename
            return original(self, *args, **kwargs)
        return read

    try:
        for name, original in originals.items():
            setattr(torch.Tensor, name, counting(original))
        function()
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)
    return count


def test_forward_reads_its_inputs_back_once(golden_model, expected):
    """Every value check of input rows, mask and labels is read back in one host sync, before the pass; the pass
    itself (prefill or training step) reads nothing back."""
    rows = expected["tf_rows"][None, :12].expand(2, -1, -1).clone()
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, :3], rows[1, :3] = 0, 0
    with torch.no_grad():
        assert package_host_reads(lambda: golden_model(rows, mask, use_cache=True, logits_to_keep=1)) == 1
        assert package_host_reads(lambda: golden_model(rows, mask, labels=rows)) == 1


def test_bad_labels_are_refused_before_the_pass(golden_model, expected, monkeypatch):
    rows = expected["tf_rows"][None, -12:]  # audio rows
    monkeypatch.setattr(golden_model, "run_backbone", lambda *args, **kwargs: pytest.fail("the pass ran"))
    labels = rows.clone()
    labels[0, 3, 0] = 10_000
    with pytest.raises(ValueError, match=r"labels\[0, 3, 0\] = 10000: label main ids must lie in the text vocabulary"):
        golden_model(rows, labels=labels)
    labels = rows.clone()
    audio_row = int(golden_model.is_audio_row(rows[0, 1:, 0]).nonzero()[0, 0]) + 1  # a row the loss counts
    labels[0, audio_row, 4] = 64
    with pytest.raises(ValueError, match="labels have codes outside"):
        golden_model(rows, labels=labels)
    with pytest.raises(ValueError, match="shape of input_ids"):
        golden_model(rows, labels=rows[:, :5])
