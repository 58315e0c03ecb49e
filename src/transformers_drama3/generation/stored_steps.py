"""The frame step compiled ahead of time and kept on disk: the CPU path's step without a compile in the process.

The frame step compiled by inductor (`torch.compile(..., fullgraph=True)`) runs a CPU frame in a third to a half of
the eager step's time, but compiling it takes minutes, and a later process that finds inductor's kernels in its cache still
traces the step again (tens of seconds). torch's ahead-of-time compile keeps the traced code too
(`torch.compile(...).aot_compile`, `save_compiled_function`, `torch.compiler.load_compiled_function`): a later
process loads a stored step in a second, the first time, and in a fraction of one after that (docs/performance.md,
"The CPU path").

`StepStore` keeps one file per *step key*: a hash of everything the compiled code depends on besides the values of
tensors (`model_description`: versions and sources, the CPU's vector capability and the thread count, the model's
configuration, modules, parameter shapes and dtypes; `state_description`: the state's sizes, the attention window and
the sampling variant). Dynamo's guards do that work for an in-process compile, but on this step they cannot all be stored (identity
and type guards on transformers' kernel wrappers), so a stored step keeps none and its key stands for them.

A model on the CPU path (`model.cpu_path` `"float16"`, the default one, or `"int8"`) runs the stored step of a frame
state when the store has it, the eager step otherwise, and a missing step is compiled for later processes by a
background process (`compile_later`): at low priority, and from the model's configuration alone (the weights are never read:
that process builds the model on the meta device and gives it uninitialised memory), so no call waits for a compile.
States of more than `MAX_SLOTS` slots run the eager step. `DRAMA3_STEP_STORE` names the store's folder (default
`$XDG_CACHE_HOME/transformers_drama3/steps`, or `~/.cache/...`), or `off`. Compiled kernels go to inductor's cache,
which the store keeps in its own `inductor` folder unless `TORCHINDUCTOR_CACHE_DIR` says otherwise.
"""

from __future__ import annotations

import contextlib
import functools
import getpass
import hashlib
import json
import logging
import os
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path

import torch

from ..cpu_weights import WEIGHT_FORMATS

STORE_VARIABLE = "DRAMA3_STEP_STORE"
INDUCTOR_VARIABLE = "TORCHINDUCTOR_CACHE_DIR"
STORE_FORMAT = 1  # bumped when what a key covers changes
STALE_LOCK_S = 4 * 3600  # a background compile that held its lock this long is taken to be dead
RECHECK_S = 1.0  # how often a running state looks for a step compiled while it runs
# The most slots a stored step is compiled for: each state size is a step of its own, with a background compile of
# minutes, so only the sizes a CPU serves most (a call, a few requests batched) get one; larger states run the eager
# step.
MAX_SLOTS = 8
logger = logging.getLogger(__name__)


def frame_step(state, visible: int, sampling, stopping) -> None:
    """The function that is compiled and stored: one `FrameState.step` without a host-side logits hook."""
    state.step(visible, sampling, stopping)


def drop_guards(entries) -> list[bool]:
    """Dynamo guard filter keeping no guard (module docstring: the step key stands for them)."""
    return [False] * len(entries)


def _digest(value) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()


@functools.cache
def source_digest() -> str:
    """A hash of the package's Python sources, read once a process (an edited checkout must not load steps traced
    from other code)."""
    root = Path(__file__).resolve().parent.parent
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def model_description(model) -> dict:
    """What a compiled step depends on in the model and the process (the state's part is `state_description`'s)."""
    import transformers

    config = model.config.to_dict()
    for name in ("_name_or_path", "transformers_version", "architectures", "quantization_config", "codec_config"):
        config.pop(name, None)
    text = model.config.text_config
    tensors = [(name, list(t.shape), list(t.stride()), str(t.dtype))
               for name, t in (*model.named_parameters(), *model.named_buffers()) if not name.startswith("codec.")]
    modules = [(name, f"{type(m).__module__}.{type(m).__qualname__}")
               for name, m in model.named_modules() if not name.startswith("codec")]
    return {
        "format": STORE_FORMAT,
        "versions": [sys.version.split()[0], torch.__version__, transformers.__version__],
        "sources": source_digest(),
        "machine": [torch.backends.cpu.get_cpu_capability(), torch.get_num_threads()],
        "config": config,
        "implementations": [text._attn_implementation, getattr(text, "_experts_implementation", None),
                            model.config.audio_decoder_config._attn_implementation, model.cpu_path],
        "tensors": _digest(tensors),
        "modules": _digest(modules),
    }


