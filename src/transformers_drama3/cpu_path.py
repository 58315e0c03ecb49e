"""The CPU path: the weight format a model loaded for a CPU runs in.

- `"float16"` (what `"auto"` takes): the dense linears of the backbone and the tower, and the routed experts, with
  float16 weights over float32 activations (cpu_weights.py); the embedding tables of the backbone and the tower in
  bfloat16 when that is exact (a bfloat16 checkpoint's), their rows widened to float32; the linears of the codec's
  decoding transformer in float16 widened to float32 at each product (`narrow_codec`); norms, the router, lm_head and
  the rest of the codec stay float32. FP8 experts as shipped are converted once: their per-call dequantisation was most of a CPU
  frame. The frame step of this path runs compiled where a stored one exists (generation/stored_steps.py).
- `"bfloat16"` (only when asked for): the backbone, lm_head and tower in bfloat16, activations too (half the bytes
  of float32; the checkpoint's own bfloat16 weights, kept in its memory map). FP8 experts as shipped stay in their
  module, their values and scales in bfloat16, dequantised at each call.
- `"int8"` (only when asked for): the same parts as float16 in int8 with a scale per row, a quarter of the float32
  bytes but ~30x the weights' rounding error of float16 (docs/performance.md, "The CPU path"); on x86 builds of torch
  its linears multiply through fbgemm on packed copies of their weights, their inputs split in three 7-bit parts
  (cpu_weights.py), the routed experts through torch's weight-only int8 kernel; its step is stored compiled too.
- `"float32"`: everything in float32, the exact reference (what the CPU path is compared with).

Why float16 on every CPU, those with native bfloat16 (AVX512-BF16, AMX) included: a decode step multiplies one row
by each weight, and torch runs a one-row float16 product with its own matrix-vector kernel, but a bfloat16 one, on
CPUs with native bfloat16, through oneDNN, which was twice as slow for one row. On an AMD EPYC with AVX512-BF16
(Zen 4, torch 2.13, 1 thread) a frame of the `small` checkpoint took 50-59 ms of CPU in float16 against 107-108 in
bfloat16 and 141-148 in float32; on an AVX2 CPU float16 was as fast as int8 and 2.1x float32; on an Intel Xeon with
AMX and AVX512-FP16, 44-45 ms in float16 against 96-97 in bfloat16 and 132-135 in float32 (docs/performance.md, "The
CPU path" and "A second CPU"; benchmarks/cpu_path.py, benchmarks/cpu_weight_formats.py).

`"auto"` is the default of `FishOmniForSpeech.from_pretrained` on a machine with no accelerator, and so of
`pipeline`, the commands, the server and jobs on a CPU. The `DRAMA3_CPU_PATH` environment variable or `cpu_path=`
chooses another; an explicit `dtype` keeps the plain load in that dtype (`--dtype float32` for the commands). The
codec computes in float32 on every path. The path a model took is `model.cpu_path` (None when the model was not loaded for a CPU):
tests and benchmarks read it, never a CPU flag. docs/usage.md#the-cpu-path.

A load for the float16 or int8 path reads a bfloat16 checkpoint in bfloat16 (`load_dtype`): every weight stays a view
of the checkpoint's memory map until `apply_cpu_path` converts it, and the pages read are given back as the conversion
goes (mapped_pages.py), so the load's peak is about the converted model, not a float32 one plus the file's pages.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from .checkpoint_mapping import dense_dtypes
from .codec_layout import memory_maps
from .cpu_attention import CPU_ATTENTION
from .cpu_linear_attention import use_cpu_linear_attention
from .cpu_weights import WEIGHT_FORMATS, CpuEmbedding, CpuExperts, CpuLinear, can_convert, exact_in_bfloat16
from .mapped_pages import PageRelease

CPU_PATHS = ("auto", "bfloat16", "float16", "int8", "float32")
# What the float16 and int8 paths compute in, and hold what they do not convert in (`widen_rest`).
COMPUTE_DTYPE = torch.float32
ENVIRONMENT_VARIABLE = "DRAMA3_CPU_PATH"


def native_bfloat16() -> bool:
    """Whether this CPU computes bfloat16 natively (AVX512-BF16 or AMX tiles), as torch's own kernels see it (and so
    sends bfloat16 products to oneDNN): what the benchmarks report beside their figures."""
    return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


def check_cpu_path(value, origin: str = "cpu_path") -> str:
    """`value` if it names a CPU path (`CPU_PATHS`), else a `ValueError` saying which names exist."""
    if value not in CPU_PATHS:
        raise ValueError(f"{origin} must be one of {', '.join(CPU_PATHS)}, got {value!r}")
    return value


def requested_cpu_path(value: str | None = None) -> str:
    """The path asked for: `value`, else `DRAMA3_CPU_PATH`, else `"auto"` (checked)."""
    if value is not None:
        return check_cpu_path(value)
    from_environment = os.environ.get(ENVIRONMENT_VARIABLE)
    if from_environment:
        return check_cpu_path(from_environment.strip(), ENVIRONMENT_VARIABLE)
    return "auto"


def resolve_cpu_path(value: str | None = None) -> str:
    """The concrete path (`"bfloat16"`, `"float16"`, `"int8"` or `"float32"`) for the request `value`: `"auto"` is
    float16 (module docstring)."""
    requested = requested_cpu_path(value)
    return "float16" if requested == "auto" else requested


def load_dtype(path: str, shards: list[str]) -> torch.dtype:
    """The dtype transformers loads the checkpoint `shards` in for `path`: bfloat16 for the bfloat16 path, and for
    the float16 and int8 paths when the checkpoint's dense weights are bfloat16 (`dense_dtypes`; FP8 experts keep
    their own dtype): each weight is then converted straight from the checkpoint's memory map (`apply_cpu_path`),
    never held whole in float32 (a bfloat16 value is a float32 one, so the weights come out the same). float32
    otherwise."""
    if path == "bfloat16" or (path in WEIGHT_FORMATS and dense_dtypes(shards) == {"BF16"}):
        return torch.bfloat16
    return torch.float32


def embedding_tables(model: nn.Module) -> list[nn.Embedding]:
    """The embedding tables of the backbone and the tower."""
    return [m for part in (model.backbone, model.tower) for m in part.modules() if type(m) is nn.Embedding]


def convert_weights(model: nn.Module, weight_format: str, narrow_tables: bool | None = None,
                    release: PageRelease | None = None) -> None:
    """Replace, in place, the dense linears of the backbone and the tower by `CpuLinear` and the routed experts by
    `CpuExperts` in `weight_format` (cpu_weights.py), and, when `narrow_tables` (None: when every table is exact in
    bfloat16, read from the values), the embedding tables by `CpuEmbedding`; the router, lm_head, norms and codec
    stay (the codec's path is `codec_for_path`; `widen_rest` brings what stays to float32). `release` is told of
    each module replaced (mapped_pages.py)."""
    text_config = model.config.text_config
    if narrow_tables is None:
        narrow_tables = all(exact_in_bfloat16(table.weight) for table in embedding_tables(model))
    for part in (model.backbone, model.tower):
        # By path, not by a list of the modules: such a list would keep every replaced float32 linear and FP8 layer of
        # experts alive until the end, a whole float32 backbone on top of its 16-bit copy (+5 GB at the real width
        # with 4 layers); so each is freed as soon as its replacement is in.
        for path in [path for path, _ in part.named_modules()]:
            try:
                module = part.get_submodule(path)
            except AttributeError:  # inside a module replaced already
                continue
            for name, child in list(module.named_children()):
                if can_convert(child, weight_format):
                    setattr(module, name, CpuLinear(child, weight_format))
                elif name == "experts" and hasattr(child, "gate_up_proj"):
                    setattr(module, name, CpuExperts.from_experts(child, text_config, weight_format))
                elif narrow_tables and type(child) is nn.Embedding:
                    setattr(module, name, CpuEmbedding(child, COMPUTE_DTYPE))
                else:
                    continue
                if release is not None:
                    release.converted(child)


def widen_rest(model: nn.Module, release: PageRelease | None = None) -> None:
    """Bring every floating parameter and buffer of the backbone, lm_head and tower that `convert_weights` kept (the
    norms, the router, lm_head, the linear attention's convolution and decay) to `COMPUTE_DTYPE`, in place: a no-op
    after a float32 load, a copy of each after a bfloat16 one (`load_dtype`). The converted modules' own tensors
    stay. `release` is told of each module widened."""
    for part in (model.backbone, model.lm_head, model.tower):
        for module in part.modules():
            if isinstance(module, (CpuLinear, CpuExperts, CpuEmbedding)):
                continue
            narrow = [(name, tensor) for name, tensor in (*module.named_parameters(recurse=False),
                                                          *module.named_buffers(recurse=False))
                      if tensor.dtype in (torch.bfloat16, torch.float16)]
            for name, tensor in narrow:  # setattr keeps a buffer a buffer (and its persistence)
                wide = tensor.detach().to(COMPUTE_DTYPE)
                setattr(module, name, nn.Parameter(wide, tensor.requires_grad) if isinstance(tensor, nn.Parameter)
                        else wide)
            if narrow and release is not None:
                release.converted(module)


def narrow_codec(codec: nn.Module, source: str | None = None) -> None:
    """The CPU path's codec, in place: the linears of `quantizer.post_module` (the windowed transformer of the
    decoding side, 416 MiB of the real codec's 756 MiB of decoding weights in float32) in float16, widened to float32
    at each product (`CpuLinear(..., widened=True)`: float32 arithmetic on float16-rounded weights); every other
    weight stays float32.

    `source`: the `codec.pth` the codec was built from in place (memory-mapped, docs/codec.md#memory). Each layer's
    float16 weights are then read from a map of that file of their own, dropped after the layer, so the pages read
    go with it: read through the codec's own map, they would stay in the process's memory beside their copies."""
    transformer = codec.quantizer.post_module
    if transformer is None:
        return
    for index, layer in enumerate(transformer.layers):
        maps = None if source is None else memory_maps(source, 1)
        for path, module in list(layer.named_modules()):
            for name, child in list(module.named_children()):
                if type(child) is not nn.Linear or child.weight.dtype != torch.float32:
                    continue
                if maps is not None:  # the same weight, from the layer's own map (not the codec's)
                    key = f"quantizer.post_module.layers.{index}.{path + '.' if path else ''}{name}.weight"
                    child.weight = nn.Parameter(maps[0][key], requires_grad=False)
                setattr(module, name, CpuLinear(child, "float16", widened=True))


def has_accelerator() -> bool:
    """Whether torch sees a GPU (CUDA, XPU or MPS): then loads keep the checkpoint's dtype (`loading.default_dtype`)."""
    return torch.cuda.is_available() or torch.xpu.is_available() or torch.backends.mps.is_available()


def on_cpu_only(device_map) -> bool:
    """Whether a `device_map` argument keeps the whole model in CPU memory (None, "cpu", or a dict of "cpu" only)."""
    if device_map is None:
        return True
    if isinstance(device_map, dict):
        return all(str(place) == "cpu" for place in device_map.values())
    return str(device_map) == "cpu"


def cpu_path_for_load(kwargs: dict, cpu_path: str | None) -> str | None:
    """The CPU path a `from_pretrained` call with `kwargs` takes (taking out the dtype asked for: the path's
    `load_dtype` replaces it), or None when it takes none: the load names a dtype (and no `cpu_path`), a GPU is
    there, or the model is quantised, offloaded, placed off the CPU or split over ranks. An explicit `cpu_path` other
    than float32 that cannot be honoured is a `ValueError`."""
    explicit = cpu_path is not None
    requested = requested_cpu_path(cpu_path)
    dtype = kwargs.get("dtype", kwargs.get("torch_dtype"))
    if not explicit and (dtype not in (None, "auto") or has_accelerator()):
        return None
    elsewhere = [name for name in ("quantization_config", "tp_plan", "distributed_config") if kwargs.get(name)]
    if not on_cpu_only(kwargs.get("device_map")):
        elsewhere.append("device_map")
    if elsewhere:
        if explicit and requested != "float32":
            raise ValueError(f"cpu_path={cpu_path!r} is for a model loaded whole into CPU memory, but the load also "
                             f"asks for {', '.join(elsewhere)}: drop one of them")
        return None
    kwargs.pop("torch_dtype", None)
    kwargs.pop("dtype", None)  # `load_dtype` sets it once the checkpoint's files are known
    return resolve_cpu_path(cpu_path)


def apply_cpu_path(model: nn.Module, path: str, narrow_tables: bool | None = None,
                   checkpoint_files: list[str] | None = None) -> None:
    """Bring a float32 (or bfloat16) model to `path` (`resolve_cpu_path`'s answer), in place, and record it as
    `model.cpu_path`. The codec is brought to the path too (`codec_for_path`), and a model on `sdpa` attention to
    `CPU_ATTENTION` (cpu_attention.py: the same outputs, without copies of the grouped key/value heads); on every path
    but float32 the linear-attention layers take their one-token step by `CpuGatedDeltaNet`
    (cpu_linear_attention.py: the same outputs, up to the order of float32 sums).
    `narrow_tables`: `convert_weights`'s (None: from the values; a model on the meta device has none to read).
    `checkpoint_files`: the safetensors the model was just loaded from; the pages the conversion reads through their
    memory maps are given back as it goes (mapped_pages.py)."""
    if path not in CPU_PATHS[1:]:
        raise ValueError(f"apply_cpu_path takes one of {', '.join(CPU_PATHS[1:])}, got {path!r}")
    codec = model.codec
    if path in WEIGHT_FORMATS:
        release = None if checkpoint_files is None else PageRelease(model, checkpoint_files)
        if release is not None:
            release()  # what transformers read and copied while loading (the FP8 experts)
        convert_weights(model, path, narrow_tables, release)
        widen_rest(model, release)
        if release is not None:
            release()
        set_config_dtype(model.config, COMPUTE_DTYPE)
    elif path == "bfloat16":
        for part in (model.backbone, model.lm_head, model.tower):
            part.to(torch.bfloat16)
    if codec is not None:
        codec_for_path(codec, path)
    if path != "float32":
        use_cpu_linear_attention(model.backbone)
    if model.config.text_config._attn_implementation in (None, "sdpa"):
        # Set on the configuration, which hands it down to its sub-configurations (the backbone's, the tower's and the
        # codec's, which the codec ignores); `set_attn_implementation` would warn that the codec's sub-model is
        # not among the modules it walks.
        model.config._attn_implementation = CPU_ATTENTION
    model.cpu_path = path


def set_config_dtype(config, dtype: torch.dtype) -> None:
    """Record `dtype` as the dtype of `config` and of its sub-configurations (what a float32 load records)."""
    config.dtype = dtype
    for name in config.sub_configs:
        sub_config = getattr(config, name, None)
        if sub_config is not None:
            set_config_dtype(sub_config, dtype)


def codec_for_path(codec: nn.Module, path: str, source: str | None = None) -> None:
    """Bring the codec to `path`, in place: float32, with its decoding transformer's linears in float16 on the
    float16 and int8 paths (`narrow_codec`, with its `source`)."""
    codec.float()
    if path in WEIGHT_FORMATS:
        narrow_codec(codec, source)


__all__ = ["CPU_PATHS", "ENVIRONMENT_VARIABLE", "apply_cpu_path", "check_cpu_path", "codec_for_path",
           "cpu_path_for_load", "load_dtype", "narrow_codec", "native_bfloat16", "requested_cpu_path",
           "resolve_cpu_path"]
