"""A stand-in second device for CPU-only tests: inside `stand_in_cuda()`, `cuda:0` exists and its memory is the CPU's.

A tensor "on" it is a `StandInTensor`: a wrapper that reports `device("cuda", 0)` and holds a CPU tensor, on which every
op runs (`__torch_dispatch__`). As on a real GPU, an op that mixes it with CPU tensors raises, 0-d CPU scalars and
the CPU index tensors of advanced indexing aside; reading its data as numpy raises too. Tensors get there the ways
torch puts them on a GPU: `.to("cuda")`, `.cuda()`, `device="cuda"` in factory calls, `module.to("cuda")`, and ops
on tensors already there; `.cpu()` and `.to("cpu")` bring copies back. The factory calls go through a
`TorchFunctionMode` and a `TorchDispatchMode` (both thread-local), entered in every thread started while the stand-in
is on, so the server's and the streamer's threads see it too.

`torch.cuda.is_available()` says True; `torch.cuda.Stream`, `Event`, `current_stream`, `stream` and
`torch.Generator(device="cuda")` get stand-ins, and `CUDA_LOG` records which thread waited on which event, and on
which stream; `HOST_READS` records every read of a stand-in tensor's data by the host (`item`, `tolist`, `bool`,
`.cpu()`, ...). What cannot be stood in for is not: CUDA graphs, `torch.compile` for CUDA, real kernels, and
autograd (a CPU-only torch has no CUDA device guard, which autograd sets for a gradient on a CUDA tensor: an op that
would record one raises `NotImplementedError` instead; Python bindings that set a guard before dispatching, such as
indexing, run on the CPU tensors behind their arguments with the same device rules). The acceptance run on a GPU
(benchmarks/gpu_paths.py, the first stage of benchmarks/gpu_check.sh) covers those.

Why not `FakeTensorMode`: the user paths read values back (stop flags, codes, audio), which fake tensors do not hold.
"""

from __future__ import annotations

import contextlib
import copy
import threading
from collections.abc import Iterator

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

STAND_IN = torch.device("cuda", 0)
STAND_IN_MEMORY = 16 * 2**30  # bytes the stand-in says it has (free and in all): the tiny models need far less
CPU = torch.device("cpu")
aten = torch.ops.aten

# Ops that take tensors on several devices on a real GPU: copies between devices, and advanced indexing, whose index
# tensors may stay on the CPU (argument 1 of these ops).
_CROSS_DEVICE = {aten.copy_.default, aten._to_copy.default, aten._copy_from.default, aten._copy_from_and_resize.default}
_CPU_INDICES = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default}
# In-place ops that change a tensor's shape: the wrapper's own shape would go stale, so they are refused loudly.
_RESHAPING_IN_PLACE = {aten.resize_.default, aten.unsqueeze_.default, aten.squeeze_.default, aten.squeeze_.dim,
                       aten.t_.default, aten.transpose_.default, aten.as_strided_.default, aten.set_.source_Tensor}


class StandInDeviceError(RuntimeError):
    """An op mixed tensors of the stand-in device with CPU tensors (a real GPU refuses it)."""


def is_stand_in(value) -> bool:
    return isinstance(value, StandInTensor)


def _flat(args, kwargs=None) -> list:
    """The arguments of an op with its lists spread out (an op's schema nests no deeper), without pytree's cost."""
    flat = []
    for value in (*args, *(kwargs or {}).values()):
        if isinstance(value, (list, tuple)):
            flat.extend(value)
        else:
            flat.append(value)
    return flat


def _on_stand_in(device) -> bool:
    """Whether a `device=` argument names the stand-in (a CUDA device, or a bare CUDA index)."""
    if device is None:
        return False
    if isinstance(device, int) and not isinstance(device, bool):
        return True
    return torch.device(device).type == "cuda"


class StandInTensor(torch.Tensor):
    """A tensor on the stand-in device: reports `cuda:0`, holds `inner` (a CPU tensor with the same layout)."""

    inner: torch.Tensor

    @staticmethod
    def __new__(cls, inner: torch.Tensor):
        assert not isinstance(inner, StandInTensor) and inner.device.type == "cpu", (type(inner), inner.device)
        wrapper = torch.Tensor._make_wrapper_subclass(
            cls, inner.shape, strides=inner.stride(), storage_offset=inner.storage_offset(), dtype=inner.dtype,
            layout=inner.layout, device=STAND_IN, requires_grad=False,
        )
        wrapper.inner = inner
        return wrapper

    def __repr__(self, *, tensor_contents=None) -> str:
        return f"StandInTensor({self.inner!r}, device='{STAND_IN}')"

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return run_op(func, args, kwargs or {})


