"""Drama 3's generation stack: how frames are made, for `generate`, the engine and the server.

One frame goes through these modules in this order (docs/architecture.md, "One frame, file by file"):
- settings.py: the settings a request runs with (one merge: Drama 3's defaults < the model's < the call's);
- engine.py: `Drama3Engine`, which queues requests (requests.py), admits them, steps and hands frames back;
- prompt_cache.py: the prefill of an admission (from a cached prefix or not);
- runner.py: `FrameRunner`, the slots of the running sequences in one frame state, grown and shrunk;
- state.py: `FrameState`, the buffers of one step and the step itself (backbone, tower, feedback);
- rules.py: the sampling rule and stopping criteria that the step calls; sampling.py: the draws they make;
- cuda_graphs.py: the step captured and replayed on a GPU; stored_steps.py: on the CPU path, the step compiled ahead
  of time and stored; observer.py: what a `generate` call adds to each frame;
- continuous_batching.py: transformers' `generate_batch` / `init_continuous_batching` over the engine.
"""

from .engine import Drama3Engine
from .prompt_cache import PromptCache, PromptCacheStore
from .requests import FINISH_CANCELLED, FINISH_FAILED, Drama3Result
from .settings import DRAMA3_GENERATION_DEFAULTS, generation_settings

__all__ = ["DRAMA3_GENERATION_DEFAULTS", "FINISH_CANCELLED", "FINISH_FAILED", "Drama3Engine", "Drama3Result",
           "PromptCache", "PromptCacheStore", "generation_settings"]
