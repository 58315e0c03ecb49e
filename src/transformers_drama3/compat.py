"""Differences between the transformers versions this package supports (5.17 to the newest 5.x), in one place.

Each shim detects the feature it depends on, never a version number, so a version in between takes the branch that
fits it; when the oldest supported version has the newer behaviour, the shim and its test in tests/test_compat.py go.
The detections import what they inspect when first asked (and remember the answer), so that importing this module
(the configuration does) stays as light as importing a transformers config.

Shims (transformers 5.17 -> newer, measured on 5.24 and 5.25):

- `backbone_cache_argument`: the backbone's cache keyword, `past_key_values` -> `cache`.
- `linear_attention_cache`, `one_token_state`, `one_token_convolution`: a linear-attention layer takes its cache as
  `cache_params` and reads its states off `cache.layers[i]` -> it takes `cache`, reads them through
  `Cache.get_recurrent_state` and convolves through transformers' `causal_conv1d_forward` (which also keeps the
  cache's step count).
- `cached_rows`: `Cache.get_seq_length()` reads the attention layers as a Python int -> it reads layer 0, which in
  Qwen3.5 is a linear-attention layer counting on the device (a tensor: slicing with it reads the device back).
- `tensor_plan_splits_experts`: the backbone's tensor-parallel plan splits the routed experts along their
  intermediate size -> it keeps them whole (transformers splits routed experts by expert parallelism only, from 5.2x).
- `sub_configs_declaration`: a composite config declares its sub-configs in `sub_configs` -> `sub_configs_defaults`
  (from 5.20).
- `dequantised_weights_keep_checkpoint_dtype`, `cast_dequantised_weights`: a dequantising FP8 load keeps renamed
  weights in the checkpoint's dtype -> they get the requested dtype.
- `forget_loading_conversions`: a dequantised model keeps its loading conversions, which `save_pretrained` cannot
  reverse -> transformers drops them itself.
- `kept_fp8_scales_save_with_their_shape`: saving FP8 experts kept as shipped loses a one-row scale's shape ->
  exact (5.17 refuses that save).
- `enable_activation_checkpointing`, `disable_activation_checkpointing`, `checkpointing_training_arguments`:
  `gradient_checkpointing*` only -> `activation_checkpointing*` (the old names warn).
- `expert_parallel_by_size`, `expert_parallel_arguments`: `DistributedConfig(enable_expert_parallel=True)` ->
  `DistributedConfig(ep_size=...)`.
- `drop_generation_values_copied_into_config`: the text-to-audio pipeline copies the generation config into the
  model config (which `generate` then refuses as legacy generation control) -> it copies into a copy.
- `quantizers_split_scales_with_their_weights`, `scale_rules`: tensor/expert parallelism splits FP8 experts kept as
  shipped but not their block scales -> each scale follows its weight's rule.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import fields
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from transformers import PreTrainedConfig

# --------------------------------------------------------------------------------------------------------------
# Modeling
# --------------------------------------------------------------------------------------------------------------

def cached_rows(cache) -> int:
    """Rows a backbone cache holds, as a Python int read off its first attention layer's keys (0 when empty).

    Not `cache.get_seq_length()`: that reads layer 0, and a Qwen3.5 backbone starts with linear-attention layers,
    whose row count is a device tensor on newer transformers (using it as a slice bound or a Python int is a host
    read, which a CUDA graph capture refuses). A dynamic layer's key length is a shape, so this reads nothing back.
    """
    for layer in cache.layers:
        keys = getattr(layer, "keys", None)
        if isinstance(keys, torch.Tensor) and keys.dim() == 4:  # [B, KV heads, rows, head dim]
            return int(layer.get_seq_length())
    return 0


@functools.cache
def backbone_cache_argument() -> str:
    """The keyword under which `Qwen3_5MoeTextModel.forward` takes its cache: `cache` on newer versions,
    `past_key_values` on 5.17 (the backbone's output field follows the same name)."""
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeTextModel

    return "cache" if "cache" in inspect.signature(Qwen3_5MoeTextModel.forward).parameters else "past_key_values"


def linear_attention_cache(args: tuple, kwargs: dict):
    """The cache a linear-attention layer's forward was called with (`args`/`kwargs` after its hidden states), or
    None: `cache` on newer versions, `cache_params` on 5.17 (keyword or second positional argument on both)."""
    for name in ("cache", "cache_params"):
        if kwargs.get(name) is not None:
            return kwargs[name]
    return args[0] if args else None


def linear_attention_state_getters() -> bool:
    """Whether a linear-attention layer reads its cache through `Cache.get_recurrent_state` and transformers'
    `causal_conv1d_forward` (newer) rather than through `cache.layers[i]` (5.17). Not remembered: a compiled frame step
    traces it (dynamo would warn about a cached function), and it is one attribute lookup."""
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe

    return hasattr(modeling_qwen3_5_moe, "causal_conv1d_forward")


def one_token_state(layer, cache) -> torch.Tensor | None:
    """The recurrent state `[b, Hv, dk, dv]` a one-token step of the linear-attention `layer` continues from, or None
    where transformers' own step must run: no cache or no state yet, or (5.17) a cache recording past states."""
    if cache is None:
        return None
    if linear_attention_state_getters():
        return cache.get_recurrent_state(layer.layer_idx)
    if not cache.has_previous_state(layer.layer_idx, state_idx=0) or cache.layers[layer.layer_idx].record_past:
        return None
    return cache.layers[layer.layer_idx].recurrent_states[0]


def one_token_convolution(layer, mixed_qkv: torch.Tensor, cache) -> torch.Tensor:
    """`mixed_qkv [b, channels, 1]` through the linear-attention `layer`'s causal convolution and activation, with
    its convolution state in `cache` advanced one step (after `one_token_state` found a state) -> `[b, channels, 1]`."""
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as modeling

    if linear_attention_state_getters():
        return modeling.causal_conv1d_forward(layer.conv1d, mixed_qkv, cache, layer.layer_idx,
                                              activation=layer.activation)
    return modeling.causal_conv1d_update(mixed_qkv, cache.layers[layer.layer_idx].conv_states[0],
                                         layer.conv1d.weight.squeeze(1), layer.conv1d.bias, layer.activation)


def sub_configs_declaration(mapping: dict[str, type]) -> dict[str, Any]:
    """The class attribute that declares a composite config's sub-configs, as the installed transformers reads it:
    `{"sub_configs_defaults": mapping}` from 5.20 on, `{"sub_configs": mapping}` before. Use it in the class body:
    `locals().update(sub_configs_declaration({...}))`."""
    if "sub_configs_defaults" in PreTrainedConfig.__dict__:
        return {"sub_configs_defaults": mapping}
    return {"sub_configs": mapping}


# --------------------------------------------------------------------------------------------------------------
# Loading and saving a pre-quantised (FP8) checkpoint that is dequantised while loading
# --------------------------------------------------------------------------------------------------------------

@functools.cache
def dequantised_weights_keep_checkpoint_dtype() -> bool:
    """Whether a load that dequantises a pre-quantised checkpoint leaves its renamed tensors in the checkpoint's dtype.

    transformers 5.17 loads every *renamed* tensor of a pre-quantised checkpoint in the checkpoint's own dtype,
    whatever `dtype` the load asks for: a float32 load of the (bf16 + FP8) Drama 3 checkpoint came out mostly bf16.
    Newer versions decide each tensor's dtype through `HfQuantizer.get_new_dtype`, which gives plain weights the
    requested dtype.
    """
    from transformers.quantizers.base import HfQuantizer

    return not hasattr(HfQuantizer, "get_new_dtype")


def cast_dequantised_weights(model: Any, load_config: Any) -> None:
    """After a load of a pre-quantised checkpoint (FP8 experts dequantised or kept), give every floating-point
    weight the requested dtype (`load_config.dtype`; nothing to do without one), except kept FP8 experts and their
    scales. Needed where `dequantised_weights_keep_checkpoint_dtype()`. It must run before
    accelerate dispatches the model, so that it also reaches weights that accelerate then keeps in RAM; weights
    already offloaded to disk (meta) were written with the right dtype by transformers. A tensor-parallel shard (a
    `DTensor`) becomes a new parameter (`.data =` would relabel its dtype without converting its local tensor), marked
    as loaded the way transformers' loader marks it, or transformers would re-initialise it as a weight it never
    loaded.
    """
    quantizer, dtype = load_config.hf_quantizer, load_config.dtype
    if quantizer is None or not quantizer.pre_quantized or dtype is None:
        return
    for name, parameter in list(model.named_parameters()):
        if not parameter.is_floating_point() or parameter.is_meta or parameter.dtype == dtype:
            continue
        if parameter.dtype == torch.float8_e4m3fn or name.endswith("_scale_inv"):
            continue  # FP8 experts kept as shipped (`quantized_experts.Fp8SelectedExperts`): bytes and float32 scales
        if isinstance(parameter, DTensor):
            converted = torch.nn.Parameter(parameter.detach().to(dtype), requires_grad=parameter.requires_grad)
            converted._is_hf_initialized = True
            module_name, _, parameter_name = name.rpartition(".")
            setattr(model.get_submodule(module_name), parameter_name, converted)
        else:
            parameter.data = parameter.data.to(dtype)


@functools.cache
def kept_fp8_scales_save_with_their_shape() -> bool:
    """Whether `save_pretrained` of FP8 experts kept as shipped writes each expert's `weight_scale_inv` back with its
    checkpoint shape `[rows / 128, cols / 128]`. transformers 5.17's reversed merge wrote `[cols / 128]` for a
    one-block-row scale (the tiny checkpoints' `gate_proj`), which no longer loads; the loader rewrite that brought
    `HfQuantizer.get_new_dtype` (5.24 here) reverses it exactly (tested bit for bit)."""
    return not dequantised_weights_keep_checkpoint_dtype()


def forget_loading_conversions(model: Any) -> None:
    """Drop the weight conversions a load recorded on `model`, so that `save_pretrained` reverses the model's plain
    mapping (the registered renamings) instead.

    Call it once a pre-quantised checkpoint has been dequantised: the recorded conversions then include the FP8
    dequantisation, which transformers 5.17 cannot reverse (`save_pretrained` fails with "Undefined Operation
    encountered!"). Newer versions drop them themselves when the dequantised model loses its quantization config.
    """
    if "_weight_conversions" in vars(model):
        del model._weight_conversions


# --------------------------------------------------------------------------------------------------------------
# Training and parallelism
# --------------------------------------------------------------------------------------------------------------

@functools.cache
def activation_checkpointing_names() -> bool:
    """Whether the model methods are `activation_checkpointing_enable/disable`: transformers 5.24 renamed gradient
    checkpointing to activation checkpointing and warns on the old names; 5.17 has only `gradient_checkpointing_*`."""
    from transformers import PreTrainedModel

    return hasattr(PreTrainedModel, "activation_checkpointing_enable")


def enable_activation_checkpointing(model: Any, checkpointing_kwargs: dict | None = None, **kwargs) -> None:
    """Turn activation (gradient) checkpointing on under the name the installed transformers has.
    `checkpointing_kwargs` go to `torch.utils.checkpoint` (transformers' `activation_checkpointing_kwargs`, formerly
    `gradient_checkpointing_kwargs`); `kwargs` (`every_n_layers`, `offload`) are passed as they are."""
    if activation_checkpointing_names():
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=checkpointing_kwargs, **kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=checkpointing_kwargs, **kwargs)


