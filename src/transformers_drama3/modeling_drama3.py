"""`FishOmniForSpeech`: the Drama 3 model (backbone + lm_head + codebook tower + codec) and its loading.

The backbone *is* transformers' `Qwen3_5MoeTextModel` (composed, not copied). `from_pretrained` reads the
original `fishaudio/drama-3` layout: sharded safetensors with the original names (renamed by the registered
conversion mapping, FP8 experts dequantised by the `bsgemm-moe` quantizer) and `codec.pth` (read with
`weights_only=True`). Before any weight is read it checks the config (SPEC 2.1) and the safetensors headers.
"""

from __future__ import annotations

import inspect
import math
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import DynamicCache, PreTrainedModel
from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeTextModel
from transformers.utils import ModelOutput

from .checkpoint_mapping import (
    CODEC_PREFIX,
    Drama3CheckpointError,
    check_checkpoint_tensors,
    checkpoint_shards,
    expected_checkpoint_tensors,
)
from .configuration_drama3 import FishOmniConfig
from .device_placement import execution_device, pin_codec_to_main_device, warn_about_codec_entries
from .generation_drama3 import Drama3GenerationMixin
from .modeling_codec import FishDACCodec, FishDACLoadError, load_codec_state_dict
from .modeling_tower import Drama3CodebookTower, Drama3TowerCache, Drama3ZeroCenteredNorm
from .quantization_bsgemm import BSGEMM_MOE, checkpoint_quant_method, prepare_quantization

CODEC_FILE = "codec.pth"
IGNORE_INDEX = -100
# transformers >= 5.24 names the backbone's cache argument `cache`; 5.17 calls it `past_key_values`.
_BACKBONE_CACHE_ARG = "cache" if "cache" in inspect.signature(Qwen3_5MoeTextModel.forward).parameters else "past_key_values"


@dataclass
class Drama3SpeechOutput(ModelOutput):
    """Output of the teacher-forced `FishOmniForSpeech.forward`.

    loss: `main_loss + codebook_loss` when `labels` are given.
    main_loss: mean cross-entropy of the main token of each row whose next label row is EOS or an audio row.
    codebook_loss: mean cross-entropy over codebooks 1..NCB-1 of each audio label row.
    main_logits: `[B, T, V + 1]`, row `t` predicts the main token of row `t + 1`; column 0 is EOS, column
        `1 + c` is `<|semantic:c|>` (`FishOmniForSpeech.main_candidate_ids` gives the token ids).
    codebook_logits: `[B, T, NCB - 1, V]`, aligned with the rows they predict: `[b, t, j]` are the logits of
        codebook `j + 1` of row `t`, computed by the tower from row `t - 1`'s hidden state and row `t`'s own
        earlier codes. Row 0 of a pass without a previous row (no cache, or an empty one) has none: zeros.
    last_hidden_state: `[B, T, D]`, the backbone's final-norm output (what `lm_head` and the tower read).
    cache: the backbone's cache (`DynamicCache`), when caching.
    tower_cache: the tower's `Drama3TowerCache`, when caching.
    """

    loss: torch.Tensor | None = None
    main_loss: torch.Tensor | None = None
    codebook_loss: torch.Tensor | None = None
    main_logits: torch.Tensor | None = None
    codebook_logits: torch.Tensor | None = None
    last_hidden_state: torch.Tensor | None = None
    cache: DynamicCache | None = None
    tower_cache: Drama3TowerCache | None = None


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


