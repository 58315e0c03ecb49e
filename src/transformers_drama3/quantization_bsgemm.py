"""The `bsgemm-moe` quantization method of Drama 3 checkpoints, made known to transformers (docs/format.md#fp8-experts).

Only the routed experts are FP8 (`float8_e4m3fn` with float32 `weight_scale_inv` per 128 x 128 block), exactly the
layout of transformers' fine-grained FP8 method. transformers silently ignores an unknown `quant_method` and would
load the raw FP8 bytes as weights, so `register_bsgemm_moe()` runs on `import transformers_drama3`, before any
load. Where the experts go:

- FP8 kept as shipped (the default on a CPU, on a GPU without FP8 support, and wherever transformers' FP8 kernel
  cannot be loaded: no `kernels` package, no Hub download): each layer's experts become a
  `quantized_experts.Fp8SelectedExperts`, filled tensor by tensor from the shards (1 byte per weight plus the block
  scales), which dequantises only the selected experts at each call.
- transformers' own FP8 experts and kernel, on an FP8-capable GPU where `kernels` loads it (its speed against the
  selected-experts path is not measured yet: no such GPU with Hub access was at hand).
- Dequantised while loading, on request: `BsgemmMoeConfig(dequantize=True)`:
  `W[i, j] = float(W8[i, j]) * weight_scale_inv[i // 128, j // 128]`, per expert, before the experts are fused.

A user's `BitsAndBytesConfig` is combined with a `bsgemm-moe` checkpoint by `prepare_quantization`: transformers
accepts one quantization method per load and refuses a config of another class than the checkpoint's, so the load
runs the bitsandbytes quantizer extended for the routed experts (`Bnb8BitWithFp8Experts` /
`Bnb4BitWithFp8Experts`, registered under internal method names). 8-bit: dense linears 8-bit, experts FP8 kept.
4-bit: dense linears 4-bit and the experts 4-bit too (`quantized_experts.Bnb4bitSelectedExperts`): each fused expert
tensor is dequantised from FP8 and quantised by bitsandbytes as it is read, so the full-precision model is never
held. The loaded model's config then says plain `bitsandbytes`. For 4-bit, linears that bitsandbytes' AVX512-BF16
CPU kernel cannot take are kept in full precision on every machine (`cpu_unpackable_4bit_linears`;
docs/hardware.md).
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from transformers.core_model_loading import ConversionOps
from transformers.quantizers.auto import (
    AUTO_QUANTIZATION_CONFIG_MAPPING,
    AUTO_QUANTIZER_MAPPING,
    register_quantization_config,
    register_quantizer,
)
from transformers.quantizers.quantizer_bnb_4bit import Bnb4BitHfQuantizer
from transformers.quantizers.quantizer_bnb_8bit import Bnb8BitHfQuantizer
from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer
from transformers.quantizers.quantizers_utils import should_convert_module
from transformers.utils import logging
from transformers.utils.quantization_config import BitsAndBytesConfig, FineGrainedFP8Config

from . import compat
from .codec_file import without_codec
from .quantized_experts import (
    Bnb4bitSelectedExperts,
    Fp8SelectedExperts,
    check_4bit_expert_blocks,
    freeze_quantized_experts,
)

logger = logging.get_logger(__name__)

BSGEMM_MOE = "bsgemm-moe"
FP8_EXPERT_WEIGHTS = (".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")  # each with a `_scale_inv` when kept FP8
NOT_ROUTED_EXPERTS = r"(?!.*\.mlp\.experts$).+"
# Kept in full precision by bitsandbytes unless the user passes `llm_int8_skip_modules`: the codebook tower and
# lm_head (they produce the sampled tokens, and quantising them saves at most 1.7 GB of the real model's 73 GB). The
# codec is never quantised: it joins the model after loading (see `codec_file`).
BNB_SKIP_MODULES = ["lm_head", "tower"]
# On a CPU with AVX512-BF16, bitsandbytes (0.50) runs 4-bit linears through a kernel that repacks each weight in
# blocks of 32 output rows on the first forward call (`_convert_weight_packed_for_cpu`) and asserts that
# out_features is a multiple of 32 and in_features is even. Other CPUs and GPUs have no such limit.
BNB_CPU_4BIT_ROW_BLOCK = 32


class BsgemmMoeConfig(FineGrainedFP8Config):
    """`quant_method: "bsgemm-moe"`: fine-grained FP8 (128 x 128 blocks) on the routed experts only."""

    def __init__(self, **kwargs):
        kwargs["quant_method"] = BSGEMM_MOE
        super().__init__(**kwargs)


class BsgemmMoeHfQuantizer(FineGrainedFP8HfQuantizer):
    """Loads `bsgemm-moe` checkpoints with transformers' fine-grained FP8 machinery (dequantising on CPU)."""

    def get_weight_conversions(self):
        # Only the routed experts are FP8, and the backbone's own expert converters receive the dequantisation
        # (`update_weight_conversions`). transformers' catch-all FP8 converter for every other `*.weight` is not
        # wanted: transformers 5.17 skips the dtype cast of what it passes through (bf16 weights stayed bf16 in a
        # float32 load).
        return []

    def validate_environment(self, *args, **kwargs):
        # `selected_experts`: the experts stay FP8 in `Fp8SelectedExperts` (module docstring). transformers' own
        # check would dequantise them wherever its kernel cannot run, so it is asked only where the kernel loads.
        self.selected_experts = False
        if not self.pre_quantized or self.quantization_config.dequantize:
            return super().validate_environment(*args, **kwargs)
        reason = fp8_kernel_problem() if fp8_capable_gpu() else "no GPU with FP8 support"
        if reason is not None:
            logger.info(
                f"bsgemm-moe: transformers' FP8 expert kernel is not used ({reason}); the routed experts stay FP8 and "
                "only the selected experts are dequantised at each call (BsgemmMoeConfig(dequantize=True) "
                "dequantises them all while loading instead: faster on a CPU, twice the expert memory in bf16)."
            )
            self.selected_experts = True
            return None
        return super().validate_environment(*args, **kwargs)

    @property
    def is_trainable(self) -> bool:
        # The experts kept FP8 by this package (`Fp8SelectedExperts`) or dequantised at load are frozen and pass
        # gradients to their inputs, so `Trainer` may train adapters around them. transformers 5.17 answers False for
        # every FP8 model (its expert kernel had no backward); where that kernel runs, its own answer stands.
        if getattr(self, "selected_experts", False) or self.quantization_config.dequantize:
            return True
        return super().is_trainable

    def update_tp_plan(self, config):
        # Called by transformers 5.17 only (newer versions split scales with their weights themselves): with the
        # experts kept FP8, their block scales get the tensor- and expert-parallel rules of their weights.
        config = super().update_tp_plan(config)
        if not self.quantization_config.dequantize:
            text = config.text_config
            for attribute in ("base_model_tp_plan", "base_model_ep_plan"):
                plan = getattr(text, attribute, None) or {}
                if rules := compat.scale_rules(plan, FP8_EXPERT_WEIGHTS):
                    setattr(text, attribute, {**plan, **rules})
        return config

    def _process_model_after_weight_loading(self, model, **kwargs):
        freeze_quantized_experts(model)
        return super()._process_model_after_weight_loading(model, **kwargs)

    def get_state_dict_and_metadata(self, model):
        # transformers saves a quantised model's own state dict instead of the one `save_pretrained` passes: keep the
        # codec out of it (it goes to codec.pth). The FP8 experts and their scales are written back one tensor per
        # expert by the reversed conversions, the checkpoint's own layout.
        if self.selected_experts and not compat.kept_fp8_scales_save_with_their_shape():
            raise NotImplementedError(
                "saving FP8 experts kept as shipped needs a newer transformers (this one writes their block scales "
                "with the wrong shape): load with `quantization_config=BsgemmMoeConfig(dequantize=True)` to save a "
                "dequantised copy, or keep using the original checkpoint"
            )
        return without_codec(model.state_dict()), {}

    def remove_quantization_config(self, model):
        # Runs once the experts are dequantised: the model is no longer quantised, so `save_pretrained` must write
        # the weights as they are (compat: transformers 5.17 would try to reverse the dequantisation).
        super().remove_quantization_config(model)
        compat.forget_loading_conversions(model)

    def _process_model_before_weight_loading(self, model, **kwargs):
        if self.selected_experts:
            self.modules_to_not_convert = []
            replace_routed_experts(model, Fp8SelectedExperts)
            return None
        # Everything outside the routed experts is bf16 in the checkpoint and must stay a plain module. transformers
        # matches skip names as prefixes or suffixes, so short names ("self_attn") protect nothing; one regex (its
        # patterns are matched with `re.match`) protects every module whose name does not end in `.mlp.experts`.
        # It is set for this call only, so a saved config keeps the user's own list.
        user_skip = self.quantization_config.modules_to_not_convert
        self.quantization_config.modules_to_not_convert = [NOT_ROUTED_EXPERTS] + list(user_skip or [])
        try:
            return super()._process_model_before_weight_loading(model, **kwargs)
        finally:
            self.quantization_config.modules_to_not_convert = user_skip