def _unwrap(value):
    return value.inner if is_stand_in(value) else value


def _check_devices(func, flat: list, args) -> None:
    """Raise on a mix of stand-in and CPU tensors that a GPU refuses (`flat`: the op's arguments, flattened)."""
    if func in _CROSS_DEVICE:
        return
    if func in _CPU_INDICES:
        flat = _flat(args[:1] + args[2:])
    on_cpu = [t for t in flat if isinstance(t, torch.Tensor) and type(t) is not StandInTensor
              and t.device.type == "cpu" and t.dim() > 0]
    if on_cpu:
        shapes = ", ".join(str(tuple(t.shape)) for t in on_cpu)
        raise StandInDeviceError(
            f"{func}: expected all tensors to be on the same device, but found at least two devices, {STAND_IN} and "
            f"cpu (the CPU tensors have shapes {shapes}; stand-in device)"
        )


def _check_generator(func, kwargs, on_stand_in: bool) -> None:
    """A draw on the stand-in needs a generator made for it, and a draw on the CPU a CPU one (as CUDA says)."""
    generator = kwargs.get("generator")
    if generator is None:
        return
    generator_there = isinstance(generator, StandInGenerator) and generator.on_stand_in
    if generator_there != on_stand_in:
        wanted, found = ("cuda", "cpu") if on_stand_in else ("cpu", "cuda")
        raise StandInDeviceError(f"{func}: expected a '{wanted}' device type for generator but found '{found}' "
                                 "(stand-in device)")


def run_op(func, args, kwargs):
    """Run one aten op on the CPU tensors behind its arguments; outputs go on the stand-in when an input is there or
    when `device=` names it."""
    flat = _flat(args, kwargs)
    marked = any(type(t) is StandInTensor for t in flat)
    if not marked and "device" not in kwargs:
        return func(*args, **kwargs)
    if marked and func in _RESHAPING_IN_PLACE:
        raise NotImplementedError(f"the stand-in device does not follow {func} (an in-place change of shape)")
    if func is aten._fused_sdp_choice.default:
        return int(torch.nn.attention.SDPBackend.MATH)  # the kernels of the other backends are CUDA's own
    if marked:
        _check_devices(func, flat, args)
    if "device" in kwargs:
        marked = _on_stand_in(kwargs["device"])
        kwargs = {**kwargs, "device": CPU if marked else kwargs["device"]}
    if func is aten.histc.default and marked and not args[0].is_floating_point():
        # CUDA's histc counts integers, the CPU's only floats (transformers' grouped experts count tokens with it)
        inner = args[0].inner
        return StandInTensor(func(inner.float(), *args[1:], **kwargs).to(inner.dtype))
    originals = {}
    inner_args, inner_kwargs = tree_map(lambda t: _unwrap_noting(t, originals), (args, kwargs))
    out = func(*inner_args, **inner_kwargs)
    if not marked:
        return out

    def wrap(value):
        if not isinstance(value, torch.Tensor) or value.device.type != "cpu":
            return value
        original = originals.get(id(value))  # an in-place op returns its own input
        return original if original is not None else StandInTensor(value)

    return tree_map(wrap, out)


def _unwrap_noting(value, originals: dict):
    """`_unwrap`, noting which argument each CPU tensor came from (by id)."""
    if isinstance(value, torch.Tensor):
        inner = _unwrap(value)
        originals[id(inner)] = value
        return inner
    return value