def state_description(state, visible: int, sampling, stopping) -> dict:
    """The state's part of a step key: its sizes, its buffers' dtypes, the window and the rules' classes."""
    names = [f"{type(rule).__module__}.{type(rule).__qualname__}" for rule in (sampling, *stopping)]
    return {
        "sizes": [state.batch, state.capacity, state.ras_window, visible],
        "variant": [list(state.sampler.key), state.scores is not None, state.head_weight is None],
        "dtypes": [str(state.hidden.dtype), str(state.tower_cache.layers[0].keys.dtype)],
        "rules": names,
    }


def step_key(model_part: dict, state_part: dict) -> tuple[str, str]:
    """The folder of a model's steps and the file name of one step in it."""
    return _digest(model_part)[:32], _digest(state_part)[:32]


def model_key(model) -> str:
    """The folder of the model's steps in a store."""
    return _digest(model_description(model))[:32]


def default_directory() -> Path | None:
    """The store's folder (`DRAMA3_STEP_STORE`, or the user's cache folder), or None when it is `off`."""
    chosen = os.environ.get(STORE_VARIABLE, "").strip()
    if chosen.lower() == "off":
        return None
    if chosen:
        return Path(chosen).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "transformers_drama3" / "steps"


class StepStore:
    """Stored compiled steps in `directory`: `<model key>/<state key>.step`, with `.json` (what the key covers),
    `.lock` and `.pid` (a background compile running, its process), `.log` (its output), `.failed` (its error: not
    tried again) beside each."""

    def __init__(self, directory: Path):
        self.directory = Path(directory)
        self.inductor = self.directory / "inductor"
        self._loaded: dict[Path, object] = {}
        self.used: set[Path] = set()  # the steps this process loaded
        self._asked: set[Path] = set()
        self._lock = threading.Lock()

    def path(self, key: tuple[str, str]) -> Path:
        return self.directory / key[0] / f"{key[1]}.step"

    def kernel_folder(self) -> str:
        """Inductor's cache folder, where a stored step's kernels are compiled and found: the store's `inductor`
        folder unless `TORCHINDUCTOR_CACHE_DIR` names another one than inductor's default (a temporary folder, which
        would lose the kernels of steps stored for good). Inductor reads the variable whenever it looks."""
        current = os.environ.get(INDUCTOR_VARIABLE)
        default = os.path.join(tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}")  # as inductor names it
        if current is None or os.path.abspath(current) == default:
            os.environ[INDUCTOR_VARIABLE] = current = str(self.inductor)
        return os.path.abspath(current)

    def load(self, key: tuple[str, str]):
        """The stored step under `key` (`fn(state, visible, sampling, stopping)`), or None when there is none."""
        path = self.path(key)
        with self._lock:
            if path in self._loaded:
                return self._loaded[path]
            if not path.is_file():
                return None
            step = None
            try:
                kernels = json.loads(path.with_suffix(".json").read_text())["kernels"]
                if kernels != self.kernel_folder():  # loading it would compile its kernels again, for minutes
                    logger.warning("the stored frame step %s has its kernels in %s, not in %s=%s: it is not used",
                                   path, kernels, INDUCTOR_VARIABLE, os.environ[INDUCTOR_VARIABLE])
                else:
                    with open(path, "rb") as file:
                        step = torch.compiler.load_compiled_function(file)
            except Exception as error:  # noqa: BLE001  (a stale or damaged file: the eager step runs)
                logger.warning("the stored frame step %s could not be loaded (%s): the eager step runs", path, error)
            if step is not None:
                self.used.add(path)
                with contextlib.suppress(OSError):  # (a store that cannot be written still serves its steps)
                    os.utime(path)  # the most recently used step is the one `preload` loads
            self._loaded[path] = step
            return step

    def compile(self, state, visible: int, sampling, stopping, key: tuple[str, str], backend: str = "inductor",
                description: dict | None = None):
        """Compile the step of `state` ahead of time and store it under `key` (with `description` in its `.json`);
        returns it."""
        path = self.path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        kernels, started = self.kernel_folder(), time.perf_counter()
        compiled = torch.compile(frame_step, fullgraph=True, dynamic=False, backend=backend,
                                 options={"guard_filter_fn": drop_guards})
        with torch.no_grad(), warnings.catch_warnings():
            # A fused kernel that reads a bfloat16 table and writes a float16 product input makes inductor note the
            # mix of 16-bit types: a notice (its C++ kernels compute between 16-bit loads and stores in float32).
            warnings.filterwarnings("ignore", "bf16 and fp16 are mixed", UserWarning)
            step = compiled.aot_compile(((state, visible, sampling, stopping), {}))
        written = path.with_suffix(".partial")
        step.save_compiled_function(str(written))
        path.with_suffix(".json").write_text(json.dumps(
            {"kernels": kernels, "compile_s": time.perf_counter() - started, **(description or {})}, indent=1,
            default=str))
        os.replace(written, path)  # last: a step is never seen without its `.json`
        return step

    def compile_later(self, request: dict, key: tuple[str, str]) -> bool:
        """Start a background process that compiles the step `request` describes (`compile_request`) into the
        store, unless one runs or failed for `key`; returns whether one was started. A store that cannot be written
        (or a process that cannot be started) leaves the eager step, with a warning."""
        path = self.path(key)
        with self._lock:
            if path in self._asked:
                return False
            self._asked.add(path)
        try:
            return self._start(request, key, path)
        except OSError as error:
            logger.warning("the CPU frame step is not compiled for later runs: %s (the eager step runs)", error)
            return False

    def _start(self, request: dict, key: tuple[str, str], path: Path) -> bool:
        lock, failed = path.with_suffix(".lock"), path.with_suffix(".failed")
        if failed.exists() or path.exists():
            return False
        path.parent.mkdir(parents=True, exist_ok=True)
        for other in self.directory.glob("*/*.lock"):  # one background compile at a time: the others wait
            if compiling(other):
                with self._lock:
                    self._asked.discard(path)  # asked again at the runner's next look
                return False
            other.unlink(missing_ok=True)  # its process died (killed, or the machine restarted)
            other.with_suffix(".pid").unlink(missing_ok=True)
        try:
            descriptor = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return False
        with os.fdopen(descriptor, "w") as file:
            json.dump({**request, "key": list(key), "store": str(self.directory)}, file)
        environment = {**os.environ, "OMP_NUM_THREADS": str(request["threads"]), INDUCTOR_VARIABLE: self.kernel_folder()}
        try:
            process = start_compile(lock, environment)
        except OSError:
            lock.unlink(missing_ok=True)
            raise
        if lock.exists():  # (a compile that already ended needs no process id)
            lock.with_suffix(".pid").write_text(str(process))
        logger.info("compiling the CPU frame step for later runs in the background (process %s, log %s); this run "
                    "uses the eager step", process, path.with_suffix(".log"))
        return True

    def preload(self, model_key: str) -> None:
        """Load the model's most recently used stored step, so that the process's one-time costs of loading one
        (inductor's runtime, its check of the CPU) fall on the model's load, not on its first frame."""
        folder = self.directory / model_key
        try:
            steps = sorted(folder.glob("*.step"), key=lambda p: p.stat().st_mtime) if folder.is_dir() else []
        except OSError:  # a step removed while listing: the next frame looks again
            return
        if steps:
            self.load((model_key, steps[-1].stem))