def fp8_capable_gpu() -> bool:
    """Whether a CUDA GPU with FP8 matmuls (compute capability >= 8.9) or an XPU is present: where transformers
    would run its FP8 kernel."""
    if torch.xpu.is_available():
        return True
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


def replace_routed_experts(model: nn.Module, make_experts) -> None:
    """Swap every backbone layer's `mlp.experts` for `make_experts(text_config)`, on the meta device (before
    loading: the loader fills the new module's parameters)."""
    for name, module in list(model.named_modules()):
        if name.endswith(".mlp.experts"):
            with torch.device("meta"):
                model.set_submodule(name, make_experts(module.config))


def fp8_kernel_problem() -> str | None:
    """Why transformers' fine-grained FP8 kernel cannot be loaded (first line of the error), or None if it can.

    Any failure counts: a missing `kernels` package, no network for the Hub download, no build for this torch/CUDA.
    Dequantising is always a correct fallback, so no error is let through.
    """
    from transformers.integrations.finegrained_fp8 import load_finegrained_fp8_kernel

    try:
        load_finegrained_fp8_kernel()
    except Exception as error:  # noqa: BLE001 - see the docstring
        return f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
    return None


# ----------------------------------------------------------------------------------------------------------------
# bitsandbytes on a bsgemm-moe checkpoint
# ----------------------------------------------------------------------------------------------------------------