class _Dispatch(TorchDispatchMode):
    """Sees the factory calls made inside C++ (a composite op's buffers) with `device=cuda`."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return run_op(func, args, kwargs or {})


def _to_arguments(args, kwargs):
    """`Tensor.to`'s arguments -> (device, dtype, non_blocking, copy) (torch's own parser)."""
    kwargs = dict(kwargs)
    copy = kwargs.pop("copy", False)
    device, dtype, non_blocking, _ = torch._C._nn._parse_to(*args, **kwargs)
    return device, dtype, non_blocking, copy


# Tensor methods and properties that build no autograd graph (so are fine on tensors that need gradients).
_NO_GRAPH = {"__get__", "__set__", "size", "dim", "stride", "numel", "__len__", "__repr__", "__format__", "detach",
             "requires_grad_", "is_contiguous", "element_size", "data_ptr", "__hash__", "untyped_storage",
             "is_floating_point", "is_complex", "is_signed", "get_device"}


def _to(func, args, kwargs):
    tensor = args[0]
    device, dtype, non_blocking, copy = _to_arguments(args[1:], kwargs)
    if device is not None and _on_stand_in(device):
        if is_stand_in(tensor):
            return func(tensor, dtype=dtype, copy=copy) if dtype is not None else tensor
        return StandInTensor(tensor.detach().to(dtype=dtype or tensor.dtype, copy=True))
    if device is not None and device.type == "cpu" and is_stand_in(tensor):
        return tensor.inner.to(dtype=dtype or tensor.dtype, copy=True)
    return func(*args, **kwargs)


def _as_tensor(func, args, kwargs):
    tensor = args[0] if args else None
    if not is_stand_in(tensor):
        return _call(func, args, kwargs)
    device, dtype = kwargs.get("device"), kwargs.get("dtype")  # a no-op on its own device
    if device is not None and not _on_stand_in(device):
        return tensor.inner.to(device=device, dtype=dtype or tensor.dtype, copy=True)
    return tensor if dtype is None else tensor.to(dtype)


def _cuda(func, args, kwargs):
    return args[0] if is_stand_in(args[0]) else StandInTensor(args[0].detach().clone())


def _cpu(func, args, kwargs):
    return args[0].inner.clone() if is_stand_in(args[0]) else func(*args, **kwargs)


def _numpy(func, args, kwargs):
    if is_stand_in(args[0]):
        raise TypeError(f"can't convert {STAND_IN} device type tensor to numpy. Use Tensor.cpu() to copy the tensor to "
                        "host memory first. (stand-in device)")
    return func(*args, **kwargs)


def _host_data(func, args, kwargs):
    """What reads a tensor's data from the host (`tolist`, `data_ptr`, ...): the CPU tensor behind it."""
    return func(_unwrap(args[0]), *args[1:], **kwargs)


def _deepcopy(func, args, kwargs):
    tensor, memo = args
    if not is_stand_in(tensor):
        return func(*args, **kwargs)
    if id(tensor) not in memo:
        memo[id(tensor)] = StandInTensor(copy.deepcopy(tensor.inner, memo))
    return memo[id(tensor)]


def _set_data(func, args, kwargs):
    """`tensor.data = other`: the wrapper takes `other`'s metadata (dtype, shape) and its CPU tensor too (transformers
    5.17's loader casts parameters this way)."""
    tensor, other = args
    out = func(*args, **kwargs)
    if is_stand_in(tensor):
        if not is_stand_in(other):
            raise StandInDeviceError("tensor.data = a CPU tensor on a stand-in tensor: move it with .to('cuda') first")
        tensor.inner = other.inner
    return out


def _pin_memory(func, args, kwargs):
    """No pinned memory without a GPU: the copy it would speed up is the same."""
    if is_stand_in(args[0]):
        raise RuntimeError("cannot pin a CUDA tensor (stand-in device)")
    return args[0]


_SPECIAL = {
    torch.Tensor.to: _to, torch.as_tensor: _as_tensor, torch.asarray: _as_tensor, torch.Tensor.cuda: _cuda,
    torch.Tensor.cpu: _cpu, torch.Tensor.numpy: _numpy, torch.Tensor.__array__: _numpy,
    torch.Tensor.tolist: _host_data, torch.Tensor.data_ptr: _host_data, torch.Tensor.untyped_storage: _host_data,
    torch.Tensor.__format__: _host_data, torch.Tensor.pin_memory: _pin_memory, torch.Tensor.__deepcopy__: _deepcopy,
}


def _call(func, args, kwargs):
    """Any other torch function: factories given `device="cuda"` make CPU tensors put on the stand-in; generators
    are checked; bindings that need a CUDA device guard run on the CPU tensors."""
    device, generator = kwargs.get("device"), kwargs.get("generator")
    if generator is not None:  # (checked here: dispatch sees torch's Generator, not the stand-in's)
        on_device = _on_stand_in(device) or any(is_stand_in(t) for t in _flat(args))
        _check_generator(func, kwargs, on_device)
    if device is not None and _on_stand_in(device):
        tensor = args[0] if args else None
        out = func(*args, **{**kwargs, "device": CPU})
        return tree_map(lambda t: StandInTensor(t.detach().clone() if t is tensor else t)
                        if isinstance(t, torch.Tensor) and not is_stand_in(t) else t, out)
    try:
        return func(*args, **kwargs)
    except RuntimeError as error:
        if _NO_GUARD not in str(error):
            raise
    return _run_on_inner(func, args, kwargs)  # raised by the guard, before any work: nothing ran twice


