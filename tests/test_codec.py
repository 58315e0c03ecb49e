"""Fish DAC codec (docs/format.md#the-codec): golden decode/encode, exact streaming, the original `codec.pth` layout,
the codec as a transformers model (save/load, Auto classes, initial weights, attention kernels), bad inputs."""

import copy
import json
import math
import os
import re
import threading

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoConfig, AutoModel

import transformers_drama3  # noqa: F401  (registers the Auto classes)
from transformers_drama3.configuration_drama3 import FishDACConfig
from transformers_drama3.codec_blocks import FishDACCausalConv1d, FishDACWindowedAttention, apply_rope, rope_table
from transformers_drama3.codec_file import original_codec_key_shapes
from transformers_drama3 import modeling_codec
from transformers_drama3.codec_file import write_codec_file
from transformers_drama3.codec_layout import (
    FishDACLoadError,
    folded_state_dict,
    load_codec_state_dict,
    load_codec_weights,
    memory_maps,
)
from transformers_drama3.modeling_codec import FishDACCodec, FishDACVectorQuantizer
from transformers_drama3.audio_io import resample_audio
from transformers_drama3.testing import random_original_codec_state_dict

from .conftest import GOLDEN_TINY
from .tolerances import codec_decode_reductions, reordering_tolerance, unit_roundoff

CODEC_PTH = GOLDEN_TINY / "codec.pth"
# The resampler is libsoxr at "VHQ" quality, which its documentation gives as 28 bits of precision and 175 dB of
# stop-band rejection: on float64 input, in-band tones come out within 2^-28 of full scale of the ideal signal (well
# inside the passband: 3.1 kHz of 8 kHz or more), and a tone above the new Nyquist frequency at most 10^(-175 / 20).
SOXR_VHQ_PRECISION = 2.0**-28
SOXR_VHQ_REJECTION = 10 ** (-175 / 20)


@pytest.fixture(scope="module")
def tiny_config():
    with open(GOLDEN_TINY / "config.json") as f:
        return FishDACConfig(**json.load(f)["codec_config"])


@pytest.fixture(scope="module")
def codec(tiny_config):
    return FishDACCodec.from_codec_file(CODEC_PTH, tiny_config)


@pytest.fixture(scope="module")
def codec64(tiny_config):
    return FishDACCodec.from_codec_file(CODEC_PTH, tiny_config).double()


@pytest.fixture(scope="module")
def small_window_codec(tiny_config):
    """Tiny codec with random weights and a 3-frame quantizer window, so short streams cross the window often."""
    values = tiny_config.to_dict()
    values["quantizer"]["transformer"]["window_size"] = 3
    config = FishDACConfig(**values)
    codec = FishDACCodec(config)
    codec.load_original_state_dict(random_original_codec_state_dict(config, torch.Generator().manual_seed(1)))
    return codec.double()


def random_codes(config, frames, batch=1, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randint(0, n, (batch, frames), generator=generator) for n in config.codebook_sizes], 1)


# --------------------------------------------------------------------------------------------------------------
# Golden outputs (tolerances of the golden README)
# --------------------------------------------------------------------------------------------------------------


def test_golden_decode(codec, expected):
    audio = codec.decode(expected["codec_codes"][None]).audio_values[:, 0]
    assert audio.shape == (1, 12 * 2048) and audio.dtype == torch.float32
    torch.testing.assert_close(audio[0], expected["codec_audio"], atol=1e-4, rtol=0)


def test_golden_encode_is_exact(codec, expected):
    codes = codec.encode(expected["codec_input_audio"], sampling_rate=44100).audio_codes
    assert codes.shape == (1, 10, 22) and codes.dtype == torch.long
    assert torch.equal(codes[0], expected["codec_encoded"])


def test_golden_roundtrip(codec, expected):
    audio = codec.decode(codec.encode(expected["codec_input_audio"], 44100).audio_codes).audio_values
    torch.testing.assert_close(audio[0, 0], expected["codec_roundtrip_audio"], atol=1e-4, rtol=0)
    round_trip = codec(expected["codec_input_audio"], 44100)  # forward: encode, then decode
    assert torch.equal(round_trip.audio_values, audio) and round_trip.audio_codes.shape[:2] == (1, 10)
    assert torch.equal(codec(audio_codes=round_trip.audio_codes).audio_values, audio)


def test_batch_decode_equals_single_decodes(codec, expected, tiny_config):
    codes = torch.cat([expected["codec_codes"][None], random_codes(tiny_config, 12)])
    batched = codec.decode(codes).audio_values[:, 0]
    for row in range(2):
        single = codec.decode(codes[row : row + 1]).audio_values[0, 0]
        torch.testing.assert_close(batched[row], single, **reordering_tolerance(single, codec_decode_reductions(codec)))


def test_decode_of_zero_frames_is_empty(codec):
    assert codec.decode(torch.zeros(2, 10, 0, dtype=torch.long)).audio_values.shape == (2, 1, 0)


def test_bfloat16_codec_decodes_close_to_float32(tiny_config, expected):
    codec = FishDACCodec.from_codec_file(CODEC_PTH, tiny_config).to(torch.bfloat16)
    audio = codec.decode(expected["codec_codes"][None]).audio_values[0, 0]
    assert audio.dtype == torch.float32 and torch.isfinite(audio).all()
    assert torch.corrcoef(torch.stack([audio, expected["codec_audio"]]))[0, 1] > 0.95


def test_folded_state_dict_round_trips(codec, tiny_config, expected):
    reloaded = FishDACCodec(tiny_config)
    reloaded.load_state_dict(codec.state_dict())
    assert torch.equal(reloaded.decode(expected["codec_codes"][None]).audio_values[:, 0], codec.decode(expected["codec_codes"][None]).audio_values[:, 0])


# --------------------------------------------------------------------------------------------------------------
# The codec as a transformers model
# --------------------------------------------------------------------------------------------------------------


