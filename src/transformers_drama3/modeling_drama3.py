"""`FishOmniForSpeech`: the Drama 3 model (backbone + lm_head + codebook tower + codec) and its loading.

The backbone *is* transformers' `Qwen3_5MoeTextModel` (composed, not copied). `from_pretrained` reads the
original `fishaudio/drama-3` layout: sharded safetensors with the original names (renamed by the registered
conversion mapping, FP8 experts kept or dequantised by the `bsgemm-moe` quantizer) and `codec.pth` (read with
`weights_only=True`, see `codec_file`). Before any weight is read it checks the config (docs/format.md#config-rules),
the safetensors headers and `codec.pth`.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import DynamicCache, PreTrainedModel
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeTextModel
from transformers.utils import ModelOutput

from . import compat
from .checkpoint_location import checkpoint_directory
from .checkpoint_mapping import check_checkpoint_tensors, checkpoint_shards, expected_checkpoint_tensors
from .codec_file import (CodecFileStateDict, attach_codec, read_codec_file, take_codec_placement, without_codec,
                         write_codec_file)
from .codes import is_integer_dtype
from .configuration_drama3 import FishOmniConfig
from .generation.continuous_batching import Drama3ContinuousBatchingMixin
from .cpu_path import apply_cpu_path, codec_for_path, cpu_path_for_load, load_dtype
from .mapped_pages import releasing_merges
from .device_placement import execution_device
from .generation.stored_steps import preload_steps
from .generation_drama3 import Drama3GenerationMixin
from .input_checks import (
    IGNORE_INDEX,
    attention_mask_layout,
    check_frame_layout,
    frame_problems,
    label_problems,
    mask_problems,
    raise_first_problem,
)
from .loading import default_dtype
from .modeling_codec import FishDACCodec
from .modeling_tower import Drama3CodebookTower, Drama3TowerCache
from .parallel import ParallelRequest, SplitModelRules
from .quantization_bsgemm import BSGEMM_MOE, checkpoint_quant_method, prepare_quantization

# The backbone's cache keyword on the installed transformers (read once: the frame step is traced by torch.compile).
BACKBONE_CACHE_ARGUMENT = compat.backbone_cache_argument()


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
    # Backbone decoder layers and tower layers are `GradientCheckpointingLayer`s (docs/finetuning.md).
    supports_gradient_checkpointing = True
    # The loss is two means (main tokens, codebooks) over different counts: `Trainer` must not pass
    # `num_items_in_batch`; it scales the loss for gradient accumulation itself.
    accepts_loss_kwargs = False
    # Attention kernels: the backbone's and the tower's attention both run through transformers' attention interface
    # (`attn_implementation="sdpa"` (default), `"eager"`, `"flash_attention_2"`, registered hub kernels).
    _supports_sdpa = True
    _supports_flash_attn = True
    _supports_attention_backend = True
    # Caches passed to forward stay where they are under accelerate dispatch (their layers sit on their own devices).
    _skip_keys_device_placement = ["cache", "tower_cache", "past_key_values"]
    # accelerate keeps each of these on one device: a backbone layer, the whole tower, the whole codec.
    _no_split_modules = ["Qwen3_5MoeDecoderLayer", "Drama3CodebookTower", "FishDACCodec"]

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        """Random weights of what is not a sub-model (the backbone and the tower initialise their own): lm_head."""
        if isinstance(module, (nn.Linear, nn.Embedding)):
            module.weight.normal_(0.0, self.config.text_config.initializer_range)


class CandidateRowsHead(nn.Module):
    """`lm_head` cut to the main-token candidates (`FishOmniForSpeech.keep_candidate_head_rows`): `weight [V + 1, D]`,
    row 0 EOS then the semantic band, so its output is `main_logits` directly. The rest of the text vocabulary is
    gone: such a model cannot be saved (`save_pretrained` refuses) and has no full-vocabulary logits."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=weight.requires_grad)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.weight)  # [..., V + 1]