# What reads a tensor's data back to the host: each waits for the device, and a CUDA graph capture refuses it.
_READING = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy", "__array__"}
HOST_READS: list[tuple[str, str]] = []  # (thread name, function) of each read of a stand-in tensor's data


class _Functions(TorchFunctionMode):
    """Moves between the CPU and the stand-in, and the factory calls given `device="cuda"`."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", None)
        if (name in _READING or (func is torch.Tensor.to and _to_arguments(args[1:], kwargs)[0] == CPU)) and args \
                and is_stand_in(args[0]):
            HOST_READS.append((threading.current_thread().name, name))
        if (torch.is_grad_enabled() and getattr(func, "__name__", None) not in _NO_GRAPH
                and any(is_stand_in(t) and t.requires_grad for t in _flat(args, kwargs))):
            # autograd's C++ side sets a CUDA device guard for a gradient on a CUDA tensor, which a CPU-only torch
            # cannot (it aborts the process): refuse cleanly instead
            raise NotImplementedError(f"{func.__name__}: the stand-in device has no autograd (run it under no_grad)")
        if name == "__set__" and getattr(getattr(func, "__self__", None), "__name__", None) == "data":
            return _set_data(func, args, kwargs)
        return _SPECIAL.get(func, _call)(func, args, kwargs)


# What a Python binding says when it sets a CUDA device guard before dispatching (`contiguous`, indexing, `int()`,
# ...), which a CPU-only torch cannot: such a binding runs on the CPU tensors behind its arguments instead, with the
# same device rules.
_NO_GUARD = "not linked with support for cuda devices"


def _is_advanced(index) -> bool:
    """Whether an index (of `__getitem__` / `__setitem__`) is advanced indexing (tensors or lists in it)."""
    parts = index if isinstance(index, tuple) else (index,)
    return any(isinstance(part, list) or (isinstance(part, torch.Tensor) and part.dim() > 0) for part in parts)


def _check_indexing(func, args) -> None:
    """The device rules of indexing on a GPU: index tensors on the CPU or on the indexed tensor's device; values
    assigned through an advanced index on that device too (a slice assignment copies from anywhere)."""
    base, index = args[0], args[1]
    indices = [t for t in tree_flatten(index)[0] if isinstance(t, torch.Tensor)]
    if not is_stand_in(base) and any(is_stand_in(t) for t in indices):
        raise StandInDeviceError(f"{func.__name__}: indices should be either on cpu or on the same device as the "
                                 "indexed tensor (cpu) (stand-in device)")
    if func is torch.Tensor.__setitem__ and _is_advanced(index) and isinstance(args[2], torch.Tensor):
        value = args[2]
        if is_stand_in(value) != is_stand_in(base) and value.dim() > 0:
            raise StandInDeviceError(f"__setitem__: the values of an index assignment must be on the indexed "
                                     f"tensor's device ({base.device}), got {value.device} (stand-in device)")


def _run_on_inner(func, args, kwargs):
    """`func` on the CPU tensors behind its arguments, its tensor outputs on the stand-in."""
    if func in (torch.Tensor.__getitem__, torch.Tensor.__setitem__):
        _check_indexing(func, args)
    elif func is not torch.Tensor.copy_:  # copies between devices are what a GPU allows
        _check_devices(func, _flat(args, kwargs), args)
    out = func(*tree_map(_unwrap, args), **tree_map(_unwrap, kwargs))
    return tree_map(lambda t: StandInTensor(t) if isinstance(t, torch.Tensor) else t, out)


# -- streams, events and generators ---------------------------------------------------------------------------------

CUDA_LOG: list[tuple[str, str, object]] = []  # (thread name, what happened, the stream or event it happened to)
_current = threading.local()


class StandInStream:
    """`torch.cuda.Stream`: work on the stand-in runs at once, so a stream only records who waits on what."""

    def __init__(self, device=None, priority: int = 0, name: str = "side"):
        self.name = name

    def wait_event(self, event) -> None:
        CUDA_LOG.append((threading.current_thread().name, f"stream {self.name} waits on an event", event))

    def wait_stream(self, stream) -> None:
        CUDA_LOG.append((threading.current_thread().name, f"stream {self.name} waits on stream {stream.name}", stream))

    def synchronize(self) -> None:
        CUDA_LOG.append((threading.current_thread().name, f"host waits on stream {self.name}", self))

    def query(self) -> bool:
        return True

    def __repr__(self) -> str:
        return f"StandInStream({self.name})"


DEFAULT_STREAM = StandInStream(name="default")


def current_stream(device=None) -> StandInStream:
    return getattr(_current, "stream", DEFAULT_STREAM)


@contextlib.contextmanager
def stream_context(stream: StandInStream | None) -> Iterator[None]:
    """`torch.cuda.stream(s)`: `s` is the current stream of this thread inside."""
    saved = current_stream()
    _current.stream = stream if stream is not None else saved
    try:
        yield
    finally:
        _current.stream = saved


class StandInEvent:
    """`torch.cuda.Event`: records where it was recorded and who waited on it."""

    def __init__(self, *args, **kwargs):
        self.stream: StandInStream | None = None

    def record(self, stream: StandInStream | None = None) -> None:
        self.stream = stream or current_stream()
        CUDA_LOG.append((threading.current_thread().name, f"event recorded on stream {self.stream.name}", self))

    def synchronize(self) -> None:
        CUDA_LOG.append((threading.current_thread().name, "host waits on an event", self))

    def wait(self, stream: StandInStream | None = None) -> None:
        (stream or current_stream()).wait_event(self)

    def query(self) -> bool:
        return True


def _record_stream(tensor: torch.Tensor, stream: StandInStream) -> None:
    """`Tensor.record_stream`: the caching allocator's note that `stream` uses the tensor (nothing to free here)."""
    if not is_stand_in(tensor):
        raise RuntimeError("record_stream is for tensors on a GPU, got a CPU tensor (stand-in device)")
    CUDA_LOG.append((threading.current_thread().name, f"a tensor is used on stream {stream.name}", stream))