def compiling(lock: Path) -> bool:
    """Whether the background compile holding `lock` still runs: its process (`.pid` beside it; a lock without one is
    being started) is alive, and it has held the lock for less than `STALE_LOCK_S`."""
    try:
        if time.time() - lock.stat().st_mtime > STALE_LOCK_S:
            return False
        pid = int(lock.with_suffix(".pid").read_text())
    except FileNotFoundError:
        return lock.exists()
    except (OSError, ValueError):
        return False
    if pid <= 0:
        return False
    if os.name != "posix":  # (elsewhere os.kill ends the process: the lock's age decides alone)
        return True
    try:
        os.kill(pid, 0)  # signal 0: is it there
    except ProcessLookupError:
        return False
    except PermissionError:  # there, another user's
        return True
    return True


def start_compile(lock: Path, environment: dict) -> int:
    """Start the background process that compiles the step `lock` describes (`compile_in_background`), in a session
    of its own (it outlives the caller), its output in the step's `.log`; returns its process id."""
    command = f"from {__name__} import compile_in_background; compile_in_background({str(lock)!r})"
    with open(lock.with_suffix(".log"), "w") as log:
        return subprocess.Popen([sys.executable, "-c", command], stdout=log, stderr=log, stdin=subprocess.DEVNULL,
                                env=environment, start_new_session=True).pid


_STORES: dict[Path, StepStore] = {}


def store_at(directory: Path) -> StepStore:
    """The process's one `StepStore` for `directory` (its loaded steps are shared by every runner)."""
    return _STORES.setdefault(Path(directory), StepStore(directory))


def store_for(model) -> StepStore | None:
    """The step store a model's frame steps use: on the float16 and int8 CPU paths when the store is not `off`, else
    None."""
    if getattr(model, "cpu_path", None) not in WEIGHT_FORMATS:
        return None
    directory = default_directory()
    return None if directory is None else store_at(directory)