def disable_activation_checkpointing(model: Any) -> None:
    """Turn activation (gradient) checkpointing off again."""
    if activation_checkpointing_names():
        model.activation_checkpointing_disable()
    else:
        model.gradient_checkpointing_disable()


def checkpointing_training_arguments(enabled: bool = True) -> dict[str, bool]:
    """The `TrainingArguments` keyword that turns checkpointing on or off: `{"activation_checkpointing": enabled}`
    where that field exists, else `{"gradient_checkpointing": enabled}`."""
    from transformers import TrainingArguments  # here: the training machinery is not needed to run the model

    new_name = "activation_checkpointing" in TrainingArguments.__dataclass_fields__
    return {"activation_checkpointing" if new_name else "gradient_checkpointing": enabled}


@functools.cache
def generation_defaults() -> dict[str, Any]:
    """transformers' global generation defaults (`top_k=50`, `num_beams=1`, ...), which some versions fill into
    every unset field of a generation config (the text-to-audio pipeline of 5.17 does): a value equal to its default
    there was not chosen by the user. Read through `GenerationConfig._get_default_generation_params` (5.17 to 5.24);
    an empty dict where that is gone (then every value counts as chosen)."""
    from transformers import GenerationConfig

    defaults = getattr(GenerationConfig(), "_get_default_generation_params", None)
    return defaults() if defaults is not None else {}