def _bnb_fields(config: BitsAndBytesConfig) -> dict:
    """Constructor arguments that rebuild `config` (without its method name)."""
    return {key: value for key, value in config.to_dict().items() if not key.startswith("_") and key != "quant_method"}


class BnbWithFp8ExpertsConfig(BitsAndBytesConfig):
    """A `BitsAndBytesConfig` for a `bsgemm-moe` checkpoint: its method name selects the combined quantizer."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.quant_method = f"{BSGEMM_MOE}+bitsandbytes_{'8bit' if self.load_in_8bit else '4bit'}"


class _QuantisesRoutedExperts:
    """Mixin for a bitsandbytes quantizer on a `bsgemm-moe` checkpoint: the routed experts stay FP8
    (`Fp8SelectedExperts`, 8-bit) or are dequantised from FP8 and quantised to 4-bit as they are read
    (`Bnb4bitSelectedExperts`, 4-bit).

    The bitsandbytes quantizer quantises the dense linears; the FP8 experts' weight conversions are borrowed from a
    `BsgemmMoeHfQuantizer` (copies for the scales when the experts stay FP8, the dequantisation before the merge
    otherwise). The quantizer's own config is a plain `BitsAndBytesConfig`, so the loaded model's
    `config.quantization_config` says `bitsandbytes`.
    """

    def __init__(self, quantization_config, **kwargs):
        super().__init__(BitsAndBytesConfig(**_bnb_fields(quantization_config)), **kwargs)
        self._fp8_experts = BsgemmMoeHfQuantizer(BsgemmMoeConfig(dequantize=self.quantization_config.load_in_4bit),
                                                 pre_quantized=True)

    def make_experts(self, text_config):
        if not self.quantization_config.load_in_4bit:
            return Fp8SelectedExperts(text_config)
        config = self.quantization_config
        return Bnb4bitSelectedExperts(text_config, quant_type=config.bnb_4bit_quant_type,
                                      compress_statistics=config.bnb_4bit_use_double_quant,
                                      quant_storage=config.bnb_4bit_quant_storage)

    def _process_model_before_weight_loading(self, model, **kwargs):
        result = super()._process_model_before_weight_loading(model, **kwargs)
        replace_routed_experts(model, self.make_experts)
        return result

    def _process_model_after_weight_loading(self, model, **kwargs):
        freeze_quantized_experts(model)
        return super()._process_model_after_weight_loading(model, **kwargs)

    def get_quantize_ops(self):
        return Bnb4bitExpertsQuantize(self, super().get_quantize_ops())

    def param_needs_quantization(self, model, param_name: str, **kwargs) -> bool:
        module_name, _, tensor_name = param_name.rpartition(".")
        if isinstance(model.get_submodule(module_name), Bnb4bitSelectedExperts):
            return True  # quantised by bitsandbytes' own 4-bit op, like a Linear4bit weight
        return super().param_needs_quantization(model, param_name, **kwargs)

    def update_weight_conversions(self, weight_conversions, *args):
        # `*args`: newer transformers also pass the model.
        with_fp8 = self._fp8_experts.update_weight_conversions(weight_conversions, *args)
        return super().update_weight_conversions(with_fp8, *args)

    def is_serializable(self, *args, **kwargs):
        # The experts' 4-bit block statistics and FP8 scales have no bitsandbytes serialisation: transformers then
        # refuses save_pretrained with its own error (the original checkpoint is the one to keep).
        return False


class Bnb4bitExpertsQuantize(ConversionOps):
    """The loader's quantize op for a 4-bit load: routed experts through `Bnb4bitSelectedExperts.quantized_parameter`
    (bitsandbytes' 4-bit, one expert at a time), every other weight through bitsandbytes' own op (`linears`)."""

    def __init__(self, hf_quantizer, linears: ConversionOps):
        self.hf_quantizer = hf_quantizer
        self.linears = linears

    def convert(self, input_dict, *args, model=None, **kwargs):
        name = next(iter(input_dict))
        module_name, _, tensor_name = name.rpartition(".")
        module = model.get_submodule(module_name)
        if not isinstance(module, Bnb4bitSelectedExperts):
            return self.linears.convert(input_dict, *args, model=model, **kwargs)
        value = input_dict[name]
        module._is_hf_initialized = True
        return {name: module.quantized_parameter(tensor_name, value[0] if isinstance(value, list) else value)}


class Bnb8BitWithFp8Experts(_QuantisesRoutedExperts, Bnb8BitHfQuantizer):
    """bitsandbytes 8-bit dense linears + the `bsgemm-moe` experts kept in FP8."""


class Bnb4BitWithFp8Experts(_QuantisesRoutedExperts, Bnb4BitHfQuantizer):
    """bitsandbytes 4-bit dense linears + the `bsgemm-moe` experts quantised to bitsandbytes 4-bit."""


def with_default_skip_modules(config: BitsAndBytesConfig) -> BitsAndBytesConfig:
    """A copy of `config` whose `llm_int8_skip_modules` defaults to `BNB_SKIP_MODULES`.

    transformers' own default would quantise the tower (its list only protects the output embeddings and the last
    parameter). A user's list replaces the default entirely (anchored name matching: "tower" covers "tower.*").
    """
    config = copy.deepcopy(config)
    if config.llm_int8_skip_modules is None:
        config.llm_int8_skip_modules = list(BNB_SKIP_MODULES)
    return config


def cpu_unpackable_4bit_linears(model: nn.Module, skip_modules: list[str]) -> list[str]:
    """Names of the linears that bitsandbytes would quantise to 4-bit (plain `nn.Linear`, not matched by
    `skip_modules` with transformers' own matching) whose shape its AVX512-BF16 CPU kernel cannot repack."""
    return [
        name
        for name, module in model.named_modules()
        if type(module) is nn.Linear  # what transformers' `replace_with_bnb_linear` replaces
        and should_convert_module(name, skip_modules)
        and (module.out_features % BNB_CPU_4BIT_ROW_BLOCK or module.in_features % 2)
    ]


def skip_patterns(model: nn.Module, names: list[str], skip_modules: list[str]) -> list[str]:
    """Patterns for `llm_int8_skip_modules` that keep exactly `names` out of the quantised linears: a module's own
    name ("shared_expert_gate", matched as a suffix in every layer) where it matches no other quantised linear, else
    the full names."""
    quantised = [name for name, module in model.named_modules()
                 if type(module) is nn.Linear and should_convert_module(name, skip_modules)]
    patterns = []
    for leaf in dict.fromkeys(name.rpartition(".")[2] for name in names):
        matched = {name for name in quantised if not should_convert_module(name, [leaf])}
        patterns += [leaf] if matched <= set(names) else [name for name in names if name.rpartition(".")[2] == leaf]
    return patterns


def checkpoint_quant_method(config) -> str | None:
    """The `quant_method` of `config.quantization_config` (a dict from config.json or a config object), or None."""
    quantization = getattr(config, "quantization_config", None)
    if isinstance(quantization, dict):
        return quantization.get("quant_method")
    return getattr(quantization, "quant_method", None)


def prepare_quantization(config, quantization_config, model: nn.Module):
    """`(config, quantization_config)` to give transformers' `from_pretrained` for a Drama 3 checkpoint.

    `model` is the model built from `config` (on the meta device: only module names and shapes are read). A
    `BitsAndBytesConfig` gets the default skip list; for 4-bit, the linears bitsandbytes' AVX512-BF16 CPU kernel
    cannot take (`cpu_unpackable_4bit_linears`: in the real model the 40 `shared_expert_gate` linears, 2048 -> 1) are
    added to it, on every machine: quantising them would save a few kB, while on such a CPU bitsandbytes fails on
    them at the first forward call, and a model that loads the same way everywhere saves and moves safely. On a
    `bsgemm-moe` checkpoint the config becomes the combined method and the checkpoint's own quantization_config is
    dropped from (a copy of) `config`. Anything else passes unchanged: transformers then reports a conflict with
    the checkpoint's method itself.
    """
    if not isinstance(quantization_config, BitsAndBytesConfig):
        return config, quantization_config
    quantization_config = with_default_skip_modules(quantization_config)
    if quantization_config.load_in_4bit:
        skip = quantization_config.llm_int8_skip_modules
        unpackable = cpu_unpackable_4bit_linears(model, skip)
        if unpackable:
            added = skip_patterns(model, unpackable, skip)
            logger.info(
                f"bitsandbytes 4-bit: {len(unpackable)} linear(s) kept in full precision ({', '.join(added)}): their "
                f"output size is not a multiple of {BNB_CPU_4BIT_ROW_BLOCK} or their input size is odd, which "
                "bitsandbytes' AVX512-BF16 CPU kernel cannot take (see docs/hardware.md)."
            )
            quantization_config.llm_int8_skip_modules = skip + added
    if checkpoint_quant_method(config) == BSGEMM_MOE:
        if quantization_config.load_in_4bit:
            check_4bit_expert_blocks(config.text_config, Bnb4bitSelectedExperts.BLOCKSIZE,
                                     quantization_config.bnb_4bit_use_double_quant)
        config = copy.deepcopy(config)
        del config.quantization_config
        quantization_config = BnbWithFp8ExpertsConfig(**_bnb_fields(quantization_config))
    return config, quantization_config


def register_bsgemm_moe() -> None:
    """Register `"bsgemm-moe"` (and its bitsandbytes combinations) with transformers; safe to call more than once."""
    if BSGEMM_MOE not in AUTO_QUANTIZATION_CONFIG_MAPPING:
        register_quantization_config(BSGEMM_MOE)(BsgemmMoeConfig)
    quantizers = {
        BSGEMM_MOE: BsgemmMoeHfQuantizer,
        f"{BSGEMM_MOE}+bitsandbytes_8bit": Bnb8BitWithFp8Experts,
        f"{BSGEMM_MOE}+bitsandbytes_4bit": Bnb4BitWithFp8Experts,
    }
    for name, quantizer in quantizers.items():
        if name not in AUTO_QUANTIZER_MAPPING:
            register_quantizer(name)(quantizer)