def preload_steps(model) -> None:
    """At a CPU-path model's load: its most recently used stored step, when its store has one (`StepStore.preload`)."""
    store = store_for(model)
    if store is not None:
        store.preload(model_key(model))


def compile_request(model, state, visible: int, sampling) -> dict:
    """What a background process needs to build the same step: the model's configuration and implementations,
    the state's sizes and sampling variant, the thread count."""
    from ..cpu_weights import CpuEmbedding
    from ..modeling_drama3 import CandidateRowsHead  # (here: modeling_drama3 imports this module)

    text = model.config.text_config
    return {"config": model.config.to_dict(), "cpu_path": model.cpu_path, "attention": text._attn_implementation,
            "experts": getattr(text, "_experts_implementation", None),
            "candidate_rows_only": isinstance(model.lm_head, CandidateRowsHead),
            "narrow_tables": isinstance(model.tower.codebook_embeddings, CpuEmbedding),
            "batch": state.batch, "capacity": state.capacity, "ras_window": state.ras_window,
            "scores": state.scores is not None, "visible": visible, "sampling": state.sampler.sampling,
            "threads": torch.get_num_threads()}


def rebuilt_state(request: dict):
    """The model and frame state a request describes, built from its configuration on uninitialised memory (the
    values are never used: only shapes, dtypes and code matter to the compiled step), and its rules."""
    from ..configuration_drama3 import FishOmniConfig
    from ..cpu_path import apply_cpu_path
    from ..modeling_drama3 import FishOmniForSpeech
    from .rules import Drama3FrameSampling, frame_criteria
    from .settings import generation_settings
    from .state import FrameState

    config = FishOmniConfig.from_dict(request["config"])
    config.text_config._attn_implementation = request["attention"]
    config.audio_decoder_config._attn_implementation = request["attention"]
    with torch.device("meta"):
        model = FishOmniForSpeech(config, with_codec=False)
    apply_cpu_path(model, request["cpu_path"], narrow_tables=request["narrow_tables"])
    model.to_empty(device="cpu").eval()
    if request["experts"] is not None:
        model.set_experts_implementation(request["experts"])
    if request["candidate_rows_only"]:
        model.keep_candidate_head_rows()
    settings = generation_settings(model.generation_config, do_sample=request["sampling"])
    rows = torch.zeros(1, 1, 1 + config.num_codebooks, dtype=torch.long)
    with torch.no_grad():
        prefill = model(rows, torch.ones(1, 1, dtype=torch.long), use_cache=True, logits_to_keep=1)
    state = FrameState(model, request["batch"], request["capacity"], request["ras_window"], prefill.cache,
                       request["scores"])
    state.sampler.set_rows(slice(None), settings)
    return state, Drama3FrameSampling(), frame_criteria(model, settings)


def compile_into_store(request: dict) -> Path:
    """Build the step a request describes (`rebuilt_state`), check that its key is the one asked for, compile it into
    the request's store; returns the stored file."""
    store, key = StepStore(Path(request["store"])), tuple(request["key"])
    state, sampling, stopping = rebuilt_state(request)
    model_part = model_description(state.model)
    state_part = state_description(state, request["visible"], sampling, stopping)
    if step_key(model_part, state_part) != key:
        raise RuntimeError("the model rebuilt from its configuration does not match the one that asked for the step "
                           "(its key differs): such a model keeps the eager step")
    store.compile(state, request["visible"], sampling, stopping, key, description={"model": model_part,
                                                                                   "state": state_part})
    return store.path(key)


def compile_in_background(lock: str) -> None:
    """The background process (`StepStore.compile_later`): at low priority, compile the step its lock file describes
    into the store, then remove the lock; on a failure, write the error beside it (it is not tried again)."""
    lock = Path(lock)
    request = json.loads(lock.read_text())
    if hasattr(os, "nice"):  # (POSIX)
        os.nice(10)
    torch.set_num_threads(request["threads"])
    try:
        compile_into_store(request)
    except Exception as error:  # noqa: BLE001  (recorded for the parent, which then keeps the eager step)
        lock.with_suffix(".failed").write_text(f"{type(error).__name__}: {error}\n")
        raise
    finally:
        lock.unlink(missing_ok=True)
        lock.with_suffix(".pid").unlink(missing_ok=True)


__all__ = ["MAX_SLOTS", "STORE_VARIABLE", "StepStore", "compile_in_background", "compile_into_store", "compile_request",
           "compiling", "frame_step", "model_description", "model_key", "preload_steps", "rebuilt_state",
           "start_compile", "state_description", "step_key", "store_at", "store_for"]
