"""Drama 3's registration with transformers, and the import hook that runs it when transformers' Auto classes load.

`register()` makes `AutoConfig`, `AutoModel`, `AutoModelForTextToWaveform`, `AutoProcessor` (and so `pipeline`)
know Drama 3, and registers the `bsgemm-moe` FP8 quantization method and the original checkpoint names. It needs
the classes themselves, which import torch and most of transformers: seconds of start-up.

`arm()` (run by `import transformers_drama3`) costs nothing instead: it calls `register()` at once if transformers'
Auto classes are already imported, and otherwise installs a one-time import hook that calls it right after they
are. Every Auto class and pipeline goes through `transformers.models.auto.configuration_auto` (the config mapping),
so "imported" means that module is in `sys.modules`. The registration waits until no import of a transformers or
Drama 3 module is running any more (the Auto modules are often imported half-way through another transformers
module, whose names Drama 3's classes need), and it runs before that outermost import statement returns, so no code
can reach an Auto class before it. This is why `drama3-tts --help` answers without importing torch, while
`import transformers_drama3` followed by `AutoModel.from_pretrained(...)` works as with any other model.
"""

from __future__ import annotations

import importlib.abc
import sys
import threading

AUTO_CONFIG_MODULE = "transformers.models.auto.configuration_auto"
WATCHED_PACKAGES = ("transformers", "transformers_drama3")


def register() -> None:
    """Register the Drama 3 classes with transformers (idempotent: a second call changes nothing)."""
    from transformers import AutoConfig, AutoModel, AutoModelForTextToWaveform, AutoProcessor

    from .checkpoint_mapping import register_checkpoint_mapping
    from .configuration_drama3 import Drama3TowerConfig, FishDACConfig, FishOmniConfig
    from .modeling_codec import FishDACCodec
    from .modeling_drama3 import FishOmniForSpeech
    from .processing_drama3 import Drama3Processor
    from .quantization_bsgemm import register_bsgemm_moe

    register_bsgemm_moe()
    register_checkpoint_mapping()
    for config_class in (FishOmniConfig, Drama3TowerConfig, FishDACConfig):
        AutoConfig.register(config_class.model_type, config_class, exist_ok=True)
    AutoModel.register(FishOmniConfig, FishOmniForSpeech, exist_ok=True)
    AutoModel.register(FishDACConfig, FishDACCodec, exist_ok=True)
    AutoModelForTextToWaveform.register(FishOmniConfig, FishOmniForSpeech, exist_ok=True)
    AutoProcessor.register(FishOmniConfig, Drama3Processor, exist_ok=True)


class _RegisterAfterImports(importlib.abc.MetaPathFinder):
    """A meta path finder that finds nothing itself: it wraps the loaders of transformers' and Drama 3's modules
    (found by the finders after it) to count the imports in progress, and calls `register()` when the last one
    ends with transformers' Auto classes imported. It removes itself once `register()` ran."""

    def __init__(self):
        self.lock = threading.Lock()
        self.running = 0  # imports of watched modules in progress, in every thread
        self.done = False

    def find_spec(self, name, path, target=None):
        if self.done or name.split(".")[0] not in WATCHED_PACKAGES:
            return None
        later = sys.meta_path[sys.meta_path.index(self) + 1 :] if self in sys.meta_path else []
        for finder in later:
            spec = getattr(finder, "find_spec", lambda *args: None)(name, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader.exec_module = self.counted(spec.loader.exec_module)
                return spec
        return None

    def counted(self, exec_module):
        def run(module) -> None:
            with self.lock:
                self.running += 1
            try:
                exec_module(module)
            finally:
                with self.lock:
                    self.running -= 1
                    due = self.running == 0 and not self.done and AUTO_CONFIG_MODULE in sys.modules
                    if due:
                        self.done = True
            if due:
                self.stop()
                register()

        return run

    def stop(self) -> None:
        if self in sys.meta_path:
            sys.meta_path.remove(self)


_hook: _RegisterAfterImports | None = None


def arm() -> None:
    """Register now if transformers' Auto classes are imported, else when they are (see the module docstring).

    Idempotent, also across `importlib.reload(transformers_drama3)`."""
    global _hook
    if _hook is not None:
        return
    _hook = _RegisterAfterImports()
    if AUTO_CONFIG_MODULE in sys.modules:
        _hook.done = True
        register()
    else:
        sys.meta_path.insert(0, _hook)


__all__ = ["AUTO_CONFIG_MODULE", "arm", "register"]
