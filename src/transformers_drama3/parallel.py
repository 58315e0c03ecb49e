"""Tensor and expert parallelism for Drama 3 under `torchrun`, through transformers' own plans (docs/hardware.md).

The backbone is transformers' `Qwen3_5MoeTextModel`, a direct child of `FishOmniForSpeech`, so its tensor-parallel
plan (`base_model_tp_plan`: attention heads, shared expert, routed experts split along their intermediate size up
to transformers 5.24, linear-attention projections with gathered outputs, from 5.24 the input embedding) and its
expert-parallel plan (`base_model_ep_plan`: whole routed experts per rank) apply under `backbone.` when `from_pretrained` gets a
`DistributedConfig`. `lm_head`, the codebook tower and the codec stay whole on every rank: every rank then computes
the same frames with no extra collective, the tower's many small steps per frame pay no communication, and together
they are 2.1 B parameters (lm_head 0.51 B and tower 1.22 B in bf16, codec 0.41 B in float32: 5.1 GB per rank).

What this module adds:
- `distributed_config(expert_parallel=...)`: the `DistributedConfig` for the installed transformers (the expert
  parallel API changed: 5.17 has `enable_expert_parallel=True`, newer versions `ep_size`);
- `ParallelRequest`: what `FishOmniForSpeech.from_pretrained` does with `tp_plan` / `tp_size` /
  `distributed_config` — clear errors before any weight is read (no `torchrun`, `device_map` as well, a world size
  that does not divide what it must split), and the plan adapted to the world size (attention kept whole on every
  rank when the ranks outnumber the key/value heads);
- `SplitModelRules`, which `from_pretrained` puts on a split model as `model.split_rules`: what generation asks of
  it (every rank draws the same sampling noise; `fast_decode` refused), without generation importing this module;
- rank helpers for scripts and the CLI (`rank`, `world_size`, `is_main_process`, `init_process_group`,
  `run_on_main_process`).
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from transformers.distributed import DistributedConfig
from transformers.utils import logging

from . import compat
from .quantization_bsgemm import BSGEMM_MOE, FP8_EXPERT_WEIGHTS, checkpoint_quant_method

logger = logging.get_logger(__name__)

BACKBONE_PREFIX = "backbone."
ATTENTION_RULE = ".self_attn."  # rules of the full-attention layers in the backbone's plan
FP8_BLOCK = 128  # the FP8 checkpoint's experts carry one scale per 128 x 128 block
# transformers 5.17 turns expert parallelism on with `enable_expert_parallel=True` and then runs the expert plan
# *instead of* the tensor plan (dense layers whole on every rank); newer versions take `ep_size` and run both plans
# (dense layers split as in tensor parallelism, experts whole per rank). A `tp_plan` dict replaces the whole plan on
# 5.17 and overrides single rules on newer versions, where the no-op style "replicate" keeps a module whole.
PARALLEL_ARGUMENTS = ("tp_plan", "tp_size", "distributed_config")


class Drama3ParallelError(ValueError):
    """A tensor- or expert-parallel load or run that cannot work, refused before any work starts."""


# ----------------------------------------------------------------------------------------------------------------
# Ranks
# ----------------------------------------------------------------------------------------------------------------


def world_size() -> int:
    """Processes in the default group, else `WORLD_SIZE` as `torchrun` sets it (1 outside torchrun)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def rank() -> int:
    """This process's rank in the default group, else `RANK` as `torchrun` sets it (0 outside torchrun)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


def is_main_process() -> bool:
    """True on rank 0 (and outside torchrun): the process that reads input and writes output."""
    return rank() == 0


def launched_with_torchrun() -> bool:
    """True when this process is one of several started by `torchrun` (or already in a group of several)."""
    return world_size() > 1


def init_process_group(timeout: timedelta | None = None) -> None:
    """Join the default process group of a `torchrun` launch (once), before the model is loaded.

    transformers would create the same group while loading; doing it first lets rank 0 read the input and share it
    before anything heavy. On CUDA each rank takes GPU `LOCAL_RANK`, as transformers' loading does. `timeout`: how
    long a collective waits for the other ranks (torch's default when None).
    """
    if dist.is_initialized():
        return
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(timeout=timeout)  # gloo for CPU tensors, NCCL for CUDA ones


def run_on_main_process(function, *args, **kwargs):
    """`function(*args, **kwargs)` run on rank 0 only; every rank gets its result, or raises the error it raised.

    Without a process group (a single process) it is a plain call. The result must be picklable.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return function(*args, **kwargs)
    box = [None, None]  # [result, error]
    if dist.get_rank() == 0:
        try:
            box[0] = function(*args, **kwargs)
        except Exception as error:  # noqa: BLE001  (re-raised on every rank below)
            box[1] = error
    dist.broadcast_object_list(box, src=0)
    if box[1] is not None:
        raise box[1]
    return box[0]


# ----------------------------------------------------------------------------------------------------------------
# Loading
# ----------------------------------------------------------------------------------------------------------------


def distributed_config(expert_parallel: bool = False, size: int | None = None) -> DistributedConfig:
    """The `DistributedConfig` that splits Drama 3 over `size` ranks (default: the `torchrun` world size).

    `expert_parallel=False`: tensor parallelism (every routed expert split along its intermediate size on
    transformers up to 5.24; newer versions keep routed experts whole in their tensor plan: use expert parallelism).
    `expert_parallel=True`: each rank holds `num_experts / size` whole experts; on transformers 5.17 the dense
    layers then stay whole on every rank, on newer versions they are split as in tensor parallelism.
    Pass it as `FishOmniForSpeech.from_pretrained(path, distributed_config=...)`.
    """
    size = world_size() if size is None else size
    if expert_parallel:
        return DistributedConfig(tp_size=size, tp_plan="auto", **compat.expert_parallel_arguments(size))
    return DistributedConfig(tp_size=size, tp_plan="auto")


def attention_is_split(text_config, size: int) -> bool:
    """Whether the full-attention layers are split over `size` ranks: only when `size` divides the key/value heads
    (a rank must hold whole heads and the query heads that share them). Otherwise they stay whole on every rank."""
    return text_config.num_key_value_heads % size == 0


def tensor_parallel_plan(text_config, size: int) -> dict[str, str]:
    """The backbone's tensor-parallel rules under `backbone.` for `size` ranks, the full-attention rules dropped
    when `attention_is_split` is False (what `from_pretrained(tp_plan="auto")` applies to Drama 3)."""
    plan = {BACKBONE_PREFIX + key: style for key, style in text_config.base_model_tp_plan.items()}
    if attention_is_split(text_config, size):
        return plan
    return {key: style for key, style in plan.items() if ATTENTION_RULE not in key}


def expert_parallel_plan(text_config) -> dict[str, str]:
    """The backbone's expert-parallel rules under `backbone.`."""
    return {BACKBONE_PREFIX + key: style for key, style in text_config.base_model_ep_plan.items()}


# Styles of the backbone's plans that split a parameter over the ranks (the others keep it whole on every rank).
SPLITTING_STYLES = {"colwise", "rowwise", "packed_colwise", "colwise_gather_output", "embedding_rowwise", "grouped_gemm"}


def is_split(parameter_name: str, config, size: int, expert_parallel: bool) -> bool:
    """Whether a parallel load over `size` ranks splits the parameter `parameter_name` of `FishOmniForSpeech`
    (each rank holding 1/size of it), as `from_pretrained` resolves the plans with the installed transformers.

    For memory estimates (docs/hardware.md); the tests check it against the shards transformers actually makes.
    """
    text = config.text_config
    # FP8 experts kept as shipped: a block-scale tensor is split with its weight.
    generic = re.sub(r"\.\d+(?=\.|$)", ".*", parameter_name).removesuffix("_scale_inv")
    module = generic.rpartition(".")[0]
    if expert_parallel:
        rules = expert_parallel_plan(text)
        if rules.get(generic, rules.get(module)) in SPLITTING_STYLES:
            return True
        if not compat.expert_parallel_by_size():
            return False  # 5.17: the expert plan alone
    rules = tensor_parallel_plan(text, size)
    if compat.expert_parallel_by_size():  # newer versions also split the backbone's input embedding by vocabulary rows
        rules[BACKBONE_PREFIX + "embed_tokens"] = "embedding_rowwise"
    return rules.get(generic, rules.get(module)) in SPLITTING_STYLES


@dataclass
class ParallelRequest:
    """A tensor- or expert-parallel load asked of `FishOmniForSpeech.from_pretrained`, checked and resolved.

    `from_pretrained` calls `ParallelRequest.from_kwargs(kwargs)` before anything heavy (it checks the launch) and,
    once the config is read, `request.load_kwargs(config)` (it checks the geometry and returns the transformers
    `distributed_config` to load with).
    """

    size: int  # ranks the model is split over (the world size)
    expert_parallel: bool
    tp_plan: dict[str, str] | None  # a plan the caller wrote; None for the model's own ("auto")
    dequantize: bool = False  # the load dequantises FP8 experts (`BsgemmMoeConfig(dequantize=True)`)

    @classmethod
    def from_kwargs(cls, kwargs: dict) -> ParallelRequest | None:
        """Pop `tp_plan`, `tp_size` and `distributed_config` from `from_pretrained`'s `kwargs`; None when none asks
        for parallelism. Raises `Drama3ParallelError` for a launch that cannot work."""
        if all(kwargs.get(name) is None for name in PARALLEL_ARGUMENTS):
            return None
        tp_plan, tp_size, config = (kwargs.pop(name, None) for name in PARALLEL_ARGUMENTS)
        if config is not None and (tp_plan is not None or tp_size is not None):
            raise Drama3ParallelError(
                "pass either `distributed_config` or `tp_plan`/`tp_size`, not both; "
                "`transformers_drama3.parallel.distributed_config()` builds a complete one"
            )
        if config is None:
            config = {"tp_plan": tp_plan, "tp_size": tp_size}
        elif isinstance(config, DistributedConfig):
            config = config.to_dict()
        elif not isinstance(config, dict):
            raise Drama3ParallelError(
                f"`distributed_config` must be a DistributedConfig or a dict, got {type(config).__name__}"
            )
        other = {name: config.get(name) for name in ("fsdp_size", "pp_size", "dp_replicate_size")}
        if any((value or 1) > 1 for value in other.values()):
            raise Drama3ParallelError(
                f"Drama 3 runs tensor and expert parallelism only, got {other}: for more throughput run several "
                "independent replicas (docs/hardware.md)"
            )
        if kwargs.get("device_map") is not None:
            raise Drama3ParallelError(
                "tensor/expert parallelism and `device_map` are exclusive: under torchrun every rank loads its share "
                "of the model on its own device (cuda:LOCAL_RANK, or the CPU); drop `device_map` (and `max_memory`, "
                "`offload_folder`)"
            )
        size = world_size()
        if size < 2:
            raise Drama3ParallelError(
                "tensor/expert parallelism needs one process per GPU in a torch.distributed group, but this process "
                "is alone (no process group, WORLD_SIZE unset or 1): launch it with "
                "`torchrun --nproc-per-node N your_script.py`, or load without `tp_plan`/`distributed_config`"
            )
        requested = config.get("tp_size") or size
        if requested != size:
            raise Drama3ParallelError(
                f"tp_size={requested} but torchrun started {size} processes: the model is split over all of them "
                f"(leave tp_size unset, or launch with --nproc-per-node {requested})"
            )
        plan = config.get("tp_plan")
        expert = (config.get("ep_size") or 1) > 1 or bool(config.get("enable_expert_parallel"))
        dequantize = bool(getattr(kwargs.get("quantization_config"), "dequantize", False))
        return cls(size=size, expert_parallel=expert, tp_plan=plan if isinstance(plan, dict) and plan else None,
                   dequantize=dequantize)

    def check(self, config) -> None:
        """Raise `Drama3ParallelError` when the model's sizes cannot be split over `size` ranks."""
        text, size = config.text_config, self.size
        if self.expert_parallel and text.num_experts % size:
            raise Drama3ParallelError(
                f"expert parallelism over {size} ranks needs a number of routed experts divisible by {size}, but "
                f"the model has {text.num_experts}: use a world size that divides it, or tensor parallelism"
            )
        experts_cut = not self.expert_parallel and compat.tensor_plan_splits_experts(text)  # rows of every expert
        splits = {"shared_expert_intermediate_size": text.shared_expert_intermediate_size}
        if experts_cut:
            splits["moe_intermediate_size"] = text.moe_intermediate_size
        if self.expert_parallel and not compat.expert_parallel_by_size():
            splits = {}  # transformers 5.17: the expert plan alone, dense layers whole
        alternative = "" if self.expert_parallel else ", or expert parallelism"
        for name, value in splits.items():
            if value % size:
                raise Drama3ParallelError(
                    f"tensor parallelism over {size} ranks splits text_config.{name} = {value}, which {size} does not "
                    f"divide: use a world size that divides it{alternative}"
                )
        if experts_cut and checkpoint_quant_method(config) == BSGEMM_MOE:
            share = text.moe_intermediate_size // size
            if share % FP8_BLOCK:
                raise Drama3ParallelError(
                    f"the checkpoint's FP8 experts have one scale per {FP8_BLOCK} x {FP8_BLOCK} block, so tensor "
                    f"parallelism must give each rank a multiple of {FP8_BLOCK} of their {text.moe_intermediate_size} "
                    f"intermediate rows; {size} ranks would get {share}. Use expert parallelism, which keeps experts "
                    "whole (`transformers_drama3.parallel.distributed_config(expert_parallel=True)`; `--parallel "
                    "expert` in drama3-tts), or fewer ranks"
                )
        if self.tp_plan is not None and not attention_is_split(text, size):
            split = sorted(key for key in self.tp_plan if ATTENTION_RULE in key and self.tp_plan[key] != "replicate")
            if split:
                raise Drama3ParallelError(
                    f"the tp_plan splits the full-attention layers ({split[0]}, ...) over {size} ranks, which do not "
                    f"divide the {text.num_key_value_heads} key/value heads; leave those modules out of the plan (they "
                    "then stay whole on every rank), or use tp_plan='auto', which does that"
                )

    def load_kwargs(self, config) -> dict:
        """Check the model's sizes (`check`) and return `{"distributed_config": ...}` for transformers' loader."""
        self.check(config)
        text = config.text_config
        if not self.expert_parallel and not compat.tensor_plan_splits_experts(text) and is_main_process():
            logger.warning(
                "this transformers version's tensor-parallel plan keeps the routed experts (89 % of the weights) whole "
                "on every rank; to split them, use expert parallelism (`transformers_drama3.parallel."
                "distributed_config(expert_parallel=True)`, `--parallel expert` in drama3-tts)"
            )
        dense_split = not (self.expert_parallel and not compat.expert_parallel_by_size())  # 5.17's expert plan: dense whole
        plan = self.tp_plan or "auto"
        if dense_split and not attention_is_split(text, self.size):
            if is_main_process():
                logger.warning(
                    f"{self.size} ranks do not divide the {text.num_key_value_heads} key/value heads: the "
                    "full-attention layers stay whole on every rank, everything else in the backbone is split"
                )
            plan = self._whole_attention_plan(text)
        if isinstance(plan, dict) and checkpoint_quant_method(config) == BSGEMM_MOE and not self.dequantize:
            plan = {**plan, **compat.scale_rules(plan, FP8_EXPERT_WEIGHTS)}  # 5.17: the dict is the whole plan
        if self.expert_parallel and compat.expert_parallel_by_size():
            return {"distributed_config": DistributedConfig(tp_size=self.size, tp_plan=plan, ep_size=self.size)}
        if self.expert_parallel:
            return {"distributed_config": DistributedConfig(tp_size=self.size, tp_plan=plan, enable_expert_parallel=True)}
        return {"distributed_config": DistributedConfig(tp_size=self.size, tp_plan=plan)}

    def _whole_attention_plan(self, text_config) -> dict[str, str]:
        """The plan (the caller's, else the model's) with the full-attention layers whole, written as each
        transformers version reads a dict plan."""
        if compat.expert_parallel_by_size():  # rules override the model's plan one by one: mark attention "replicate"
            rules = {BACKBONE_PREFIX + key for key in text_config.base_model_tp_plan if ATTENTION_RULE in key}
            return {**dict.fromkeys(rules, "replicate"), **(self.tp_plan or {})}
        return self.tp_plan or tensor_parallel_plan(text_config, self.size)  # 5.17: the dict is the whole plan


# ----------------------------------------------------------------------------------------------------------------
# Generation
# ----------------------------------------------------------------------------------------------------------------


def is_sharded(model) -> bool:
    """Whether `model` was loaded split over several ranks (tensor or expert parallel)."""
    return (getattr(model, "tp_size", None) or 1) > 1


class SplitModelRules:
    """What `generate` asks of a model split over ranks: `from_pretrained` puts one on such a model as
    `model.split_rules` (generation itself knows nothing of parallelism)."""

    def shared_seed(self, model, seed, generator):
        """The seed `generate` should use so that every rank draws the same sampling noise.

        Ranks that drew different noise would pick different tokens and feed their shards different rows. With
        neither `seed` nor `generator`, rank 0 draws a seed (from torch's global generator) and every rank gets it; a
        `seed` or a `generator` that differs between ranks is an error.
        """
        if generator is not None:
            generators = generator if isinstance(generator, (list, tuple)) else [generator]  # one, or one per sequence
            state = hashlib.sha256(b"".join(g.get_state().cpu().numpy().tobytes() for g in generators)).hexdigest()
            _require_same_on_every_rank(state, "the `generator` passed to generate has a different state on each "
                                        "rank: seed it identically everywhere (or pass `seed=`)")
            return seed
        if seed is None:
            box = [int(torch.randint(0, 2**62, ())) if dist.get_rank() == 0 else None]
            dist.broadcast_object_list(box, src=0)
            return box[0]
        _require_same_on_every_rank(seed, f"generate got seed={seed} on rank {dist.get_rank()} but other seeds "
                                    "elsewhere: every rank must use the same seed")
        return seed

    def check_fast_decode(self) -> None:
        """Refuse `fast_decode=True`: the static caches and CUDA graphs have not been checked with the collectives
        of tensor/expert parallelism."""
        raise Drama3ParallelError(
            "fast_decode=True is not supported on a model split over several ranks yet; use the regular frame loop "
            "(fast_decode=False), which runs under tensor and expert parallelism"
        )


def _require_same_on_every_rank(value, message: str) -> None:
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    if any(other != values[0] for other in values):
        raise Drama3ParallelError(message)


__all__ = [
    "Drama3ParallelError",
    "ParallelRequest",
    "SplitModelRules",
    "attention_is_split",
    "distributed_config",
    "expert_parallel_plan",
    "init_process_group",
    "is_main_process",
    "is_sharded",
    "is_split",
    "launched_with_torchrun",
    "rank",
    "run_on_main_process",
    "tensor_parallel_plan",
    "world_size",
]
