"""`import transformers_drama3`: light, and it makes transformers know Drama 3 whatever the import order; the default
dtype of a plain load."""

import os
import subprocess
import sys

import torch

import transformers_drama3

from .conftest import GOLDEN_TINY

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}

# Run in fresh interpreters: which modules are imported, and when, is the point.
REGISTRATION_CHECK = """
import sys
{imports}
from transformers import AutoConfig, AutoModel, AutoModelForTextToWaveform, AutoProcessor
from transformers_drama3 import Drama3Processor, FishOmniConfig, FishOmniForSpeech
assert type(AutoConfig.from_pretrained({path!r})) is FishOmniConfig
assert AutoModel._model_mapping[FishOmniConfig] is FishOmniForSpeech
assert AutoModelForTextToWaveform._model_mapping[FishOmniConfig] is FishOmniForSpeech
assert type(AutoProcessor.from_pretrained({path!r})) is Drama3Processor
print("registered")
"""


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=ENV)


def test_the_import_is_light_and_registers_when_transformers_loads():
    code = (
        "import sys\nimport transformers_drama3\n"
        "print('heavy:', sorted(m for m in ('torch', 'transformers', 'numpy') if m in sys.modules))\n"
        + REGISTRATION_CHECK.format(imports="", path=str(GOLDEN_TINY))
    )
    result = _python(code)
    assert "heavy: []" in result.stdout and "registered" in result.stdout, result.stderr[-3000:]


def test_registration_in_other_import_orders():
    """transformers first, then Drama 3; and a Drama 3 class imported before any Auto class (its imports load
    transformers' Auto modules half-way through, the registration waits for them to finish)."""
    for imports in ("from transformers import AutoModel\nimport transformers_drama3",
                    "from transformers_drama3 import FishOmniForSpeech\nimport importlib, transformers_drama3\n"
                    "importlib.reload(transformers_drama3)"):
        result = _python(REGISTRATION_CHECK.format(imports=imports, path=str(GOLDEN_TINY)))
        assert "registered" in result.stdout, (imports, result.stderr[-3000:])


def test_public_names_load_on_first_use():
    assert sorted(transformers_drama3.__all__) == transformers_drama3.__all__
    for name in transformers_drama3.__all__:
        assert getattr(transformers_drama3, name).__name__ == name
    assert set(transformers_drama3.__all__) <= set(dir(transformers_drama3))


def test_a_plain_load_is_float32_without_a_gpu():
    """docs/usage.md#loading: without `dtype` (or with "auto") and without a GPU, float32, not the checkpoint's
    bfloat16; an explicit dtype is kept."""
    from transformers import AutoModel

    gpu = torch.cuda.is_available() or torch.xpu.is_available() or torch.backends.mps.is_available()
    for plain in (AutoModel.from_pretrained(GOLDEN_TINY), AutoModel.from_pretrained(GOLDEN_TINY, dtype="auto")):
        assert plain.lm_head.weight.dtype == (torch.bfloat16 if gpu else torch.float32)
        assert {parameter.dtype for parameter in plain.codec.parameters()} == {torch.float32}
    chosen = AutoModel.from_pretrained(GOLDEN_TINY, dtype=torch.bfloat16)
    assert chosen.lm_head.weight.dtype == chosen.backbone.embed_tokens.weight.dtype == torch.bfloat16


def test_nothing_imports_the_command_line_module():
    """Imports go downwards: `cli.py` (the `drama3-tts` command) is a top; the server and the library import what they
    share from `loading.py`, never from it."""
    import ast
    from pathlib import Path

    package = Path(transformers_drama3.__file__).parent
    importers = []
    for path in package.rglob("*.py"):
        depth = len(path.relative_to(package).parts) - 1  # 0 in the package, 1 in serving/ and training/
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                absolute = node.level == 0 and node.module == "transformers_drama3.cli"
                relative = node.level == depth + 1 and node.module == "cli"
                if absolute or relative:
                    importers.append(str(path.relative_to(package)))
    assert importers == []
