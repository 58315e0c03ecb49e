"""`FishOmniForSpeech`: the Drama 3 model (backbone + lm_head + codebook tower + codec) and its loading.

The backbone *is* transformers' `Qwen3_5MoeTextModel` (composed, not copied). `from_pretrained` reads the
original `fishaudio/drama-3` layout: sharded safetensors with the original names (renamed by the registered
conversion mapping, FP8 experts dequantised by the `bsgemm-moe` quantizer) and `codec.pth` (read with
`weights_only=True`). Before any weight is read it checks the config (SPEC 2.1) and the safetensors headers.
"""

from __future__ import annotations

import os

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeTextModel

from .checkpoint_mapping import (
    CODEC_PREFIX,
    Drama3CheckpointError,
    check_checkpoint_tensors,
    checkpoint_shards,
    expected_original_tensors,
)
from .configuration_drama3 import FishOmniConfig
from .modeling_codec import FishDACCodec, load_codec_state_dict
from .modeling_tower import Drama3CodebookTower, Drama3ZeroCenteredNorm
from .quantization_bsgemm import BSGEMM_MOE

CODEC_FILE = "codec.pth"


class FishOmniPreTrainedModel(PreTrainedModel):
    config_class = FishOmniConfig
    base_model_prefix = ""
    main_input_name = "input_ids"
    supports_gradient_checkpointing = False
    # accelerate keeps each of these on one device: a backbone layer, the whole tower, the whole codec.
    _no_split_modules = ["Qwen3_5MoeDecoderLayer", "Drama3CodebookTower", "FishDACCodec"]
    # The codec's weights come from codec.pth, not from the safetensors files.
    _keys_to_ignore_on_load_missing = [r"^codec\."]

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        std = self.config.text_config.initializer_range
        if isinstance(module, Drama3ZeroCenteredNorm):
            module.weight.zero_()  # zero-centred: gain 1 + w = 1
        elif isinstance(module, nn.Linear):
            module.weight.normal_(0.0, std)
        elif isinstance(module, nn.Embedding):
            module.weight.normal_(0.0, std)


class FishOmniForSpeech(FishOmniPreTrainedModel):
    """Drama 3 text-to-speech: frame rows in, main-token and codebook logits out (generation and audio build on it).

    Modules: `backbone` (Qwen3.5-MoE text model), `lm_head` (only the EOS + semantic-band rows are ever used),
    `tower` (the 13-layer codebook tower) and `codec` (the Fish DAC codec, float32 by default).
    """

    def __init__(self, config: FishOmniConfig):
        super().__init__(config)
        text = config.text_config
        self.backbone = Qwen3_5MoeTextModel(text)
        self.lm_head = nn.Linear(text.hidden_size, text.vocab_size, bias=False)
        self.tower = Drama3CodebookTower(config.audio_decoder_config, config.semantic_start_token_id)
        self.codec = FishDACCodec(config.codec_config)
        self.post_init()

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs):
        """Load a Drama 3 checkpoint in the original layout (a local directory or a Hub repository id).

        Accepts every keyword of `PreTrainedModel.from_pretrained` (`dtype`, `device_map`, ...). The codec is
        loaded from `codec.pth` in float32 whatever `dtype` is; `model.codec.to(...)` changes that.
        """
        directory = _local_checkpoint_directory(pretrained_model_name_or_path, kwargs)
        config = kwargs.pop("config", None)
        if config is None:
            config = FishOmniConfig.from_pretrained(directory)
        elif not isinstance(config, FishOmniConfig):
            raise TypeError(f"`config` must be a FishOmniConfig, got {type(config).__name__}")
        codec_path = os.path.join(directory, CODEC_FILE)
        if not os.path.isfile(codec_path):
            raise Drama3CheckpointError(f"checkpoint {directory!r} has no {CODEC_FILE} (the audio codec's weights)")
        with torch.device("meta"):
            skeleton = cls(config)
        quant_method = (getattr(config, "quantization_config", None) or {}).get("quant_method")
        check_checkpoint_tensors(checkpoint_shards(directory), expected_original_tensors(skeleton, quant_method == BSGEMM_MOE))
        codec_state = load_codec_state_dict(codec_path)

        loaded = super().from_pretrained(directory, *model_args, config=config, **kwargs)
        model = loaded[0] if isinstance(loaded, tuple) else loaded
        model.codec.load_original_state_dict(codec_state)
        model.codec.float()
        return loaded


def _local_checkpoint_directory(name_or_path: str | os.PathLike, kwargs: dict) -> str:
    """A local directory holding the whole checkpoint; Hub repository ids are downloaded first."""
    name_or_path = str(name_or_path)
    if os.path.isdir(name_or_path):
        return name_or_path
    from huggingface_hub import snapshot_download

    hub_kwargs = {key: kwargs[key] for key in ("cache_dir", "revision", "token", "local_files_only") if key in kwargs}
    return snapshot_download(name_or_path, **hub_kwargs)


__all__ = ["FishOmniForSpeech", "FishOmniPreTrainedModel"]
