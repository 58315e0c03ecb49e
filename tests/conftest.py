"""Shared fixtures (the golden tiny checkpoint, a copy of shared/golden, and its expected outputs), the thread policy
of the test run and the machine facts printed at its start."""

import os

# One torch thread, and OpenMP threads that sleep instead of spinning while they wait. With torch's default (one
# spinning thread per core) small ops ran 100-1000x slower whenever another process wanted the CPU, and the tiny
# models here are as fast on one thread. Set before torch is imported (the OpenMP runtime reads them when it
# loads) and inherited by the CLI tests' subprocesses; a value already in the environment wins.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# Plain loads (no dtype) take the CPU path chosen for this CPU (cpu_path.py): float16 or bfloat16 weights. The suite's
# exact comparisons (golden values, round trips, CLI and server outputs) are about the float32 reference, so it runs
# with that path unless a test clears the variable (tests/test_cpu_path.py, the sampling-law tests on the CPU path).
os.environ.setdefault("DRAMA3_CPU_PATH", "float32")
# No stored compiled frame steps (generation/stored_steps.py): a CPU-path model in a test would otherwise write to the
# user's cache and start background compiles. tests/stored_step_support.py turns a store on where a test needs one.
os.environ.setdefault("DRAMA3_STEP_STORE", "off")

import json  # noqa: E402
import platform  # noqa: E402
import signal  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from importlib import metadata  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from hypothesis import settings  # noqa: E402

# `--hypothesis-profile=stress`: 10,000 examples for each property test that does not set its own number (.ci/run's
# stress stage runs tests/test_chunking.py with it).
settings.register_profile("stress", max_examples=10_000)

FIXTURES = Path(__file__).parent / "fixtures"
GOLDEN_TINY = FIXTURES / "tiny"


def golden_generation_model():
    """The golden tiny checkpoint in float32 with the eager per-expert loop its golden values were computed with."""
    from transformers_drama3 import FishOmniForSpeech

    model = FishOmniForSpeech.from_pretrained(GOLDEN_TINY, dtype=torch.float32)
    model.set_experts_implementation("eager")
    return model


@pytest.fixture(scope="session")
def golden_model():
    """`golden_generation_model()`, loaded once per run for the tests that do not change it (monkeypatched
    attributes are restored after each test; a test that changes weights or settings loads its own model)."""
    return golden_generation_model()


@pytest.fixture(scope="session")
def golden_float64_model():
    """The golden tiny checkpoint in float64 with eager experts, loaded once per run: the engine's tests compare codes
    exactly (tests/test_engine.py's docstring gives the reason)."""
    from transformers_drama3 import FishOmniForSpeech

    model = FishOmniForSpeech.from_pretrained(GOLDEN_TINY, dtype=torch.float64)
    model.set_experts_implementation("eager")
    return model


@pytest.fixture(scope="session")
def plain_tiny_model(tmp_path_factory):
    """A tiny random checkpoint with plain (not FP8) experts, in float64 with eager experts: the engine's many-request
    tests at a third less CPU time per prefill than the golden one."""
    from transformers_drama3 import FishOmniForSpeech
    from transformers_drama3.testing import write_tiny_checkpoint

    path = write_tiny_checkpoint(tmp_path_factory.mktemp("plain-tiny"), quantization_config=None)
    model = FishOmniForSpeech.from_pretrained(path, dtype=torch.float64)
    model.set_experts_implementation("eager")
    return model


@pytest.fixture(scope="session")
def engine_prompts(expected):
    """Three prompts of different lengths (10, 6 and 14 rows)."""
    a, b = expected["prompt_a_rows"], expected["prompt_b_rows"]
    return [a[:10], b[:6], torch.cat((b[:4], a[:10]))]


@pytest.fixture(scope="session")
def golden_processor():
    """The golden tiny checkpoint's `Drama3Processor`, loaded once per run (processors hold no state a test changes)."""
    from transformers_drama3 import Drama3Processor

    return Drama3Processor.from_pretrained(GOLDEN_TINY)


