"""Capture and replay of the frame step as CUDA graphs (`generate(..., fast_decode=True)` on a CUDA device).

`FrameState.step` (frame_step.py) keeps every shape fixed, never reads back to the host and writes every buffer in
place, so one capture replays it for as long as the state lives. A capture records the step for one sampling
setting and one attention window; all captures share one memory pool.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

CAPTURE_WARMUP_STEPS = 2  # eager steps on a side stream before a state's first capture (lazy inits, workspaces)
# The routed experts inside a captured step: static shapes and no host reads (the eager loop reads the routing on
# the host, and grouped_mm's fallback, used where torch's grouped GEMM is not, reads its offsets there).
CAPTURED_EXPERTS = "batched_mm"


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

    def capture(self, model, step: Callable[[], None], device: torch.device, warm_up: bool) -> torch.cuda.CUDAGraph:
        """Capture `step` (the step of one state, window and sampler key: greedy or sampled) and return its graph.

        `warm_up` runs a few eager steps first, which overwrite the state: do it before loading sequences into a new
        state. Later captures of the same state only record (nothing runs), so they are safe mid-request.
        """
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        with captured_experts(model):
            if warm_up:
                side = torch.cuda.Stream(device=device)
                side.wait_stream(torch.cuda.current_stream(device))
                with torch.cuda.stream(side):
                    for _ in range(CAPTURE_WARMUP_STEPS):
                        step()
                torch.cuda.current_stream(device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            # thread_local: a streamer's codec worker (`Drama3AudioStreamer(overlap=True)`) may keep decoding on its
            # own stream while this thread captures.
            with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
                step()
        return graph


__all__ = ["CAPTURED_EXPERTS", "StepGraphs", "captured_experts"]