class StandInGenerator(torch.Generator):
    """`torch.Generator(device=...)`: one on the stand-in draws with a CPU generator (the same numbers as a CPU
    generator with the same seed) and says it is on `cuda:0`."""

    def __new__(cls, device="cpu"):
        generator = super().__new__(cls)
        generator.on_stand_in = _on_stand_in(device)
        return generator

    def __init__(self, device="cpu"):
        pass

    @property
    def device(self) -> torch.device:
        return STAND_IN if self.on_stand_in else CPU


# -- switching it on ------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _modes() -> Iterator[None]:
    with _Functions(), _Dispatch():
        yield


@contextlib.contextmanager
def stand_in_cuda(monkeypatch) -> Iterator[None]:
    """Make `cuda:0` the stand-in device in this thread and in every thread started inside (with pytest's
    `monkeypatch`, which undoes the patches)."""
    CUDA_LOG.clear()
    patches = {
        "is_available": lambda: True, "device_count": lambda: 1, "current_device": lambda: 0,
        "set_device": lambda device: None, "synchronize": lambda device=None: None, "empty_cache": lambda: None,
        "get_device_capability": lambda device=None: (8, 0), "get_device_name": lambda device=None: "stand-in",
        "is_bf16_supported": lambda *args, **kwargs: True, "Stream": StandInStream, "Event": StandInEvent,
        "current_stream": current_stream, "default_stream": lambda device=None: DEFAULT_STREAM,
        "stream": stream_context, "device": lambda device=None: contextlib.nullcontext(),
        # what transformers' loader asks before a `device_map` load (its caching-allocator warm-up): room for it all
        "mem_get_info": lambda device=None: (STAND_IN_MEMORY, STAND_IN_MEMORY),
        "memory_allocated": lambda device=None: 0, "memory_reserved": lambda device=None: 0,
    }
    for name, value in patches.items():
        monkeypatch.setattr(torch.cuda, name, value)
    monkeypatch.setattr(torch, "Generator", StandInGenerator)
    monkeypatch.setattr(torch.Tensor, "record_stream", _record_stream)
    # `module.to("cuda")` then puts new Parameters in the module (torch's future default) instead of setting
    # `param.data` to a tensor of another type, which would keep the old Python object without its CPU data
    monkeypatch.setattr(torch.__future__, "get_overwrite_module_params_on_conversion", lambda: True)
    run = threading.Thread.run

    def run_with_stand_in(thread):
        with _modes():
            run(thread)

    monkeypatch.setattr(threading.Thread, "run", run_with_stand_in)
    with _modes():
        yield


__all__ = ["CUDA_LOG", "DEFAULT_STREAM", "HOST_READS", "STAND_IN", "StandInDeviceError", "StandInTensor", "is_stand_in",
           "stand_in_cuda"]