def default_sigint() -> None:
    """`preexec_fn` of a child that a test stops with SIGINT: a shell starts background jobs (`pytest ... &`) with
    SIGINT ignored and children inherit that, so the child gets Ctrl-C's default handler back (Python then turns it
    into KeyboardInterrupt as usual)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def wait_until_healthy(process, url: str, seconds: float) -> bool:
    """Poll a `drama3-serve` child's `GET /health` until it answers 200 (True), or until `process` has exited or
    `seconds` have passed (False)."""
    import httpx

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and process.poll() is None:
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return True
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    return False


def left_padded(*prompts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts `[T_i, 11]` as one left-padded batch `[B, max T_i, 11]` and its attention mask `[B, max T_i]`."""
    rows = max(p.shape[0] for p in prompts)
    batch = torch.zeros(len(prompts), rows, 11, dtype=torch.long)
    mask = torch.zeros(len(prompts), rows, dtype=torch.long)
    for index, p in enumerate(prompts):
        batch[index, rows - p.shape[0] :], mask[index, rows - p.shape[0] :] = p, 1
    return batch, mask


@pytest.fixture(scope="session")
def expected():
    """Tensors of `fixtures/expected.safetensors` (see fixtures/README.md for names and tolerances)."""
    return load_file(FIXTURES / "expected.safetensors")


@pytest.fixture(scope="session")
def cases():
    with open(FIXTURES / "cases.json") as f:
        return json.load(f)


@pytest.fixture(scope="module")
def prompt():
    """`[1, 10, 11]` frame rows for the golden tiny checkpoint: 4 text rows, then 6 audio rows with random codes
    (a short reference)."""
    codes = torch.randint(0, 32, (6, 10), generator=torch.Generator().manual_seed(0))  # [frames, NCB]
    rows = torch.zeros(10, 11, dtype=torch.long)
    rows[:4, 0] = torch.tensor([1, 5, 7, 9])
    rows[4:, 0], rows[4:, 1:] = 421 + codes[:, 0], codes  # semantic_start = 421
    return rows[None]


# ---------------------------------------------------------------------------------------------------------------
# bitsandbytes' 4-bit CPU path, pinned for the whole run
# ---------------------------------------------------------------------------------------------------------------

PACKED_4BIT_MARKER = "bnb_packed_cpu"


def pytest_configure(config):
    config.addinivalue_line(
        "markers", f"{PACKED_4BIT_MARKER}: the test runs bitsandbytes' packed AVX512-BF16 4-bit CPU kernel (bf16 "
        "compute); skipped on a CPU without AVX512-BF16"
    )


@pytest.fixture(scope="session", autouse=True)
def pinned_bitsandbytes_cpu_path():
    """Every test runs bitsandbytes' 4-bit linears on the dequantise + float32 matmul CPU path, on every CPU.

    bitsandbytes (0.50) chooses between two CPU paths once per `Linear4bit`, when it is built, by calling the name
    `bitsandbytes.nn.modules.has_avx512bf16` (the CPU's AVX512-BF16 flag): with the flag, the first inference
    forward repacks the weight for a bf16 kernel. That decision is patched here (not the math), so that a test's
    tolerance and its greedy frames do not depend on the machine. Session scope: module-scoped fixtures that
    build quantised models come after it. Tests of the packed path opt in with the `bnb_packed_cpu` marker
    (`packed_bitsandbytes_cpu_path`). The 8-bit path (`torch._int_mm` with AVX-512, else a float32 matmul of the
    int8 values) needs no pin: both give the exact int32 products as long as the float32 sums stay below 2**24
    (tests/test_quantization.py checks the test models' sizes for it).
    """
    bitsandbytes = imported_bitsandbytes()
    if bitsandbytes is None:
        yield
        return
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(bitsandbytes.nn.modules, "has_avx512bf16", lambda: False)
        yield