def drop_generation_values_copied_into_config(config: Any, generation_config: Any) -> None:
    """Remove from a model `config` the generation settings that equal `generation_config`'s.

    transformers 5.17's text-to-audio pipeline, looking for the sampling rate, updates the model's own config with
    its generation config; `GenerationMixin.generate` then refuses every later call without a `generation_config`
    ("You have modified the pretrained model configuration to control generation"). Newer versions update a copy,
    and then there is nothing to remove. A value a user set that differs from the generation config stays (and is
    refused by transformers as before)."""
    for key, value in config._get_generation_parameters().items():
        if key in vars(config) and getattr(generation_config, key, None) == value:
            delattr(config, key)


def tensor_plan_splits_experts(text_config) -> bool:
    """Whether the backbone's tensor-parallel plan splits the routed experts along their intermediate size (5.17 to
    5.24: `experts.gate_up_proj` packed_colwise, `experts.down_proj` rowwise). Newer versions keep them whole in the
    tensor plan and split routed experts by expert parallelism only (its `ep_plan`)."""
    return any(".experts." in key for key in text_config.base_model_tp_plan)


def expert_parallel_by_size() -> bool:
    """Whether `DistributedConfig` takes the number of expert-parallel ranks (`ep_size`, newer versions); transformers
    5.17 turns expert parallelism on with `enable_expert_parallel=True` instead (`ep_size` is a TypeError there)."""
    from transformers.distributed import DistributedConfig

    return "ep_size" in {field.name for field in fields(DistributedConfig)}


