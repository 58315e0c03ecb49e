"""Fish Audio Drama 3 for Hugging Face transformers.

Importing this package registers the Drama 3 classes with transformers' Auto classes (idempotently), so that
`AutoConfig`, `AutoModel`, `AutoProcessor` and `pipeline("text-to-speech")` find them.
"""

from .configuration_drama3 import Drama3ConfigError, Drama3TowerConfig, FishDACConfig, FishOmniConfig

__all__ = ["Drama3ConfigError", "Drama3TowerConfig", "FishDACConfig", "FishOmniConfig"]