def test_codec_round_trips_through_save_pretrained_and_automodel(codec, expected, tmp_path):
    """Exact: the folded weights are written to safetensors and read back as they are, and the same code runs."""
    codec.save_pretrained(tmp_path)
    assert sorted(os.listdir(tmp_path)) == ["config.json", "model.safetensors"]
    reloaded, info = AutoModel.from_pretrained(tmp_path, output_loading_info=True)
    assert type(reloaded) is FishDACCodec
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    settings = [{k: v for k, v in c.config.to_dict().items() if k != "_name_or_path"} for c in (reloaded, codec)]
    assert settings[0] == settings[1]
    codes = expected["codec_codes"][None]
    assert torch.equal(reloaded.decode(codes).audio_values[:, 0], codec.decode(codes).audio_values[:, 0])
    audio = expected["codec_input_audio"]
    assert torch.equal(reloaded.encode(audio, 44100).audio_codes, codec.encode(audio, 44100).audio_codes)


def test_codec_is_registered_with_the_auto_classes(tiny_config):
    assert AutoConfig.for_model("fish_dac").__class__ is FishDACConfig
    assert type(AutoModel.from_config(tiny_config)) is FishDACCodec


def test_from_codec_file_reads_the_folded_layout_too(codec, expected, tmp_path, tiny_config):
    torch.save(codec.state_dict(), tmp_path / "codec.pth")  # what FishOmniForSpeech.save_pretrained writes
    reloaded = FishDACCodec.from_codec_file(tmp_path / "codec.pth", tiny_config)
    assert torch.equal(reloaded.decode(expected["codec_codes"][None]).audio_values[:, 0], codec.decode(expected["codec_codes"][None]).audio_values[:, 0])


@pytest.mark.parametrize("layout", ["original", "folded"])
def test_a_load_writes_every_weight(codec, tiny_config, layout):
    """`from_codec_state_dict` loads into uninitialised memory: no weight may be left out of a load."""
    state = load_codec_state_dict(CODEC_PTH) if layout == "original" else codec.state_dict()
    with torch.device("meta"):
        target = FishDACCodec(tiny_config)
    target = target.to_empty(device="cpu")
    for parameter in target.parameters():
        parameter.data.fill_(float("nan"))
    load_codec_weights(target, state)
    assert all(torch.isfinite(parameter).all() for parameter in target.parameters())


def _std_is_about(tensor: torch.Tensor, std: float) -> bool:
    """Whether the sample std of `tensor` is `std` within 6 standard errors (the standard error of the std of n normal
    samples is std / sqrt(2 n)): a wrong initialisation (zeros, ones, another scale) is far outside."""
    return abs(tensor.std().item() - std) < 6 * std / math.sqrt(2 * tensor.numel())


def test_a_new_codec_gets_its_initial_weights(tiny_config):
    torch.manual_seed(0)
    codec = FishDACCodec(tiny_config)
    decoder_conv = codec.decoder.blocks[0].upsample
    assert _std_is_about(decoder_conv.weight, 0.02) and torch.equal(decoder_conv.bias, torch.zeros_like(decoder_conv.bias))
    assert _std_is_about(codec.quantizer.pre_module.layers[0].attention.wqkv.weight, 0.02)
    assert torch.equal(codec.decoder.output_snake.alpha, torch.ones_like(codec.decoder.output_snake.alpha))
    assert _std_is_about(codec.quantizer.codebooks[1].codebook, 1.0) and _std_is_about(codec.quantizer.codebooks[1].table, 1.0)
    layer = codec.quantizer.pre_module.layers[0]
    assert all(torch.equal(p, torch.ones_like(p)) for p in (layer.attention_norm.weight, layer.ffn_layer_scale.gamma))
    assert all(torch.isfinite(p).all() for p in codec.parameters())


