"""The one check of generation settings (settings_checks.py), and that `generate` and `Drama3Engine.add_request` refuse
every bad value with it (a `ValueError` or `TypeError` naming the keyword) before any work, and run every value it
passes: property-based over every keyword of both, with values a JSON client or a careless caller sends."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import GenerationConfig

from transformers_drama3.generation.engine import Drama3Engine
from transformers_drama3.generation import DRAMA3_GENERATION_DEFAULTS, generation_settings
from transformers_drama3.settings_checks import (
    FLOAT32_MAX,
    INT64_MAX,
    SettingError,
    check_generation_settings,
    check_seed,
    float32_of,
)

DEFAULTS = GenerationConfig(**DRAMA3_GENERATION_DEFAULTS)
# Values a client sends by mistake: numbers too big for float32 or int64 (and just inside), NaN and infinities,
# float32 underflow, booleans and numeric strings where numbers go, containers.
JUNK = st.one_of(
    st.none(), st.booleans(), st.integers(), st.integers(min_value=2**62, max_value=2**70),
    st.sampled_from([-1, 0, 1, 2**63 - 1, 2**63, 2**64, -(2**63) - 1, 10**20]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([1e308, -1e308, 1e-50, 3.5e38, FLOAT32_MAX, 0.0, 0.5, 1.0, 1.5, math.nan]),
    st.text(max_size=5), st.sampled_from(["7", "0.5", "true", "yes", ""]), st.lists(st.integers(), max_size=2),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=1),
)


@pytest.mark.parametrize(
    "name, value, allowed",
    [
        ("temperature", 1e308, "(0, 3.4028235e+38]"),  # overflows float32 (the issue's 500)
        ("temperature", 1e-50, "(0, 3.4028235e+38]"),  # positive, but 0 in float32
        ("temperature", math.inf, "(0, 3.4028235e+38]"),
        ("temperature", 10**400, "(0, 3.4028235e+38]"),  # an int too big for a float at all
        ("codebook_temperature", 2**63, "(0, 3.4028235e+38]"),  # torch reads an int as int64 first (found by the fuzz)
        ("temperature", "1.0", "(0, 3.4028235e+38]"),
        ("temperature", True, "(0, 3.4028235e+38]"),
        ("top_p", math.nan, "(0, 1]"),
        ("codebook_top_p", 1e-46, "(0, 1]"),  # below float32's smallest subnormal: rounds to 0
        ("top_k", 10**20, f"[0, {INT64_MAX}]"),  # the issue's "Overflow when unpacking long long"
        ("top_k", 2**63, f"[0, {INT64_MAX}]"),
        ("ras_top_k", -1, f"[0, {INT64_MAX}]"),
        ("codebook_top_k", 2.0, f"[0, {INT64_MAX}]"),
        ("max_new_tokens", True, f"[1, {INT64_MAX}]"),  # not 1 frame
        ("max_new_tokens", "7", f"[1, {INT64_MAX}]"),
        ("max_new_tokens", np.float64(7), f"[1, {INT64_MAX}]"),
        ("stop_check_interval", 0, f"[1, {INT64_MAX}]"),
        ("ras_window", np.bool_(True), f"[0, {INT64_MAX}]"),
        ("do_sample", 1, "True or False"),
        ("output_scores", "yes", "True or False"),
        ("compile_step", 1, "a torch.compile backend name"),
        ("compile_step", " ", "a torch.compile backend name"),
    ],
)
def test_each_refusal_names_setting_value_and_range(name, value, allowed):
    with pytest.raises(SettingError) as caught:
        check_generation_settings({**DRAMA3_GENERATION_DEFAULTS, name: value})
    error = caught.value
    assert error.setting == name and allowed in str(error) and str(error).startswith(f"{name} must be")
    assert f"got {value!r}"[:40] in str(error)


@pytest.mark.parametrize(
    "changes",
    [
        {"temperature": FLOAT32_MAX, "top_k": INT64_MAX, "max_new_tokens": INT64_MAX, "ras_window": INT64_MAX},
        {"temperature": 1e-40, "top_p": 1e-45},  # float32 subnormals: above 0 once rounded
        {"temperature": np.float32(0.7), "top_k": np.int64(30), "top_p": 1},  # numpy scalars, an int for a float
        {"top_k": None, "ras_top_k": 0, "compile_step": "eager"},
        {"do_sample": False, "temperature": 0.0, "top_p": None},  # greedy: the sampling ranges do not apply
    ],
)
def test_edges_that_fit_pass(changes):
    check_generation_settings({**DRAMA3_GENERATION_DEFAULTS, **changes})


def test_float32_rounding_is_the_tensors():
    """`float32_of` is what a float32 tensor holds (torch's own conversion), or None where that is not finite."""
    for value in (0.1, 1e-40, 1e-46, 3.4028235e38, FLOAT32_MAX, 123456789.0):
        assert float32_of(value) == torch.tensor(value, dtype=torch.float32).item()
    assert float32_of(3.5e38) is None and float32_of(math.nan) is None and float32_of(True) is None


def test_seed_range_is_torchs():
    for seed in (-(2**63), 0, 2**64 - 1):
        check_seed(seed)
        torch.Generator().manual_seed(seed)
    for seed in (2**64, -(2**63) - 1, True, 1.0, "7"):
        with pytest.raises(SettingError, match="seed must be an integer in"):
            check_seed(seed)


GENERATE_KEYWORDS = sorted(DRAMA3_GENERATION_DEFAULTS) + [
    "seed", "output_audio", "show_progress", "prompt_cache", "generator", "no_such_setting", "generation_config",
    "logits_processor", "stopping_criteria", "streamer", "attention_mask"]
ENGINE_ONLY = ["front", "streaming", "request_id", "on_frame", "on_finish"]
NOT_ENGINE = {"output_audio", "show_progress", "generator", "generation_config", "logits_processor",
              "stopping_criteria", "streamer", "attention_mask"}


def settings_and_junk(names):
    """A dict of 1 to 3 of `names`, each a junk value or its default."""
    def value(name):
        return st.one_of(JUNK, st.just(DRAMA3_GENERATION_DEFAULTS.get(name)))

    return st.lists(st.sampled_from(names), min_size=1, max_size=3, unique=True).flatmap(
        lambda chosen: st.fixed_dictionaries({name: value(name) for name in chosen}))


def refused_by_name(error: Exception, keywords: dict) -> bool:
    if isinstance(error, SettingError):
        return error.setting in keywords
    return isinstance(error, (ValueError, TypeError)) and any(name in str(error) for name in keywords)


def runnable(keywords: dict) -> dict:
    """`keywords` with what would make a passing call slow on a CPU made quick: 1 frame, no compile, no CUDA graphs."""
    quick = dict(keywords, max_new_tokens=1)
    for name in ("compile_step", "fast_decode"):
        if name in quick and quick[name] not in (None, False) and isinstance(quick[name], (bool, str)):
            quick[name] = False
    return quick


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(keywords=settings_and_junk(GENERATE_KEYWORDS))
def test_generate_refuses_by_name_or_runs(golden_model, prompt, keywords):
    """Every keyword of `generate`: a `ValueError`/`TypeError` naming it, or frames; never a raw RuntimeError from
    a tensor that cannot hold the value."""
    try:
        out = golden_model.generate(prompt, **runnable(keywords))
    except Exception as error:  # noqa: BLE001  (the property: what is raised, and that it names the keyword)
        assert refused_by_name(error, keywords), f"{type(error).__name__}: {error}"
    else:
        assert out is not None


@settings(max_examples=80, deadline=None)
@given(keywords=settings_and_junk(sorted(set(GENERATE_KEYWORDS) - NOT_ENGINE) + ENGINE_ONLY))
def test_add_request_refuses_by_name_or_queues(golden_model, prompt, keywords):
    """Every keyword of `add_request`: refused naming it before anything is queued, or queued (then cancelled)."""
    engine = ENGINES.setdefault("engine", Drama3Engine(golden_model, max_batch=2))
    try:
        request_id = engine.add_request(prompt[0], **runnable(keywords))
    except Exception as error:  # noqa: BLE001
        assert refused_by_name(error, keywords), f"{type(error).__name__}: {error}"
        assert not engine.waiting
    else:
        engine.cancel_request(request_id)
        while engine.step():
            pass
        engine.results.clear()


ENGINES: dict = {}  # one engine for the whole property test (hypothesis runs a test function many times)


def test_generate_and_engine_refuse_the_issues_values(golden_model, prompt):
    """The reported cases: a SettingError naming the value, where a RuntimeError came from the tensors."""
    for keywords in ({"temperature": 1e308}, {"top_k": 10**20}, {"max_new_tokens": True}):
        with pytest.raises(SettingError, match=next(iter(keywords))):
            golden_model.generate(prompt, **keywords)
        with pytest.raises(SettingError, match=next(iter(keywords))):
            Drama3Engine(golden_model).add_request(prompt[0], **keywords)
    with pytest.raises(SettingError, match="seed"):
        Drama3Engine(golden_model).add_request(prompt[0], seed=2**64)
    with pytest.raises(SettingError, match="temperature"):
        generation_settings(DEFAULTS, temperature=1e308)


def test_switches_take_no_truthy_stand_ins(golden_model, prompt):
    """`output_audio="no"` made audio before (a non-empty string is truthy): switches take True or False only."""
    for name in ("output_audio", "show_progress"):
        with pytest.raises(SettingError, match=f"{name} must be True or False, got 'no'"):
            golden_model.generate(prompt, **{name: "no"})
    engine = Drama3Engine(golden_model)
    for keywords in ({"front": "yes"}, {"streaming": 1}, {"request_id": 5}, {"on_frame": 5}):
        with pytest.raises((SettingError, TypeError), match=next(iter(keywords))):
            engine.add_request(prompt[0], **keywords)
    assert not engine.waiting


def test_synthesize_checks_settings_before_encoding_references(golden_model, golden_processor, monkeypatch):
    from transformers_drama3 import synthesis

    def encoded(*args, **kwargs):
        raise AssertionError("references were encoded before the settings were checked")

    monkeypatch.setattr(synthesis, "encode_references", encoded)
    with pytest.raises(SettingError, match="temperature"):
        synthesis.synthesize(golden_model, golden_processor, "Hello there.", temperature=1e308)