class FishOmniForSpeech(FishOmniPreTrainedModel, Drama3GenerationMixin):
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
        self._init_generation_config()
        self.post_init()

    def main_candidate_ids(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """Token ids of the main-token candidates `[V + 1]`: EOS, then the semantic band (`main_logits` columns)."""
        band = torch.arange(self.config.semantic_start_token_id, self.config.semantic_end_token_id + 1, device=device)
        return torch.cat((torch.tensor([self.config.eos_token_id], device=device), band))

    def main_logits(self, hidden: torch.Tensor, candidates: torch.Tensor | None = None) -> torch.Tensor:
        """Main-token logits `[..., V + 1]` (column 0 EOS, then the semantic band) of final-norm hidden states
        `[..., D]`; `candidates` are `main_candidate_ids` when already at hand."""
        candidates = self.main_candidate_ids(hidden.device) if candidates is None else candidates
        return self.lm_head(hidden).index_select(-1, candidates)

    @property
    def input_device(self) -> torch.device:
        """Where frame rows must be: the input embedding's execution device (its accelerate hook's device when the
        model is dispatched, where offloaded weights sit on the meta device)."""
        return execution_device(self.backbone.embed_tokens)

    def set_experts_implementation(self, experts_implementation: str | dict) -> None:
        """Choose how the backbone runs its routed experts (`"eager"`, `"batched_mm"`, `"grouped_mm"`, ...).

        The experts live in the backbone only, so the choice goes to it (transformers' generic version looks for
        expert layers in this class's own module and refuses).
        """
        self.backbone.set_experts_implementation(experts_implementation)

    # ----------------------------------------------------------------------------------------------------------
    # Frame rows
    # ----------------------------------------------------------------------------------------------------------

    def is_audio_row(self, main_ids: torch.Tensor) -> torch.Tensor:
        """Bool mask: main id inside the semantic band."""
        return self.tower.is_audio(main_ids)

    def embed_frames(self, frames: torch.Tensor) -> torch.Tensor:
        """Backbone input embedding of frame rows (SPEC 4): `frames [B, T, 1 + NCB]` -> `[B, T, D]`.

        Text row: `E[token]`. Audio row: `(E[token] + sum_{i=1..k} C_i[c_i]) / sqrt(1 + k)`, k = vq_backbone_codebooks.
        """
        k = self.config.audio_decoder_config.vq_backbone_codebooks
        tokens = self.backbone.embed_tokens(frames[..., 0])  # [B, T, D]
        if k == 0:
            return tokens
        codes = self.tower.embed_codes(frames.to(execution_device(self.tower)), range(1, k + 1)).to(tokens.device)
        audio = (tokens + codes) / math.sqrt(1 + k)
        return torch.where(self.is_audio_row(frames[..., 0])[..., None], audio, tokens)

    def check_frames(self, frames: torch.Tensor, name: str = "input_ids") -> None:
        """Raise a clear error for frame rows the model cannot read (shape, dtype, ids outside the vocabulary,
        or an audio row whose main id and c0 disagree). Codes outside [0, V-1] are clamped, not refused."""
        ncb = self.config.num_codebooks
        if frames.dim() != 3 or frames.shape[-1] != 1 + ncb:
            raise ValueError(
                f"{name} must be frame rows [batch, rows, {1 + ncb}] ([main_id, c0..c{ncb - 1}], as the processor "
                f"returns them), got shape {tuple(frames.shape)}"
            )
        if frames.dtype.is_floating_point or frames.dtype == torch.bool:
            raise ValueError(f"{name} must hold integer ids, got {frames.dtype}")
        main = frames[..., 0]
        vocab = self.config.text_config.vocab_size
        bad = (main < 0) | (main >= vocab)
        if bad.any():
            raise ValueError(f"{name} has main ids outside the text vocabulary [0, {vocab}): {main[bad][:5].tolist()}")
        audio = self.is_audio_row(main)
        text_with_codes = ~audio & (frames[..., 1:] != 0).any(-1)
        if text_with_codes.any():
            raise ValueError(
                f"{name} has rows with codes but a main id outside the semantic band "
                f"[{self.config.semantic_start_token_id}, {self.config.semantic_end_token_id}] (ids "
                f"{main[text_with_codes][:5].tolist()}): an audio row is [semantic_start + c0, c0, ..., c{ncb - 1}], "
                "a text row has all codes zero"
            )
        mismatch = audio & (main - self.config.semantic_start_token_id != frames[..., 1])
        if mismatch.any():
            raise ValueError(f"{name} has audio rows whose main id is not semantic_start + c0")

    # ----------------------------------------------------------------------------------------------------------
    # Teacher-forced forward
    # ----------------------------------------------------------------------------------------------------------

    def new_caches(self) -> tuple[DynamicCache, Drama3TowerCache]:
        """Empty backbone and tower caches for one request (the tower's may grow to max_position_embeddings)."""
        text = self.config.text_config
        return DynamicCache(config=text), Drama3TowerCache(self.config.audio_decoder_config, text.max_position_embeddings)

    def forward(
        self,
        input_ids: torch.LongTensor,  # [B, T, 1 + NCB] frame rows
        attention_mask: torch.Tensor | None = None,  # [B, past + T], 1 = real row, 0 = left padding
        labels: torch.LongTensor | None = None,  # [B, T, 1 + NCB] frame rows aligned with input_ids
        cache: DynamicCache | None = None,
        tower_cache: Drama3TowerCache | None = None,
        use_cache: bool | None = None,
        past_key_values: DynamicCache | None = None,  # alias of `cache` (the older transformers name)
        **kwargs,
    ) -> Drama3SpeechOutput:
        """Teacher-forced pass over frame rows: main-token and codebook logits, and a loss when `labels` are given.

        With caches (`use_cache=True`, or caches passed in) the rows extend the ones already cached: prefilling N
        rows and then feeding one row at a time gives the same logits as one pass over all rows. `labels` are
        usually `input_ids` itself, with main id -100 on rows to leave out; see `Drama3SpeechOutput` for the loss.
        """
        if kwargs:
            raise TypeError(f"FishOmniForSpeech.forward got unexpected arguments: {sorted(kwargs)}")
        cache = cache if cache is not None else past_key_values
        self.check_frames(input_ids)
        input_ids = input_ids.to(self.input_device)
        attention_mask = attention_mask.to(self.input_device) if attention_mask is not None else None
        labels = labels.to(self.input_device) if labels is not None else None
        batch, rows, _ = input_ids.shape
        if use_cache is None:
            use_cache = cache is not None or tower_cache is not None
        if use_cache and cache is None and tower_cache is None:
            cache, tower_cache = self.new_caches()
        past = cache.get_seq_length() if cache is not None else 0
        self._check_caches(cache, tower_cache, batch)
        limit = self.config.text_config.max_position_embeddings
        if past + rows > limit:
            raise ValueError(
                f"{past} cached + {rows} new rows exceed the backbone's context of {limit} rows "
                "(text_config.max_position_embeddings)"
            )
        attention_mask = self._full_attention_mask(attention_mask, batch, past, rows, input_ids.device)
        position_ids = self.row_positions(attention_mask)[:, past:]  # [B, T]

        hidden = self.run_backbone(input_ids, position_ids, attention_mask, cache if use_cache else None)  # [B, T, D]
        main_logits = self.main_logits(hidden)  # [B, T, V + 1]
        codebook_logits, predicted_rows = self._tower_teacher_forcing(
            hidden, input_ids, position_ids, attention_mask, tower_cache
        )

        output = Drama3SpeechOutput(
            main_logits=main_logits,
            codebook_logits=codebook_logits,
            last_hidden_state=hidden,
            cache=cache if use_cache else None,
            tower_cache=tower_cache if use_cache else None,
        )
        if labels is not None:
            row_mask = attention_mask[:, past:].bool()
            row_mask[:, : rows - predicted_rows] = False  # rows the tower made no prediction for
            output.main_loss, output.codebook_loss = self._losses(main_logits, codebook_logits, input_ids, labels, row_mask)
            output.loss = output.main_loss + output.codebook_loss
        return output

    def run_backbone(
        self,
        frames: torch.Tensor,  # [B, T, 1 + NCB]
        position_ids: torch.Tensor,  # [B, T]
        attention_mask: torch.Tensor | None = None,  # [B, past + T]
        cache: DynamicCache | None = None,
    ) -> torch.Tensor:
        """Backbone final-norm hidden states `[B, T, D]` of frame rows, extending `cache` when one is given."""
        out = self.backbone(
            inputs_embeds=self.embed_frames(frames),
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=cache is not None,
            **{_BACKBONE_CACHE_ARG: cache},
        )
        return out.last_hidden_state

    def _check_caches(self, cache, tower_cache, batch: int) -> None:
        if (cache is None) != (tower_cache is None):
            raise ValueError("pass both caches (`cache` and `tower_cache`) or neither: the tower reads every row too")
        if cache is None:
            return
        lag = 0 if tower_cache.pending_row is None else 1
        if tower_cache.get_seq_length() + lag != cache.get_seq_length():
            raise ValueError(
                f"the backbone cache holds {cache.get_seq_length()} rows but the tower cache "
                f"{tower_cache.get_seq_length() + lag}: they must come from the same earlier passes"
            )
        if tower_cache.pending_row is not None and tower_cache.pending_row[0].shape[0] != batch:
            raise ValueError(
                f"the caches hold {tower_cache.pending_row[0].shape[0]} sequence(s) but input_ids has {batch}; "
                "use new caches (or `batch_select_indices` on both) for another batch"
            )

    @staticmethod
    def row_positions(attention_mask: torch.Tensor) -> torch.Tensor:
        """Positions `[B, S]` of the rows of a left-padded batch: real rows count from 0, padding gets 0.

        The Qwen3.5 backbone does not derive positions from the mask, so every caller passes these explicitly.
        """
        return (attention_mask.cumsum(-1) - 1).clamp(min=0)

    @staticmethod
    def _full_attention_mask(attention_mask, batch: int, past: int, rows: int, device) -> torch.Tensor:
        """`[B, past + T]` mask of real rows (all ones when none is given)."""
        if attention_mask is None:
            return torch.ones(batch, past + rows, dtype=torch.long, device=device)
        if attention_mask.shape != (batch, past + rows):
            raise ValueError(
                f"attention_mask must be [batch, cached rows + new rows] = [{batch}, {past + rows}], got "
                f"{tuple(attention_mask.shape)}"
            )
        return attention_mask.long()

    def _tower_teacher_forcing(self, hidden, frames, position_ids, attention_mask, tower_cache) -> tuple[torch.Tensor, int]:
        """Codebook logits `[B, T, NCB-1, V]` of every row whose previous row is known (this pass or the cache),
        and how many rows (the last ones) that is."""
        batch, rows, _ = frames.shape
        pending = tower_cache.pending_row if tower_cache is not None else None
        if pending is not None:  # the cached last row is labelled by this pass's first row
            hidden_in = torch.cat((pending[0], hidden[:, :-1]), dim=1)
            frames_in = torch.cat((pending[1], frames[:, :-1]), dim=1)
            positions_in = torch.cat((pending[2], position_ids[:, :-1]), dim=1)
            labels_in = frames
        else:
            hidden_in, frames_in, positions_in, labels_in = hidden[:, :-1], frames[:, :-1], position_ids[:, :-1], frames[:, 1:]
        tower_rows = labels_in.shape[1]
        logits = hidden.new_zeros(batch, rows, self.config.num_codebooks - 1, self.config.codebook_size)
        if tower_rows > 0:
            mask = attention_mask[:, : attention_mask.shape[1] - 1]  # rows of the tower inputs (and its cache)
            out = self.tower(hidden_in, frames_in, labels_in, positions_in, mask, tower_cache)
            logits[:, rows - tower_rows :] = out.logits
        if tower_cache is not None:
            tower_cache.pending_row = (hidden[:, -1:], frames[:, -1:], position_ids[:, -1:])
        return logits, tower_rows

    def _losses(self, main_logits, codebook_logits, frames, labels, row_mask) -> tuple[torch.Tensor, torch.Tensor]:
        """Mean cross-entropies over the label rows in `row_mask` (real rows that the pass predicts):
        main tokens of audio labels and of EOS labels that end speech (the row before is audio), and codebooks
        1..NCB-1 of audio labels."""
        if labels.shape != main_logits.shape[:2] + (1 + self.config.num_codebooks,):
            raise ValueError(f"labels must have the shape of input_ids {tuple(main_logits.shape[:2])} + (11,), got {tuple(labels.shape)}")
        start, vocab = self.config.semantic_start_token_id, self.config.codebook_size
        main = labels[..., 0]  # [B, T]
        counted = (main != IGNORE_INDEX) & row_mask
        audio = counted & self.is_audio_row(main)
        main_target = torch.where(audio, main - start + 1, torch.full_like(main, IGNORE_INDEX))
        ends_speech = counted & (main == self.config.eos_token_id)
        ends_speech[:, 1:] &= self.is_audio_row(frames[:, :-1, 0])
        ends_speech[:, 0] = False
        main_target = torch.where(ends_speech, torch.zeros_like(main), main_target)
        main_loss = _mean_cross_entropy(main_logits[:, :-1], main_target[:, 1:])
        codes = labels[..., 2:]  # [B, T, NCB-1] codebooks 1..NCB-1
        if ((codes < 0) | (codes >= vocab))[audio].any():
            raise ValueError(f"labels have codes outside [0, {vocab - 1}] on audio rows")
        code_target = torch.where(audio[..., None], codes, torch.full_like(codes, IGNORE_INDEX))
        return main_loss, _mean_cross_entropy(codebook_logits, code_target)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs):
        """Load a Drama 3 checkpoint: the original layout, or what `save_pretrained` wrote (a local directory or a
        Hub repository id).

        Accepts every keyword of `PreTrainedModel.from_pretrained`: `dtype`; `device_map` (`"auto"` or a dict),
        `max_memory` and `offload_folder` for offloading (the codec always stays whole on the main device, see
        `device_placement`); `quantization_config=BitsAndBytesConfig(...)` for 8-/4-bit dense linears (tower,
        lm_head and codec stay in full precision unless `llm_int8_skip_modules` says otherwise; the FP8 experts are
        dequantised). The codec is loaded from `codec.pth` in float32 whatever `dtype` is; `model.codec.to(...)`
        changes that. See docs/hardware.md.
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
        shards = checkpoint_shards(directory)
        fp8_experts = checkpoint_quant_method(config) == BSGEMM_MOE
        check_checkpoint_tensors(shards, expected_checkpoint_tensors(skeleton, shards, fp8_experts))
        codec_state = load_codec_state_dict(codec_path)
        if isinstance(kwargs.get("device_map"), dict):
            kwargs["device_map"] = dict(kwargs["device_map"])  # the codec gets pinned in it: leave the caller's alone
            warn_about_codec_entries(kwargs["device_map"])
        if kwargs.get("quantization_config") is not None:
            config, kwargs["quantization_config"] = prepare_quantization(
                config, kwargs["quantization_config"], skeleton
            )

        loaded = super().from_pretrained(directory, *model_args, config=config, **kwargs)
        model = loaded[0] if isinstance(loaded, tuple) else loaded
        model.codec.float()  # before loading: float32 weights must not pass through the model's dtype
        load_codec_weights(model.codec, codec_state)
        return loaded

    @staticmethod
    def _load_pretrained_model(model, state_dict, checkpoint_files, load_config, *args, **kwargs):
        """transformers' weight loading, with the codec pinned to the main device of the device map first and the
        dequantised weights brought to the requested dtype afterwards.

        The device map is final here (`"auto"` already resolved) and `from_pretrained` dispatches the model with
        this same dict afterwards, so pinning it in place covers both (see `device_placement`). The weights are
        loaded but not yet dispatched, so the dtype fix also reaches weights that accelerate then keeps in RAM.
        """
        if isinstance(load_config.device_map, dict):
            pin_codec_to_main_device(load_config.device_map, [name for name, _ in model.named_children()])
        loaded = PreTrainedModel._load_pretrained_model(model, state_dict, checkpoint_files, load_config, *args, **kwargs)
        quantizer = load_config.hf_quantizer
        if quantizer is not None and quantizer.pre_quantized and getattr(quantizer.quantization_config, "dequantize", False):
            cast_dequantised_checkpoint(model, load_config.dtype)
        return loaded

    def save_pretrained(self, save_directory, *args, state_dict=None, is_main_process: bool = True, **kwargs):
        """Save a checkpoint that `from_pretrained` loads without any flag.

        Layout: config.json; safetensors with the backbone, lm_head and tower under their **original** names, the
        routed experts one tensor per expert, all in the model's dtype (a dequantised FP8 checkpoint is saved
        dequantised, with no quantization_config); `codec.pth` holding the codec's folded state dict
        (`model.codec.state_dict()`). The tokenizer belongs to the processor: `processor.save_pretrained(...)`.
        `save_original_format=False` writes module names (`backbone.*`, fused experts) instead; that loads too.
        """
        fp8 = [name for name, parameter in self.named_parameters() if parameter.dtype == torch.float8_e4m3fn]
        if fp8:
            raise NotImplementedError(
                f"saving FP8 experts is not supported ({fp8[0]}, ...): load with "
                "`quantization_config=BsgemmMoeConfig(dequantize=True)` to save a dequantised copy, or keep using the "
                "original checkpoint"
            )
        if state_dict is None:
            state_dict = self.state_dict()
        state_dict = {name: tensor for name, tensor in state_dict.items() if not name.startswith(CODEC_PREFIX)}
        # The conversions recorded while loading may include the FP8 dequantisation, which transformers 5.17 cannot
        # reverse ("Undefined Operation encountered!") and newer versions reverse by re-quantising to FP8. The
        # model's plain mapping writes the weights as they are, under their original names.
        self._weight_conversions = get_model_conversion_mapping(self, add_legacy=False)
        super().save_pretrained(save_directory, *args, state_dict=state_dict, is_main_process=is_main_process, **kwargs)
        if is_main_process:
            torch.save(self.codec.state_dict(), os.path.join(save_directory, CODEC_FILE))


def _mean_cross_entropy(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy averaged over the entries of `target` that are not IGNORE_INDEX (0 when there are none)."""
    losses = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), target.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum")
    return losses / (target != IGNORE_INDEX).sum().clamp(min=1)