class FishOmniForSpeech(FishOmniPreTrainedModel, Drama3ContinuousBatchingMixin, Drama3GenerationMixin):
    """Drama 3 text-to-speech: frame rows in, main-token and codebook logits out (generation and audio build on it).

    Modules: `backbone` (Qwen3.5-MoE text model), `lm_head` (only the EOS + semantic-band rows are ever used),
    `tower` (the 13-layer codebook tower) and `codec` (the Fish DAC codec, float32 by default).
    """

    def __init__(self, config: FishOmniConfig, with_codec: bool = True):
        super().__init__(config)
        text = config.text_config
        self.backbone = Qwen3_5MoeTextModel(text)
        self.lm_head = nn.Linear(text.hidden_size, text.vocab_size, bias=False)
        self.tower = Drama3CodebookTower(config.audio_decoder_config, config.semantic_start_token_id)
        # `with_codec=False` is how `from_pretrained` builds the model: the codec comes from codec.pth afterwards, so
        # that transformers' loading, device maps and quantization never meet it (see `codec_file`).
        self.codec = FishDACCodec(config.codec_config) if with_codec else None
        self.cpu_path = None  # the CPU path `from_pretrained` (or `apply_cpu_path`) brought the weights to (cpu_path.py)
        self.post_init()
        self._init_generation_config()  # after post_init, which makes the generation config from the model config

    def main_candidate_ids(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """Token ids of the main-token candidates `[V + 1]`: EOS, then the semantic band (`main_logits` columns)."""
        band = torch.arange(self.config.semantic_start_token_id, self.config.semantic_end_token_id + 1, device=device)
        return torch.cat((torch.tensor([self.config.eos_token_id], device=device), band))

    def candidate_head_weight(self, candidates: torch.Tensor | None = None) -> torch.Tensor | None:
        """The V + 1 candidate rows of `lm_head`'s weight `[V + 1, D]` (a new tensor), or None for a quantised or
        offloaded `lm_head`, which has no plain weight to index. `candidates`: `main_candidate_ids`, when at hand."""
        weight = self.lm_head.weight
        if isinstance(self.lm_head, CandidateRowsHead):  # `keep_candidate_head_rows`: the rows themselves
            return weight.detach().clone()
        if type(self.lm_head) is not nn.Linear or weight.is_meta:
            return None
        candidates = self.main_candidate_ids(weight.device) if candidates is None else candidates
        return weight.index_select(0, candidates.to(weight.device))

    def main_logits(
        self, hidden: torch.Tensor, candidates: torch.Tensor | None = None, head_weight: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Main-token logits `[..., V + 1]` (column 0 EOS, then the semantic band) of final-norm hidden states
        `[..., D]`; `candidates` (`main_candidate_ids`) and `head_weight` (`candidate_head_weight`) when already at
        hand (the frame step keeps both).

        Only the V + 1 candidate rows of `lm_head` are multiplied (the text vocabulary's other rows are never used);
        a quantised or offloaded `lm_head` runs whole and its candidate columns are kept.
        """
        if head_weight is None and isinstance(self.lm_head, CandidateRowsHead):
            return self.lm_head(hidden)  # already the candidate rows, in order
        head_weight = self.candidate_head_weight(candidates) if head_weight is None else head_weight
        if head_weight is not None:
            return F.linear(hidden, head_weight)
        candidates = self.main_candidate_ids(hidden.device) if candidates is None else candidates
        return self.lm_head(hidden).index_select(-1, candidates.to(hidden.device))

    def keep_candidate_head_rows(self) -> None:
        """Replace `lm_head` by its V + 1 main-token candidate rows (`CandidateRowsHead`): generation and the
        teacher-forced `forward` read only those (`main_logits`), and the real model's head shrinks from 1.02 GB to
        17 MB in bf16. `from_pretrained(..., candidate_head_rows_only=True)` does it right after loading."""
        weight = self.lm_head.weight
        if isinstance(self.lm_head, CandidateRowsHead):
            return
        if type(self.lm_head) is not nn.Linear or weight.is_meta:
            raise ValueError(
                "candidate_head_rows_only needs lm_head as a plain linear in memory, but it is "
                f"{'offloaded' if weight.is_meta else type(self.lm_head).__name__}: keep lm_head out of quantisation "
                "(llm_int8_skip_modules) and of offload (device_map), or load without candidate_head_rows_only"
            )
        rows = weight.detach().index_select(0, self.main_candidate_ids(weight.device)).clone()  # [V + 1, D]
        self.lm_head = CandidateRowsHead(rows)

    def get_input_embeddings(self) -> nn.Embedding:
        """The backbone's token embedding (text ids and the main id of audio rows); peft and gradient checkpointing
        hook it."""
        return self.backbone.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.backbone.embed_tokens = value

    @property
    def is_gradient_checkpointing(self) -> bool:
        """Whether activation checkpointing is on, without the FutureWarning of transformers' deprecated alias: peft
        reads this property in `get_peft_model` and `PeftModel.from_pretrained`, where no user can avoid it."""
        return any(getattr(module, "gradient_checkpointing", False) for module in self.modules())

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
        """Backbone input embedding of frame rows (docs/format.md, "Backbone input"): `frames [B, T, 1 + NCB]` -> `[B, T, D]`.

        Text row: `E[token]`. Audio row: `(E[token] + sum_{i=1..k} C_i[c_i]) / sqrt(1 + k)`, k = vq_backbone_codebooks.
        """
        k = self.config.audio_decoder_config.vq_backbone_codebooks
        tokens = self.backbone.embed_tokens(frames[..., 0])  # [B, T, D]
        if k == 0:
            return tokens
        codes = self.tower.embed_codes(frames.to(execution_device(self.tower)), range(1, k + 1)).to(tokens.device)
        audio = (tokens + codes) / math.sqrt(1 + k)
        return torch.where(self.is_audio_row(frames[..., 0])[..., None], audio, tokens)

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
        logits_to_keep: int = 0,
        **kwargs,
    ) -> Drama3SpeechOutput:
        """Teacher-forced pass over frame rows: main-token and codebook logits, and a loss when `labels` are given.

        With caches (`use_cache=True`, or caches passed in) the rows extend the ones already cached: prefilling N
        rows and then feeding one row at a time gives the same logits as one pass over all rows. `labels` are
        usually `input_ids` itself, with main id -100 on rows to leave out; see `Drama3SpeechOutput` for the loss.
        `logits_to_keep=k > 0` computes the logits of the last `k` rows only (as transformers' causal LMs do; 0 keeps
        all): a prefill that only fills the caches skips the heads' work on every other row.
        """
        if kwargs:
            raise TypeError(f"FishOmniForSpeech.forward got unexpected arguments: {sorted(kwargs)}")
        if not isinstance(logits_to_keep, int) or logits_to_keep < 0:
            raise ValueError(f"logits_to_keep must be an integer >= 0 (0 keeps every row), got {logits_to_keep!r}")
        if labels is not None and logits_to_keep:
            raise ValueError("the loss needs the logits of every row: leave logits_to_keep at 0 with labels")
        cache = cache if cache is not None else past_key_values
        if use_cache is None:
            use_cache = cache is not None or tower_cache is not None
        if use_cache and cache is None and tower_cache is None:
            cache, tower_cache = self.new_caches()
        attention_mask, row_mask = self.checked_inputs(input_ids, attention_mask, labels, cache, tower_cache)
        return self._teacher_forced(input_ids, attention_mask, labels, row_mask, cache if use_cache else None,
                                    tower_cache if use_cache else None, logits_to_keep)

    def prefill(self, input_ids, attention_mask, cache=None, tower_cache=None) -> Drama3SpeechOutput:
        """The pass `generate` starts from, on inputs `checked_inputs` has already checked (so they are not read back
        again): rows `[B, T, 1 + NCB]` extend `cache`/`tower_cache` (new ones when None) under the full mask
        `[B, past + T]` that `checked_inputs` returned, keeping the last row's logits only."""
        if cache is None and tower_cache is None:
            cache, tower_cache = self.new_caches()
        return self._teacher_forced(input_ids, attention_mask, None, None, cache, tower_cache, 1)

    def checked_inputs(self, input_ids, attention_mask=None, labels=None, cache=None, tower_cache=None):
        """Check what `forward` takes before any work, reading the data back once (one host sync: the pass itself
        then never waits for the host). Returns the full long attention mask `[B, past + T]` on the input device and,
        with `labels`, the bool mask `[B, T]` of the label rows the loss counts (real rows that the pass predicts)."""
        check_frame_layout(input_ids, "input_ids", self.config.num_codebooks)
        batch, rows, _ = input_ids.shape
        if labels is not None:
            if not isinstance(labels, torch.Tensor) or labels.shape != input_ids.shape:
                raise ValueError(f"labels must have the shape of input_ids {tuple(input_ids.shape)}, got "
                                 f"{tuple(getattr(labels, 'shape', ())) or type(labels).__name__}")
            if not is_integer_dtype(labels.dtype):
                raise ValueError(f"labels must hold integer ids (frame rows, main id {IGNORE_INDEX} to leave a row "
                                 f"out), got {labels.dtype}")
        self._check_caches(cache, tower_cache, batch)
        past = compat.cached_rows(cache) if cache is not None else 0
        limit = self.config.text_config.max_position_embeddings
        if past + rows > limit:
            raise ValueError(
                f"{past} cached + {rows} new rows exceed the backbone's context of {limit} rows "
                "(text_config.max_position_embeddings)"
            )
        device = self.input_device
        mask = attention_mask_layout(attention_mask, batch, past, rows, device)
        problems = frame_problems(input_ids, "input_ids", self.config, self.is_audio_row(input_ids[..., 0]))
        if attention_mask is not None:
            problems += mask_problems(attention_mask)
        row_mask = None
        if labels is not None:
            row_mask = mask[:, past:].to(labels.device).bool()
            if tower_cache is None or tower_cache.pending_row is None:
                row_mask[:, 0] = False  # the tower predicts no codes for a first row without a cached row before it
            problems += label_problems(labels, row_mask, self.config, self.is_audio_row(labels[..., 0].long()))
        raise_first_problem(problems)
        return mask.to(device), row_mask

    def _teacher_forced(self, input_ids, attention_mask, labels, row_mask, cache, tower_cache, logits_to_keep: int):
        """`forward` on checked inputs (`checked_inputs`): the full mask `[B, past + T]`, caches (None: no caching)."""
        input_ids = input_ids.to(self.input_device, torch.long)
        rows = input_ids.shape[1]
        position_ids = self.row_positions(attention_mask)[:, -rows:]  # [B, T]: the mask is [B, past + T]

        hidden = self.run_backbone(input_ids, position_ids, attention_mask, cache)  # [B, T, D]
        kept = min(logits_to_keep, rows) or rows  # rows with logits: the last `kept`
        main_logits = self.main_logits(hidden[:, rows - kept :])  # [B, kept, V + 1]
        codebook_logits = self._tower_teacher_forcing(hidden, input_ids, position_ids, attention_mask, tower_cache, kept)
        output = Drama3SpeechOutput(
            main_logits=main_logits, codebook_logits=codebook_logits, last_hidden_state=hidden, cache=cache,
            tower_cache=tower_cache,
        )
        if labels is not None:
            labels, row_mask = labels.to(self.input_device).long(), row_mask.to(self.input_device)
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
            **{BACKBONE_CACHE_ARGUMENT: cache},
        )
        return out.last_hidden_state

    def _check_caches(self, cache, tower_cache, batch: int) -> None:
        if (cache is None) != (tower_cache is None):
            raise ValueError("pass both caches (`cache` and `tower_cache`) or neither: the tower reads every row too")
        if cache is None:
            return
        lag = 0 if tower_cache.pending_row is None else 1
        if tower_cache.get_seq_length() + lag != compat.cached_rows(cache):
            raise ValueError(
                f"the backbone cache holds {compat.cached_rows(cache)} rows but the tower cache "
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

    def _tower_teacher_forcing(self, hidden, frames, position_ids, attention_mask, tower_cache, kept: int):
        """Codebook logits `[B, kept, NCB-1, V]` of the last `kept` rows (zeros for a row whose previous row is not
        known, in this pass or the cache)."""
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
        logits = hidden.new_zeros(batch, kept, self.config.num_codebooks - 1, self.config.codebook_size)
        if tower_rows > 0:
            mask = attention_mask[:, : attention_mask.shape[1] - 1]  # rows of the tower inputs (and its cache)
            with_logits = min(kept, tower_rows)
            out = self.tower(hidden_in, frames_in, labels_in, positions_in, mask, tower_cache, logits_to_keep=with_logits)
            logits[:, kept - with_logits :] = out.logits
        if tower_cache is not None:
            tower_cache.pending_row = (hidden[:, -1:], frames[:, -1:], position_ids[:, -1:])
        return logits

    def _losses(self, main_logits, codebook_logits, frames, labels, row_mask) -> tuple[torch.Tensor, torch.Tensor]:
        """Mean cross-entropies over the label rows in `row_mask` (real rows that the pass predicts; labels checked by
        `checked_inputs`):
        main tokens of audio labels and of EOS labels that end speech (the row before is audio), and codebooks
        1..NCB-1 of audio labels."""
        start = self.config.semantic_start_token_id
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
        code_target = torch.where(audio[..., None], codes, torch.full_like(codes, IGNORE_INDEX))
        return main_loss, _mean_cross_entropy(codebook_logits, code_target)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs):
        """Load a Drama 3 checkpoint: the original layout, or what `save_pretrained` wrote (a local directory or a
        Hub repository id).

        Accepts every keyword of `PreTrainedModel.from_pretrained`: `dtype`; `device_map` (`"auto"` or a dict),
        `max_memory` and `offload_folder` for offloading; `quantization_config=BitsAndBytesConfig(...)` for 8-/4-bit
        dense linears (tower and lm_head stay in full precision unless `llm_int8_skip_modules` says otherwise; with
        4-bit the routed experts are 4-bit too, with 8-bit they stay FP8) or `BsgemmMoeConfig(dequantize=True)` to
        dequantise the FP8 experts while loading (they stay FP8 otherwise, see `quantization_bsgemm`);
        `candidate_head_rows_only=True` to keep only the main-token candidate rows of lm_head
        (`keep_candidate_head_rows`); `attn_implementation`; under `torchrun`, `tp_plan="auto"` or
        `distributed_config=parallel.distributed_config(...)` for tensor or expert parallelism
        (`transformers_drama3.parallel`). transformers loads everything but the codec; the codec is built from
        `codec.pth` (memory-mapped; its encoding side is loaded by the first `encode`), in float32 whatever `dtype`
        is, on the device where the model takes its inputs or the one `device_map` names for `"codec"` (never
        offloaded; `model.codec.to(...)` changes device or dtype afterwards). Without `dtype` (or with `"auto"`) on a
        machine with no GPU the model takes the CPU path (`cpu_path.py`): float16 weights over float32 activations for
        the dense linears and experts on every CPU, bfloat16 tables where that is exact, and the frame step compiled
        ahead of time once stored (`generation/stored_steps.py`; the model's most recent stored step is loaded here);
        `cpu_path="float32"` (or `dtype=torch.float32`, or `DRAMA3_CPU_PATH=float32`) loads plain float32 instead.
        With a GPU the checkpoint's bfloat16 stays. `use_kernels=True` asks transformers to swap in
        kernels from the Hub (its `kernels` package; on a GPU the linear-attention layers' kernels are fetched at
        load): off unless asked, so that a load never needs the network. See docs/loading.md and docs/hardware.md.
        """
        # transformers 5.17 kernelizes only when asked; newer versions by default, fetching kernels from the Hub for
        # a model on a GPU at load (and failing offline): the package keeps the 5.17 default on every version.
        kwargs.setdefault("use_kernels", False)
        candidate_rows_only = kwargs.pop("candidate_head_rows_only", False)
        cpu_path = cpu_path_for_load(kwargs, kwargs.pop("cpu_path", None))  # before anything is read: it may refuse
        parallel = ParallelRequest.from_kwargs(kwargs)  # tensor/expert parallel under torchrun: checked first
        directory = _local_checkpoint_directory(pretrained_model_name_or_path, kwargs)
        default_dtype(kwargs)
        config = kwargs.pop("config", None)
        if config is None:
            config = FishOmniConfig.from_pretrained(directory)
        elif not isinstance(config, FishOmniConfig):
            raise TypeError(f"`config` must be a FishOmniConfig, got {type(config).__name__}")
        if parallel is not None:
            kwargs.update(parallel.load_kwargs(config))
        codec_state = read_codec_file(directory, config.codec_config)
        kwargs["device_map"], codec_device = take_codec_placement(kwargs.get("device_map"))
        with torch.device("meta"):
            skeleton = cls(config, with_codec=False)
        shards = checkpoint_shards(directory)
        fp8_experts = checkpoint_quant_method(config) == BSGEMM_MOE
        check_checkpoint_tensors(shards, expected_checkpoint_tensors(skeleton, shards, fp8_experts))
        if cpu_path is not None:
            kwargs["dtype"] = load_dtype(cpu_path, shards)
        if kwargs.get("quantization_config") is not None:
            config, kwargs["quantization_config"] = prepare_quantization(
                config, kwargs["quantization_config"], skeleton
            )

        loaded = super().from_pretrained(directory, *model_args, config=config, with_codec=False, **kwargs)
        model = loaded[0] if isinstance(loaded, tuple) else loaded
        if cpu_path is not None:  # before the codec joins: the weights replaced go first (peak memory)
            apply_cpu_path(model, cpu_path, checkpoint_files=shards)
        attach_codec(model, codec_state, codec_device)
        if cpu_path is not None:
            source = codec_state.path if isinstance(codec_state, CodecFileStateDict) else None
            codec_for_path(model.codec, cpu_path, source)
        if parallel is not None:
            model.split_rules = SplitModelRules()  # what generate asks of a model split over ranks
        if candidate_rows_only:
            model.keep_candidate_head_rows()
        if cpu_path is not None:  # last: the step's key covers the model as it runs
            preload_steps(model)  # its compiled frame step, if stored (generation/stored_steps.py)
        return loaded

    @staticmethod
    def _load_pretrained_model(model, state_dict, checkpoint_files, load_config, *args, **kwargs):
        """transformers' weight loading, with the loader's stacking of each layer's experts giving back the pages it
        read (`mapped_pages.releasing_merges`), then, on transformers versions that need it, the dequantised weights
        brought to the requested dtype (`compat.cast_dequantised_weights`).

        This is the one step between loading and accelerate's dispatch, so the fix also reaches weights that
        accelerate then keeps in RAM."""
        if checkpoint_files:
            releasing_merges(load_config.weight_mapping, checkpoint_files)
        loaded = PreTrainedModel._load_pretrained_model(
            model, state_dict, checkpoint_files, load_config, *args, **kwargs
        )
        if compat.dequantised_weights_keep_checkpoint_dtype():
            compat.cast_dequantised_weights(model, load_config)
        return loaded

    def save_pretrained(self, save_directory, *args, state_dict=None, is_main_process: bool = True, **kwargs):
        """Save a checkpoint that `from_pretrained` loads without any flag.

        Layout: config.json; safetensors with the backbone, lm_head and tower under their **original** names, the
        routed experts one tensor per expert, all in the model's dtype (a dequantised FP8 checkpoint is saved
        dequantised, with no quantization_config); `codec.pth` holding the codec's folded state dict
        (`codec_file.write_codec_file`). The tokenizer belongs to the processor: `processor.save_pretrained(...)`.
        `save_original_format=False` writes module names (`backbone.*`, fused experts) instead; that loads too.
        """
        if self.cpu_path == "int8":
            raise ValueError("this model runs the int8 CPU path (its linears and experts are rounded to int8): a saved "
                             "checkpoint needs the weights as loaded; load with cpu_path='float32' (or a dtype) to save")
        if isinstance(self.lm_head, CandidateRowsHead):
            raise ValueError("this model keeps only the candidate rows of lm_head (candidate_head_rows_only=True): "
                             "a saved checkpoint needs the whole head; save from a model loaded without that option")
        state_dict = without_codec(self.state_dict() if state_dict is None else state_dict)
        super().save_pretrained(save_directory, *args, state_dict=state_dict, is_main_process=is_main_process, **kwargs)
        if is_main_process:
            write_codec_file(self.codec, save_directory)


def _mean_cross_entropy(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy averaged over the entries of `target` that are not IGNORE_INDEX (0 when there are none)."""
    losses = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), target.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum")
    return losses / (target != IGNORE_INDEX).sum().clamp(min=1)


def _local_checkpoint_directory(name_or_path: str | os.PathLike, kwargs: dict) -> str:
    """A local directory holding the whole checkpoint; Hub repository ids are downloaded first."""
    hub_kwargs = {key: kwargs[key] for key in ("cache_dir", "revision", "token", "local_files_only") if key in kwargs}
    return checkpoint_directory(name_or_path, **hub_kwargs)


__all__ = ["Drama3SpeechOutput", "FishOmniForSpeech", "FishOmniPreTrainedModel"]