def test_a_codec_without_weights_in_memory_refuses_to_run(tiny_config):
    """Offloaded (or never loaded) weights sit on the meta device; the codec's methods run outside offload hooks."""
    with torch.device("meta"):
        codec = FishDACCodec(tiny_config)
    with pytest.raises(ValueError, match="meta device"):
        codec.decode(torch.zeros(1, 10, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="meta device"):
        codec.stream().decode(torch.zeros(1, 10, 2, dtype=torch.long))


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
def test_the_codec_accepts_an_attention_kernel_and_keeps_its_own_attention(codec, expected, tmp_path, implementation):
    codec.save_pretrained(tmp_path)
    reloaded = FishDACCodec.from_pretrained(tmp_path, attn_implementation=implementation)
    assert reloaded.config._attn_implementation == implementation
    codes = expected["codec_codes"][None]
    assert torch.equal(reloaded.decode(codes).audio_values[:, 0], codec.decode(codes).audio_values[:, 0])  # the same windowed attention either way


# --------------------------------------------------------------------------------------------------------------
# Streaming
# --------------------------------------------------------------------------------------------------------------


def chunked_decode(codec, codes, sizes):
    stream, pieces, start = codec.stream(), [], 0
    for size in sizes:
        piece = stream.decode(codes[..., start : start + size]).audio_values[:, 0]
        assert piece.shape == (codes.shape[0], size * codec.config.frame_length)
        pieces.append(piece)
        start += size
    return torch.cat(pieces, dim=-1)


@settings(max_examples=8, deadline=None)
@given(sizes=st.lists(st.integers(min_value=0, max_value=4), min_size=1, max_size=6).filter(lambda s: sum(s) > 0))
def test_streaming_matches_one_shot_float32(codec, expected, sizes):
    codes = torch.cat([expected["codec_codes"], expected["codec_codes"].flip(-1)], dim=-1)[None, :, : sum(sizes)]
    one_shot = codec.decode(codes).audio_values[:, 0]
    torch.testing.assert_close(chunked_decode(codec, codes, sizes), one_shot,
                               **reordering_tolerance(one_shot, codec_decode_reductions(codec)))


@settings(max_examples=6, deadline=None)
@given(sizes=st.lists(st.sampled_from([0, 1, 1, 2, 3]), min_size=1, max_size=6).filter(lambda s: sum(s) > 0))
def test_streaming_is_exact_across_windows(small_window_codec, sizes):
    """In float64 the streamed audio is the one-shot audio bit for bit (the output is rounded to float32)."""
    codes = random_codes(small_window_codec.config, sum(sizes), batch=2, seed=len(sizes))
    assert torch.equal(chunked_decode(small_window_codec, codes, sizes), small_window_codec.decode(codes).audio_values[:, 0])


def test_streaming_one_frame_chunks_and_bounded_state(small_window_codec):
    codes = random_codes(small_window_codec.config, 10, seed=3)
    stream, sizes, pieces = small_window_codec.stream(), [], []
    for frame in range(10):
        pieces.append(stream.decode(codes[..., frame : frame + 1]).audio_values[:, 0])
        sizes.append(stream.state_size())
    assert stream.frames_decoded == 10
    assert torch.equal(torch.cat(pieces, -1), small_window_codec.decode(codes).audio_values[:, 0])
    # The KV cache fills up to window - 1 = 2 frames, then the carried state stops growing.
    assert len(set(sizes[2:])) == 1
    stream.reset()
    assert stream.frames_decoded == 0 and stream.state_size() == 0
    assert torch.equal(stream.decode(codes[..., :3]).audio_values[:, 0], torch.cat(pieces[:3], -1))


def test_the_carried_state_holds_only_what_it_carries(codec, expected):
    """Each carried tensor owns its memory: a view of the chunk's activations would keep the whole chunk alive (65 MiB
    for a real-size codec streaming 8-frame chunks, against 1.5 MiB carried)."""
    stream = codec.stream()
    for start in (0, 4):
        stream.decode(expected["codec_codes"][None, :, start : start + 4])
    tensors = [t for value in stream._state.values() for t in (value if isinstance(value, tuple) else (value,))
               if isinstance(t, torch.Tensor)]
    assert tensors and all(t.untyped_storage().nbytes() == t.numel() * t.element_size() for t in tensors)


def test_stream_rejects_batch_change(codec, tiny_config):
    stream = codec.stream()
    stream.decode(random_codes(tiny_config, 1, batch=2))
    with pytest.raises(ValueError, match="batch"):
        stream.decode(random_codes(tiny_config, 1, batch=1))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_golden_and_streaming(tiny_config, expected):
    """On CUDA the codec keeps TF32 off (even where the global flags allow it) and matches the golden outputs."""
    codec = FishDACCodec.from_codec_file(CODEC_PTH, tiny_config).cuda()
    torch.backends.cudnn.allow_tf32 = True
    codes = expected["codec_codes"][None].cuda()
    audio = codec.decode(codes).audio_values[:, 0]
    assert audio.device.type == "cuda" and torch.backends.cudnn.allow_tf32
    torch.testing.assert_close(audio[0].cpu(), expected["codec_audio"], atol=1e-4, rtol=0)
    encoded = codec.encode(expected["codec_input_audio"].cuda(), 44100).audio_codes
    assert torch.equal(encoded[0].cpu(), expected["codec_encoded"])
    torch.testing.assert_close(chunked_decode(codec, codes, [1, 0, 4, 7]), audio,
                               **reordering_tolerance(audio, codec_decode_reductions(codec)))
    at_48k = resample_audio(expected["codec_input_audio"].cuda(), 44100, 48000)
    on_cpu = resample_audio(expected["codec_input_audio"], 44100, 48000)
    # float64 on both devices, then one rounding to float32 each: at most 2 u of the largest sample apart.
    torch.testing.assert_close(at_48k.cpu(), on_cpu, **reordering_tolerance(on_cpu, 1))


def test_tf32_is_off_while_the_codec_runs_and_restored(codec, expected, monkeypatch):
    seen = []
    forward = codec.decoder.forward

    def spy(*args, **kwargs):
        seen.append((torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32))
        return forward(*args, **kwargs)

    monkeypatch.setattr(codec.decoder, "forward", spy)
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = True
    try:
        codec.decode(expected["codec_codes"][None, :, :1])
        codec.allow_tf32 = True
        codec.stream().decode(expected["codec_codes"][None, :, :1])
        assert seen == [(False, False), (True, True)]
        assert torch.backends.cudnn.allow_tf32 and torch.backends.cuda.matmul.allow_tf32
    finally:
        codec.allow_tf32 = False
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


def test_windowed_attention_matches_masked_full_attention():
    torch.manual_seed(0)
    attention = FishDACWindowedAttention(dim=16, n_head=2, head_dim=8, window=5).double()
    x = torch.randn(2, 23, 16, dtype=torch.float64)  # several query blocks of `window`
    rope = rope_table(torch.arange(23), 8, 10000)
    q, k, v = attention.wqkv(x).view(2, 23, 3, 2, 8).unbind(2)
    q, k, v = (t.transpose(1, 2) for t in (apply_rope(q, rope), apply_rope(k, rope), v))
    i, j = torch.arange(23)[:, None], torch.arange(23)[None, :]
    full = F.scaled_dot_product_attention(q, k, v, attn_mask=(j <= i) & (j > i - 5))
    reference = attention.wo(full.transpose(1, 2).reshape(2, 23, 16))
    # float64 rounding (tolerances.py) of wqkv (16), the scores (head_dim 8), the sum over <= 23 keys and wo (16).
    torch.testing.assert_close(attention(x, rope), reference, **reordering_tolerance(reference, 16 + 8 + 23 + 16))


def test_rope_table_is_bfloat16_rounded():
    table = rope_table(torch.arange(300), 64, 10000)
    assert torch.equal(table, table.to(torch.bfloat16).float())
    angles = torch.arange(300)[:, None].double() / 10000 ** (torch.arange(0, 64, 2).double() / 64)
    # bfloat16 rounding of |cos| <= 1 (unit roundoff 2^-8), plus the float32 angles of up to 300 rad (a product
    # and a power: a few float32 roundings of 300) moving the cosine by at most as much.
    atol = unit_roundoff(torch.bfloat16) + 4 * unit_roundoff(torch.float32) * 300
    torch.testing.assert_close(table[..., 0].double(), angles.cos(), atol=atol, rtol=0)


# --------------------------------------------------------------------------------------------------------------
# The original layout: key set, parameter count, folding, random weights
# --------------------------------------------------------------------------------------------------------------

_CONV = r"conv\.(bias|parametrizations\.weight\.original[01])"
_UNIT = rf"block\.[0-2]\.block\.([02]\.alpha|[13]\.{_CONV})"
_DEC_UNIT = rf"block\.[2-4]\.block\.([02]\.alpha|[13]\.{_CONV})"
_LAYER = (r"layers\.\d+\.(attention\.(wqkv|wo)\.weight|feed_forward\.w[123]\.weight|(attention|ffn)_norm\.weight"
          r"|(attention|ffn)_layer_scale\.gamma)|norm\.weight")
_VQ = r"quantizers\.\d+\.(codebook\.weight|(in|out)_proj\.(weight_g|weight_v|bias))"
_CONVNEXT = r"1\.(dwconv\.conv\.(weight|bias)|norm\.(weight|bias)|pwconv[12]\.(weight|bias)|gamma)"
ORIGINAL_KEY_PATTERNS = [
    rf"encoder\.block\.0\.{_CONV}",
    rf"encoder\.block\.[1-4]\.{_UNIT}",
    r"encoder\.block\.[1-4]\.block\.3\.alpha",
    rf"encoder\.block\.[1-4]\.block\.4\.{_CONV}",
    rf"encoder\.block\.4\.block\.5\.({_LAYER})",
    r"encoder\.block\.5\.alpha",
    rf"encoder\.block\.6\.{_CONV}",
    rf"quantizer\.semantic_quantizer\.{_VQ}",
    rf"quantizer\.quantizer\.{_VQ}",
    r"quantizer\.(downsample|upsample)\.[01]\.0\.conv\.(weight|bias)",
    rf"quantizer\.(downsample|upsample)\.[01]\.{_CONVNEXT}",
    rf"quantizer\.(pre|post)_module\.({_LAYER})",
    rf"decoder\.model\.0\.{_CONV}",
    r"decoder\.model\.[1-4]\.block\.0\.alpha",
    rf"decoder\.model\.[1-4]\.block\.1\.{_CONV}",
    rf"decoder\.model\.[1-4]\.{_DEC_UNIT}",
    r"decoder\.model\.5\.alpha",
    rf"decoder\.model\.6\.{_CONV}",
]


def test_real_codec_layout_on_meta_device():
    """The real constants give 535 original tensors (~391.4 M parameters) named as in
    docs/format.md#codec-file-keys, loadable."""
    config = FishDACConfig()
    shapes = original_codec_key_shapes(config)
    assert len(shapes) == 535
    assert sum(math.prod(shape) for shape in shapes.values()) == pytest.approx(391.4e6, abs=0.05e6)
    unmatched = [key for key in shapes if not any(re.fullmatch(p, key) for p in ORIGINAL_KEY_PATTERNS)]
    assert unmatched == []
    assert len([k for k in shapes if k.startswith("quantizer.quantizer.quantizers.")]) == 9 * 7
    assert len([k for k in shapes if ".layers." in k and k.startswith("quantizer.pre_module")]) == 8 * 9
    assert shapes["quantizer.semantic_quantizer.quantizers.0.codebook.weight"] == (4096, 8)
    assert shapes["decoder.model.1.block.1.conv.parametrizations.weight.original1"] == (1536, 768, 16)
    assert shapes["encoder.block.4.block.5.layers.3.attention.wqkv.weight"] == (3 * 1024, 1024)
    with torch.device("meta"):
        codec = FishDACCodec(config)
        codec.load_original_state_dict({key: torch.empty(shape) for key, shape in shapes.items()})


def test_tiny_layout_equals_the_golden_codec_pth(tiny_config):
    golden = torch.load(CODEC_PTH, weights_only=True)
    assert {k: tuple(v.shape) for k, v in golden.items()} == original_codec_key_shapes(tiny_config)


def weight_normed(module, g, v):
    """A torch module with the reference's weight-norm parametrization, holding g (original0) and v (original1)."""
    module = torch.nn.utils.parametrizations.weight_norm(module, dim=0)
    with torch.no_grad():
        module.parametrizations.weight.original0.copy_(g)
        module.parametrizations.weight.original1.copy_(v)
    return module


def test_folded_weight_norm_equals_unfolded_modules(codec):
    state = load_codec_state_dict(CODEC_PTH)
    x = torch.randn(2, 16, 40)
    # Decoder transposed conv [in 16, out 8, k 16]: g is per INPUT channel (dim 0).
    prefix = "decoder.model.2.block.1.conv.parametrizations.weight."
    g, v = state[prefix + "original0"], state[prefix + "original1"]
    assert g.shape == (16, 1, 1)
    reference = weight_normed(torch.nn.ConvTranspose1d(16, 8, 16, stride=8), g, v)
    reference.bias.data.copy_(state["decoder.model.2.block.1.conv.bias"])
    folded = codec.decoder.blocks[1].upsample
    # Tolerances (tolerances.py): the weight norm sums 8 * 16 squares; the transposed conv 16 inputs * 2 taps.
    wanted = reference(x)[..., : 40 * 8]
    torch.testing.assert_close(folded(x), wanted, **reordering_tolerance(wanted, 8 * 16 + 16 * 2 + 2))
    wanted = g * v / v.norm(dim=(1, 2), keepdim=True)
    torch.testing.assert_close(folded.weight, wanted, **reordering_tolerance(wanted, 8 * 16 + 2))
    # Encoder conv (k7 dilated 3) of a residual unit: g per output channel.
    prefix = "encoder.block.3.block.1.block.1.conv."
    g, v = state[prefix + "parametrizations.weight.original0"], state[prefix + "parametrizations.weight.original1"]
    reference = weight_normed(torch.nn.Conv1d(16, 16, 7, dilation=3), g, v)
    reference.bias.data.copy_(state[prefix + "bias"])
    folded = codec.encoder.blocks[2].residual_units[1].conv1
    assert isinstance(folded, FishDACCausalConv1d)
    # The weight norm sums 16 * 7 squares, the conv 16 inputs * 7 taps.
    wanted = reference(F.pad(x, (18, 0)))
    torch.testing.assert_close(folded(x), wanted, **reordering_tolerance(wanted, 16 * 7 + 16 * 7 + 2))
    wanted = g * v / v.norm(dim=(1, 2), keepdim=True)
    torch.testing.assert_close(folded.weight, wanted, **reordering_tolerance(wanted, 16 * 7 + 2))


def test_vq_out_proj_folded_into_table(codec):
    state = load_codec_state_dict(CODEC_PTH)
    prefix = "quantizer.quantizer.quantizers.4."
    out_proj = weight_normed(torch.nn.Conv1d(8, 64, 1), state[prefix + "out_proj.weight_g"],
                             state[prefix + "out_proj.weight_v"])
    out_proj.bias.data.copy_(state[prefix + "out_proj.bias"])
    ids = torch.tensor([[0, 5, 31, 7]])
    reference = out_proj(F.embedding(ids, state[prefix + "codebook.weight"]).transpose(1, 2))  # [1, 64, 4]
    vq = codec.quantizer.codebooks[5]
    assert isinstance(vq, FishDACVectorQuantizer) and vq.table.shape == (32, 64)
    # The weight norm sums 8 squares, the 1x1 conv 8 inputs (tolerances.py).
    torch.testing.assert_close(vq.decode(ids), reference, **reordering_tolerance(reference, 8 + 8 + 2))


def test_random_original_state_dict(tiny_config):
    state = random_original_codec_state_dict(tiny_config, torch.Generator().manual_seed(0))
    assert {k: tuple(v.shape) for k, v in state.items()} == original_codec_key_shapes(tiny_config)
    assert all(v.dtype == torch.float32 for v in state.values())
    alphas = torch.cat([v.flatten() for k, v in state.items() if k.endswith("alpha")])
    assert 0.5 <= alphas.min() and alphas.max() <= 1.5
    gains = torch.cat([v.flatten() for k, v in state.items() if k.endswith(("original0", "weight_g"))])
    assert not torch.isclose(gains, torch.ones(())).any()
    scales = torch.cat([v for k, v in state.items() if k.endswith("layer_scale.gamma")])
    assert 0.1 <= scales.min() and scales.max() <= 0.5
    again = random_original_codec_state_dict(tiny_config, torch.Generator().manual_seed(0))
    assert all(torch.equal(state[k], again[k]) for k in state)
    codec = FishDACCodec(tiny_config)
    codec.load_original_state_dict(state)
    audio = codec.decode(random_codes(tiny_config, 8)).audio_values[:, 0]
    assert torch.isfinite(audio).all()
    assert 0.05 < audio.std() < 0.7 and (audio.abs() > 0.99).float().mean() < 0.01


# --------------------------------------------------------------------------------------------------------------
# Loading codec.pth
# --------------------------------------------------------------------------------------------------------------


def test_load_wrapped_prefixed_state_dict_with_causal_masks(tmp_path, codec, expected, tiny_config):
    state = torch.load(CODEC_PTH, weights_only=True)
    wrapped = {f"generator.{k}": v for k, v in state.items()}
    wrapped["generator.quantizer.pre_module.causal_mask"] = torch.ones(4, 4, dtype=torch.bool)
    torch.save({"state_dict": wrapped}, tmp_path / "codec.pth")
    loaded = FishDACCodec.from_codec_file(tmp_path / "codec.pth", tiny_config)
    assert torch.equal(loaded.decode(expected["codec_codes"][None]).audio_values[:, 0], codec.decode(expected["codec_codes"][None]).audio_values[:, 0])


def test_load_legacy_non_mmap_file(tmp_path):
    state = torch.load(CODEC_PTH, weights_only=True)
    torch.save(state, tmp_path / "legacy.pth", _use_new_zipfile_serialization=False)
    loaded = load_codec_state_dict(tmp_path / "legacy.pth")
    assert loaded.keys() == state.keys() and all(torch.equal(loaded[k], state[k]) for k in state)


def test_missing_key_is_named(tiny_config):
    state = load_codec_state_dict(CODEC_PTH)
    del state["decoder.model.3.block.2.block.1.conv.bias"]
    with pytest.raises(FishDACLoadError, match=r"1 missing keys \['decoder\.model\.3\.block\.2\.block\.1\.conv\.bias'\]"):
        FishDACCodec(tiny_config).load_original_state_dict(state)


def test_unexpected_key_is_named(tiny_config):
    state = load_codec_state_dict(CODEC_PTH)
    state["decoder.model.7.alpha"] = torch.ones(1, 1, 1)
    with pytest.raises(FishDACLoadError, match=r"1 unexpected keys \['decoder\.model\.7\.alpha'\]"):
        FishDACCodec(tiny_config).load_original_state_dict(state)


def test_wrong_shape_is_named(tiny_config):
    state = load_codec_state_dict(CODEC_PTH)
    state["quantizer.semantic_quantizer.quantizers.0.codebook.weight"] = torch.zeros(4096, 8)
    with pytest.raises(FishDACLoadError, match=r"codebook\.weight: expected \[64, 8\], got \[4096, 8\]"):
        FishDACCodec(tiny_config).load_original_state_dict(state)


def test_real_config_refuses_tiny_checkpoint():
    with torch.device("meta"):
        codec = FishDACCodec(FishDACConfig())
    with pytest.raises(FishDACLoadError, match="missing keys"):
        codec.load_original_state_dict(load_codec_state_dict(CODEC_PTH))


class _WritesAFile:
    """A pickle payload: unpickling it with full pickle would create the file `path`."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


@pytest.mark.parametrize("zip_format", [True, False])
def test_pickle_payload_is_refused_and_not_run(tmp_path, zip_format):
    marker = tmp_path / "payload_ran"
    state = {"decoder.model.5.alpha": torch.ones(1, 2, 1), "evil": _WritesAFile(marker)}
    torch.save(state, tmp_path / "codec.pth", _use_new_zipfile_serialization=zip_format)
    assert not marker.exists()
    with pytest.raises(FishDACLoadError, match="refused"):
        load_codec_state_dict(tmp_path / "codec.pth")
    assert not marker.exists()


def test_non_state_dict_files_are_refused(tmp_path):
    (tmp_path / "garbage.pth").write_bytes(b"not a checkpoint")
    with pytest.raises(FishDACLoadError, match="refused"):
        load_codec_state_dict(tmp_path / "garbage.pth")
    torch.save([torch.ones(2)], tmp_path / "list.pth")
    with pytest.raises(FishDACLoadError, match="does not hold a state dict"):
        load_codec_state_dict(tmp_path / "list.pth")
    with pytest.raises(FileNotFoundError):
        load_codec_state_dict(tmp_path / "absent.pth")


# --------------------------------------------------------------------------------------------------------------
# Memory: the codec built in place from codec.pth, its encoding side loaded on first use
# --------------------------------------------------------------------------------------------------------------

ENCODING_SIDE_PREFIXES = ("encoder.", "quantizer.downsample.", "quantizer.pre_module.")


@pytest.fixture
def waiting(tiny_config):
    """A codec whose encoding side waits for first use, as `FishOmniForSpeech.from_pretrained` loads it."""
    return FishDACCodec.from_codec_file(CODEC_PTH, tiny_config, defer_encoding_side=True)


def test_a_waiting_encoding_side_holds_no_weights_and_decoding_needs_none(waiting, codec, expected):
    assert not waiting.encoding_side_loaded
    assert waiting.encoder is None and waiting.quantizer.downsample is None and waiting.quantizer.pre_module is None
    assert not any(name.startswith(ENCODING_SIDE_PREFIXES) for name, _ in waiting.named_parameters())
    codes = expected["codec_codes"][None]
    assert torch.equal(waiting.decode(codes).audio_values, codec.decode(codes).audio_values)
    assert torch.equal(waiting.stream().decode(codes).audio_values, codec.stream().decode(codes).audio_values)
    assert not waiting.encoding_side_loaded


def test_the_first_encode_loads_the_encoding_side_and_gives_the_golden_codes(waiting, codec, expected):
    codes = waiting.encode(expected["codec_input_audio"], 44100).audio_codes
    assert waiting.encoding_side_loaded
    assert torch.equal(codes[0], expected["codec_encoded"])
    assert waiting.state_dict().keys() == codec.state_dict().keys()
    assert all(torch.equal(a, b) for a, b in zip(waiting.state_dict().values(), codec.state_dict().values()))
    assert not waiting.encoder.training and not waiting.quantizer.pre_module.training  # the codec's eval mode


def test_bad_audio_is_refused_before_the_encoding_side_loads(waiting):
    with pytest.raises(ValueError, match="NaN"):
        waiting.encode(torch.tensor([0.1, float("nan")] * 100), 44100)
    assert not waiting.encoding_side_loaded


def test_an_encoding_side_first_loaded_in_inference_mode_holds_ordinary_weights(waiting, expected):
    """The processor encodes in `torch.inference_mode()`: weights made there would be inference tensors for good."""
    with torch.inference_mode():
        waiting.encode(expected["codec_input_audio"], 44100)
    assert not any(p.is_inference() for p in waiting.encoder.parameters())
    waiting.encoder(torch.zeros(1, 1, 2048)).sum().backward()  # autograd takes them (fine-tuning after cloning)


def test_the_encoding_side_loads_in_the_codecs_dtype(waiting, codec64, expected):
    waiting.double()  # before the encoding side exists: it joins in the dtype of the codebooks' input projections
    codes = waiting.encode(expected["codec_input_audio"], 44100).audio_codes
    assert waiting.encoder.input_conv.weight.dtype == torch.float64
    assert torch.equal(codes, codec64.encode(expected["codec_input_audio"], 44100).audio_codes)


def test_threads_encoding_at_once_load_the_encoding_side_once(waiting, expected, monkeypatch):
    """The server encodes references from several threads: one load, the same codes everywhere."""
    loads, calls = [], modeling_codec.folded_state_dict
    monkeypatch.setattr(modeling_codec, "folded_state_dict", lambda *a, **k: loads.append(1) or calls(*a, **k))
    barrier, results = threading.Barrier(4), []

    def encode():
        barrier.wait()
        results.append(waiting.encode(expected["codec_input_audio"], 44100).audio_codes[0])

    threads = [threading.Thread(target=encode) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(loads) == 1 and len(results) == 4
    assert all(torch.equal(codes, expected["codec_encoded"]) for codes in results)


def test_saving_and_loading_weights_complete_a_waiting_codec(tiny_config, codec, expected, tmp_path):
    """`original_state_dict` (what `save_pretrained` writes), `state_dict` and loads of whole state dicts load the
    encoding side first: none of its weights is missing from a save or left unloaded."""
    waiting = FishDACCodec.from_codec_file(CODEC_PTH, tiny_config, defer_encoding_side=True)
    assert original_codec_key_shapes(tiny_config).keys() == waiting.original_state_dict().keys()
    waiting = FishDACCodec.from_codec_file(CODEC_PTH, tiny_config, defer_encoding_side=True)
    waiting.save_pretrained(tmp_path)
    reloaded = FishDACCodec.from_pretrained(tmp_path)
    assert torch.equal(reloaded.encode(expected["codec_input_audio"], 44100).audio_codes[0], expected["codec_encoded"])
    loads = [lambda target: load_codec_weights(target, codec.state_dict()),  # the folded layout
             lambda target: load_codec_weights(target, load_codec_state_dict(CODEC_PTH)),  # the original one
             lambda target: target.load_state_dict(codec.state_dict())]
    for load in loads:
        target = FishDACCodec.from_codec_file(CODEC_PTH, tiny_config, defer_encoding_side=True)
        load(target)
        assert target.encoding_side_loaded
        assert torch.equal(target.encode(expected["codec_input_audio"], 44100).audio_codes[0], expected["codec_encoded"])


def test_a_copy_of_a_waiting_codec_loads_its_own_encoding_side(waiting, expected):
    other = copy.deepcopy(waiting)
    assert torch.equal(other.encode(expected["codec_input_audio"], 44100).audio_codes[0], expected["codec_encoded"])
    assert other.encoding_side_loaded and not waiting.encoding_side_loaded


def test_a_waiting_codec_keeps_the_weights_of_the_file_it_was_loaded_from(tiny_config, expected, tmp_path):
    """`write_codec_file` replaces the file (a new file renamed over it): a codec loaded from the old one keeps its
    memory maps of the old file, so its weights, waiting ones included, are those it was loaded with."""
    path = tmp_path / "codec.pth"
    path.write_bytes(CODEC_PTH.read_bytes())
    waiting = FishDACCodec.from_codec_file(path, tiny_config, defer_encoding_side=True)
    other = FishDACCodec(tiny_config)
    other.load_original_state_dict(random_original_codec_state_dict(tiny_config, torch.Generator().manual_seed(5)))
    write_codec_file(other, tmp_path)
    assert sorted(os.listdir(tmp_path)) == ["codec.pth"]  # no temporary file left behind
    assert torch.equal(waiting.encode(expected["codec_input_audio"], 44100).audio_codes[0], expected["codec_encoded"])
    audio = waiting.decode(expected["codec_codes"][None]).audio_values[0, 0]
    torch.testing.assert_close(audio, expected["codec_audio"], atol=1e-4, rtol=0)
    reloaded = FishDACCodec.from_codec_file(path, tiny_config)
    assert all(torch.equal(a, b) for a, b in zip(reloaded.state_dict().values(), other.state_dict().values()))


def _file_mapped_bytes(tensors, path) -> int:
    """Bytes of `tensors` that lie in a memory map of the file `path` (Linux's /proc/self/maps, where the package's CI
    runs)."""
    with open("/proc/self/maps") as maps:
        ranges = [tuple(int(end, 16) for end in line.split()[0].split("-")) for line in maps
                  if line.rstrip().endswith(str(path))]
    return sum(t.numel() * t.element_size() for t in tensors if any(low <= t.data_ptr() < high for low, high in ranges))


def test_weights_that_need_no_folding_are_the_files_own_pages(tiny_config):
    """Built in place: the windowed transformers, convs without weight norm, biases and Snake parameters are views of
    the memory-mapped codec.pth (no second copy while loading); folded weights (weight norm, lookup tables) are not."""
    path = CODEC_PTH.resolve()
    codec = FishDACCodec.from_codec_file(path, tiny_config)
    stored = list(codec.quantizer.post_module.parameters()) + [codec.decoder.input_conv.bias]
    assert _file_mapped_bytes(stored, path) == sum(p.numel() * 4 for p in stored)
    folded = [codec.decoder.input_conv.weight, codec.quantizer.codebooks[0].table]
    assert _file_mapped_bytes(folded, path) == 0


def test_folded_state_dict_takes_stored_tensors_as_they_are_and_folds_from_the_second_map(tiny_config):
    with torch.device("meta"):
        target = FishDACCodec(tiny_config)
    kept, read = memory_maps(CODEC_PTH, 2)
    folded = folded_state_dict(target, kept, read)
    name = "quantizer.post_module.layers.0.attention.wqkv.weight"
    assert folded[name] is kept[name]
    g, v = (read[f"decoder.model.0.conv.parametrizations.weight.original{i}"] for i in (0, 1))
    torch.testing.assert_close(folded["decoder.input_conv.weight"], g * v / v.norm(dim=(1, 2), keepdim=True),
                               **reordering_tolerance(v, v[0].numel() + 2))


def test_a_legacy_file_cannot_be_mapped_and_loads_whole(tiny_config, expected, tmp_path):
    torch.save(torch.load(CODEC_PTH, weights_only=True), tmp_path / "legacy.pth", _use_new_zipfile_serialization=False)
    assert memory_maps(tmp_path / "legacy.pth", 2) is None
    codec = FishDACCodec.from_codec_file(tmp_path / "legacy.pth", tiny_config, defer_encoding_side=True)
    assert codec.encoding_side_loaded
    assert torch.equal(codec.encode(expected["codec_input_audio"], 44100).audio_codes[0], expected["codec_encoded"])


# --------------------------------------------------------------------------------------------------------------
# Bad inputs
# --------------------------------------------------------------------------------------------------------------


def test_wrong_number_of_codebooks(codec):
    with pytest.raises(ValueError, match=r"\[batch, 10, frames\]"):
        codec.decode(torch.zeros(1, 9, 4, dtype=torch.long))
    with pytest.raises(ValueError, match=r"\[batch, 10, frames\]"):
        codec.decode(torch.zeros(10, 4, dtype=torch.long))
    with pytest.raises(ValueError, match=r"\[batch, 10, frames\]"):
        codec.stream().decode(torch.zeros(1, 11, 4, dtype=torch.long))


def test_negative_and_float_codes(codec):
    codes = torch.zeros(1, 10, 4, dtype=torch.long)
    codes[0, 3, 2] = -1
    with pytest.raises(ValueError, match=r"out of range \[0, codebook size\): min -1"):
        codec.decode(codes)
    with pytest.raises(ValueError, match="out of range"):
        codec.stream().decode(codes)
    with pytest.raises(ValueError, match="integer ids"):
        codec.decode(torch.zeros(1, 10, 4))
    with pytest.raises(ValueError, match="either `audio`"):
        codec()


def test_codes_above_codebook_size_are_clamped(codec, tiny_config):
    codes = random_codes(tiny_config, 4)
    codes[0, 0, 0], codes[0, 2, 1] = 63, 31  # last entries of the semantic (64) and residual (32) codebooks
    big = codes.clone()
    big[0, 0, 0], big[0, 2, 1] = 10_000, 500
    assert torch.equal(codec.decode(big).audio_values[:, 0], codec.decode(codes).audio_values[:, 0])


@pytest.fixture
def encoder_guard(codec, monkeypatch):
    """Fails the test if the encoder network runs (bad audio must be refused before any heavy work)."""

    def forbidden(*args, **kwargs):
        raise AssertionError("the encoder ran on invalid audio")

    monkeypatch.setattr(codec.encoder, "forward", forbidden)
    return codec


@pytest.mark.parametrize(
    ("audio", "error", "match"),
    [
        (torch.zeros(0), ValueError, "empty"),
        (torch.zeros(2, 0), ValueError, "empty"),
        (torch.zeros(1, 0, 4096), ValueError, "empty"),
        (torch.tensor([0.1, float("nan"), 0.2] * 100), ValueError, "NaN or infinite"),
        (torch.tensor([0.1, float("inf"), 0.2] * 100), ValueError, "NaN or infinite"),
        (torch.zeros(4096, dtype=torch.int16), TypeError, "floating point"),
        (np.zeros(4096, dtype=np.int32), TypeError, "floating point"),
        (torch.zeros(4096, 2), ValueError, r"\[samples, channels\]"),
        (torch.zeros(1, 1, 1, 4096), ValueError, "must be"),
        ("not audio", TypeError, "torch.Tensor or numpy"),
    ],
)
def test_bad_audio_is_refused_before_encoding(encoder_guard, audio, error, match):
    with pytest.raises(error, match=match):
        encoder_guard.encode(audio, 44100)


@pytest.mark.parametrize("rate", [0, -44100, 44100.0, None])
def test_bad_sampling_rate(encoder_guard, rate):
    with pytest.raises(ValueError, match="sampling_rate"):
        encoder_guard.encode(torch.zeros(4096), rate)


def test_stereo_is_averaged_to_mono(codec, expected):
    mono = expected["codec_input_audio"][:8192]
    stereo = torch.stack([2 * mono, torch.zeros_like(mono)])[None]  # [batch 1, channels 2, samples]; mean is exact
    assert torch.equal(codec.encode(stereo, 44100).audio_codes, codec.encode(mono, 44100).audio_codes)
    assert torch.equal(codec.encode(mono.numpy(), 44100).audio_codes, codec.encode(mono[None], 44100).audio_codes)
    assert torch.equal(codec.encode(stereo[0], 44100).audio_codes, codec.encode(mono, 44100).audio_codes)  # [2, L]


def test_encode_shape_pads_to_whole_frames(codec):
    audio = 0.1 * torch.randn(2, 1, 3 * 2048 + 1, generator=torch.Generator().manual_seed(0))  # [batch, 1, samples]
    assert codec.encode(audio, 44100).audio_codes.shape == (2, 10, 4)
    assert codec.encode(audio[:, 0], 44100).audio_codes.shape == (1, 10, 4)  # 2-D is [channels, samples]: one recording


def test_other_sample_rate_is_resampled(codec, expected):
    audio = expected["codec_input_audio"][:16384]
    at_48k = resample_audio(audio, 44100, 48000)
    assert at_48k.shape == (round(16384 * 48000 / 44100),)
    back = resample_audio(at_48k, 48000, 44100)
    assert back.shape == (16384,)  # round(17833 * 44100 / 48000)
    codes = codec.encode(at_48k, sampling_rate=48000).audio_codes
    assert codes.shape == (1, 10, 8)  # resampled back to 16384 samples: 8 frames of 2048
    assert torch.equal(codes, codec.encode(back, 44100).audio_codes)


def sine(frequency, rate, samples, phase=0.3):
    return torch.sin(2 * math.pi * frequency * torch.arange(samples, dtype=torch.float64) / rate + phase)


@pytest.mark.parametrize(("orig", "target"), [(48000, 44100), (22050, 44100), (16000, 44100), (44100, 24000)])
def test_resampler_keeps_in_band_tones(orig, target):
    tone = sine(1000.0, orig, orig // 4) + 0.5 * sine(3100.0, orig, orig // 4)
    out = resample_audio(tone, orig, target)
    samples = round(tone.shape[0] * target / orig)
    ideal = sine(1000.0, target, samples) + 0.5 * sine(3100.0, target, samples)
    assert out.shape == (samples,) and out.dtype == torch.float64
    edge = target // 100  # the filter sees zeros beyond the ends
    # soxr's precision (SOXR_VHQ_PRECISION) of full scale, on tones of amplitude 1 + 0.5.
    torch.testing.assert_close(out[edge:-edge], ideal[edge:-edge], atol=1.5 * SOXR_VHQ_PRECISION, rtol=0)


def test_resampler_removes_tones_above_the_new_nyquist():
    tone = sine(23500.0, 48000, 12000)  # above 22050 Hz: must not alias into the 44.1 kHz output
    out = resample_audio(tone, 48000, 44100)
    # soxr's stop band starts at the new Nyquist frequency: an amplitude-1 tone past it is rejected by 175 dB.
    assert out[500:-500].abs().max() < SOXR_VHQ_REJECTION


def test_resampler_rejects_bad_rates():
    with pytest.raises(ValueError, match="positive"):
        resample_audio(torch.zeros(100), 0, 44100)


def test_resampler_batches_and_identity():
    audio = torch.randn(3, 2, 1000)
    assert resample_audio(audio, 44100, 44100) is audio
    out = resample_audio(audio, 32000, 44100)
    assert out.shape == (3, 2, round(1000 * 44100 / 32000)) and out.dtype == torch.float32
    single = resample_audio(audio[1, 0], 32000, 44100)
    # float64 inside, then one rounding to float32 each: at most 2 u of the largest sample apart.
    torch.testing.assert_close(out[1, 0], single, **reordering_tolerance(single, 1))


def test_pickle_marker_helper_really_writes(tmp_path):
    """Sanity check of the payload used above: full (unsafe) unpickling does create the file."""
    import pickle

    marker = tmp_path / "ran"
    pickle.loads(pickle.dumps(_WritesAFile(marker))).close()
    assert os.path.exists(marker)


def test_the_original_layout_written_back_loads_to_the_same_weights_bit_for_bit(tiny_config):
    """`original_state_dict` unfolds weight norm (v = W, g = the norms `torch._weight_norm` computes) and the VQ
    output projections: the original `codec.pth` keys and shapes, folded back to exactly the same codec."""
    codec = FishDACCodec.from_codec_file(GOLDEN_TINY / "codec.pth", tiny_config)
    original = codec.original_state_dict()
    assert {name: tuple(tensor.shape) for name, tensor in original.items()} == original_codec_key_shapes(tiny_config)
    again = FishDACCodec.from_codec_state_dict(original, tiny_config)
    assert all(torch.equal(a, b) for a, b in zip(codec.state_dict().values(), again.state_dict().values()))