def cast_dequantised_checkpoint(model: FishOmniForSpeech, dtype: torch.dtype | None) -> None:
    """Give every loaded floating-point weight (codec aside) `dtype`, after a dequantising FP8 load.

    transformers 5.17 keeps every *renamed* weight of a pre-quantized checkpoint in the checkpoint's dtype (bf16)
    whatever `dtype` asks, so a float32 load came out mostly bf16; newer versions already agree (nothing to do).
    After dequantisation no weight is quantized, so all of them take `dtype`. Weights already offloaded to disk
    (meta) were written with the right dtype by transformers.
    """
    if dtype is None:
        return
    for name, parameter in model.named_parameters():
        if not name.startswith(CODEC_PREFIX) and parameter.is_floating_point() and not parameter.is_meta:
            parameter.data = parameter.data.to(dtype)


def load_codec_weights(codec: FishDACCodec, state_dict: dict[str, torch.Tensor]) -> None:
    """Load a `codec.pth` state dict in either layout into `codec`.

    The original layout (SPEC 8.5: weight norm and VQ output projections unfolded) goes through
    `load_original_state_dict`; the folded one that `save_pretrained` writes (`codec.state_dict()`) is recognised by
    its VQ lookup tables (`*.table`, absent from the original layout) and loaded strictly as it is.
    """
    if not any(key.endswith(".table") for key in state_dict):
        codec.load_original_state_dict(state_dict)
        return
    try:
        codec.load_state_dict(state_dict)
    except RuntimeError as error:
        raise FishDACLoadError(
            f"{CODEC_FILE} holds a folded codec state dict that does not match the codec config: {error}"
        ) from error


def _local_checkpoint_directory(name_or_path: str | os.PathLike, kwargs: dict) -> str:
    """A local directory holding the whole checkpoint; Hub repository ids are downloaded first."""
    name_or_path = str(name_or_path)
    if os.path.isdir(name_or_path):
        return name_or_path
    from huggingface_hub import snapshot_download

    hub_kwargs = {key: kwargs[key] for key in ("cache_dir", "revision", "token", "local_files_only") if key in kwargs}
    return snapshot_download(name_or_path, **hub_kwargs)


__all__ = ["Drama3SpeechOutput", "FishOmniForSpeech", "FishOmniPreTrainedModel"]
