"""Capture and replay of the frame step as CUDA graphs (`fast_decode=True` on a CUDA device): `FrameState.step`
keeps every shape fixed and never reads back to the host, so one capture per sampling variant and attention window
replays for as long as the state lives; all captures share one memory pool.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from types import SimpleNamespace

import torch

from .settings import DRAMA3_GENERATION_DEFAULTS
from .sampling import SAMPLING_SETTINGS

CAPTURE_WARMUP_STEPS = 2  # eager steps on a side stream before a state's first capture (lazy inits, workspaces)
# The routed experts inside a captured step: static shapes and no host reads (the eager loop reads the routing on
# the host, and grouped_mm's fallback, used where torch's grouped GEMM is not, reads its offsets there).
CAPTURED_EXPERTS = "batched_mm"
FREE_SLOT = SimpleNamespace(do_sample=False)  # the settings of a free slot (greedy: no sampling work)
# Settings that make every row sample: the warm-up's run of the sampling variant (Drama 3's defaults).
WARM_UP_SAMPLING = SimpleNamespace(**{name: DRAMA3_GENERATION_DEFAULTS[name] for name in SAMPLING_SETTINGS},
                                   do_sample=True)


@contextlib.contextmanager
def captured_experts(model):
    """The backbone's experts run as `CAPTURED_EXPERTS` inside, as the model's own setting after: graphs are captured
    with it, while the prefill and eager steps keep the implementation the user chose."""
    chosen = model.backbone.config._experts_implementation
    if chosen != CAPTURED_EXPERTS:
        model.set_experts_implementation(CAPTURED_EXPERTS)
    try:
        yield
    finally:
        if chosen != CAPTURED_EXPERTS:
            model.set_experts_implementation(chosen)


class StepGraphs:
    """The CUDA graphs of a model's frame steps, with one memory pool for all of them."""

    def __init__(self):
        self.pool = None

    def warm_up(self, model, state, step: Callable[[], None], device: torch.device) -> None:
        """Run each variant of a new state's step that a capture can record (`FrameSampler.key`: the argmax-only step,
        then the sampling one) a few times, eagerly, on a side stream, before its first capture: lazy
        initialisations, workspaces and, for a compiled step, the compilation of each variant happen here, never
        inside a capture. They overwrite the state: do it before any sequence is in it (its rows are greedy after)."""
        sampler = state.sampler
        with captured_experts(model):
            side = torch.cuda.Stream(device=device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                for settings in (FREE_SLOT, WARM_UP_SAMPLING):
                    sampler.set_rows(slice(None), settings)
                    state.noise.fill_(0.5)  # any uniform in (0, 1) will do; the stream of no request is used
                    for _ in range(CAPTURE_WARMUP_STEPS):
                        step()
                sampler.set_rows(slice(None), FREE_SLOT)
            torch.cuda.current_stream(device).wait_stream(side)

    def capture(self, model, step: Callable[[], None], device: torch.device) -> torch.cuda.CUDAGraph:
        """Capture `step` (the step of one state, window and sampling key) and return its graph. A capture only
        records (nothing runs), so it is safe while sequences are in the state."""
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        with captured_experts(model):
            graph = torch.cuda.CUDAGraph()
            # thread_local: a streamer's codec worker (`Drama3AudioStreamer(overlap=True)`) may keep decoding on its
            # own stream while this thread captures.
            with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
                step()
        return graph


__all__ = ["CAPTURED_EXPERTS", "FREE_SLOT", "StepGraphs", "captured_experts"]