@pytest.fixture(autouse=True)
def packed_bitsandbytes_cpu_path(request, monkeypatch):
    """A test marked `bnb_packed_cpu` builds its `Linear4bit`s for the packed AVX512-BF16 kernel; skipped where
    the CPU lacks the flag (the kernel is machine code for it)."""
    if request.node.get_closest_marker(PACKED_4BIT_MARKER) is None:
        return
    bitsandbytes = imported_bitsandbytes()
    if bitsandbytes is None or not bitsandbytes.functional.has_avx512bf16():
        pytest.skip("bitsandbytes' packed 4-bit CPU kernel needs a CPU with AVX512-BF16")
    monkeypatch.setattr(bitsandbytes.nn.modules, "has_avx512bf16", lambda: True)


# ---------------------------------------------------------------------------------------------------------------
# Machine facts at the start of a run: a failure on another machine can be traced to its CPU and package versions
# ---------------------------------------------------------------------------------------------------------------

PACKAGES = ["torch", "transformers", "accelerate", "bitsandbytes", "numpy", "safetensors", "huggingface-hub"]
CPU_FLAG_PREFIXES = ("avx", "amx", "fma", "f16c")  # what torch's and bitsandbytes' CPU kernels are chosen by


def cpu_model_and_flags() -> tuple[str, list[str]]:
    """The CPU's model name and its vector-instruction flags (Linux /proc/cpuinfo; elsewhere no flags)."""
    try:
        with open("/proc/cpuinfo") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)  # the first CPU's lines are overwritten
    except OSError:
        return platform.processor() or platform.machine(), []
    names = {key.strip(): value.strip() for key, value in fields.items()}
    flags = [flag for flag in names.get("flags", "").split() if flag.startswith(CPU_FLAG_PREFIXES)]
    return names.get("model name", platform.machine()), sorted(flags)


def imported_bitsandbytes():
    """The `bitsandbytes` module, or None where it is not installed."""
    try:
        with warnings.catch_warnings():  # its import warns about torch.jit deprecations: not this run's business
            warnings.simplefilter("ignore")
            import bitsandbytes
    except ImportError:
        return None
    return bitsandbytes


def bitsandbytes_cpu_paths() -> str:
    """Which CPU kernels bitsandbytes offers here, and the 4-bit one the tests run (`pinned_bitsandbytes_cpu_path`)."""
    bitsandbytes = imported_bitsandbytes()
    if bitsandbytes is None:
        return "bitsandbytes not installed"
    packed = "available" if bitsandbytes.functional.has_avx512bf16() else "not available (no AVX512-BF16)"
    eight_bit = "torch._int_mm" if torch.backends.cpu.get_cpu_capability() == "AVX512" else "float32 matmul"
    return (f"bitsandbytes CPU paths: 4-bit dequantise + float32 matmul (pinned; the packed AVX512-BF16 kernel is "
            f"{packed}, for the `{PACKED_4BIT_MARKER}` tests), 8-bit {eight_bit}")


def machine_facts() -> list[str]:
    model, flags = cpu_model_and_flags()
    versions = []
    for package in PACKAGES:
        try:
            versions.append(f"{package} {metadata.version(package)}")
        except metadata.PackageNotFoundError:
            versions.append(f"{package} not installed")
    threads = ", ".join(f"{name}={os.environ.get(name)}" for name in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY"))
    return [
        f"cpu: {model}, {os.cpu_count()} cores; flags: {' '.join(flags) or 'unknown'}",
        f"torch CPU capability: {torch.backends.cpu.get_cpu_capability()}; {bitsandbytes_cpu_paths()}",
        f"python {platform.python_version()}; {', '.join(versions)}",
        f"threads: torch {torch.get_num_threads()} ({threads})",
    ]


def pytest_report_header(config):
    return machine_facts()


@pytest.hookimpl(trylast=True)
def pytest_sessionstart(session):
    """`-q` (the README's command) hides the report header: print the facts anyway, so that every log has them."""
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None and not reporter.showheader:
        for line in machine_facts():
            reporter.write_line(line)