def expert_parallel_arguments(size: int) -> dict[str, Any]:
    """`DistributedConfig` keywords that split the routed experts over `size` ranks on the installed transformers."""
    return {"ep_size": size} if expert_parallel_by_size() else {"enable_expert_parallel": True}


@functools.cache
def quantizers_split_scales_with_their_weights() -> bool:
    """Whether transformers gives a quantised weight's scale tensors the parallel rule of their weight itself
    (`HfQuantizer.update_parallel_plan`, newer versions). transformers 5.17 adds `<weight>_scale_inv` rules only for
    the `grouped_gemm` rules of the top-level config, so a tensor-parallel split of FP8 experts kept as shipped left
    their block scales whole on every rank (each rank then scaled its rows with another rank's scales)."""
    from transformers.quantizers.base import HfQuantizer

    return hasattr(HfQuantizer, "update_parallel_plan")


def scale_rules(plan: dict[str, str], weights: tuple[str, ...], suffix: str = "_scale_inv") -> dict[str, str]:
    """The rules to add to a parallel `plan` on versions that do not split scales with their weights
    (`quantizers_split_scales_with_their_weights`): for each rule whose key ends with one of `weights`, the same
    style for `<key><suffix>` (a block scale has one entry per 128 x 128 block of its weight, so the same split
    gives each rank the scales of its own rows); empty on newer versions, which add them themselves."""
    if quantizers_split_scales_with_their_weights():
        return {}
    return {key + suffix: style for key, style in plan.items() if key.endswith(weights)}


__all__ = [
    "activation_checkpointing_names",
    "generation_defaults",
    "backbone_cache_argument",
    "linear_attention_cache",
    "linear_attention_state_getters",
    "one_token_convolution",
    "one_token_state",
    "cached_rows",
    "cast_dequantised_weights",
    "checkpointing_training_arguments",
    "dequantised_weights_keep_checkpoint_dtype",
    "drop_generation_values_copied_into_config",
    "disable_activation_checkpointing",
    "enable_activation_checkpointing",
    "expert_parallel_arguments",
    "expert_parallel_by_size",
    "forget_loading_conversions",
    "kept_fp8_scales_save_with_their_shape",
    "quantizers_split_scales_with_their_weights",
    "scale_rules",
    "sub_configs_declaration",
    "tensor_plan_splits_experts",
]
