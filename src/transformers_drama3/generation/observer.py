"""What a `generate` call adds to the engine's frames: its streamer, progress bar, scores, and the user's host-side
processors and criteria (Python run between the step's parts, with the rows generated so far: they keep the step
eager). A call with none of them runs the engine's frames alone.
"""

from __future__ import annotations

import torch

OUTPUT_CHUNK_FRAMES = 256  # the batch view grows by this many frames: memory follows the frames made


class GenerateObserver:
    """One `generate` call's view of the frames of its batch of `B` sequences (engine request ids `ids`, in batch
    order, set once they are added), prompt rows `input_ids` `[B, T, 1 + NCB]`.

    `streamer`: gets `put(codes [B, NCB])` per frame (-1 rows for sequences without a frame). `on_frame`: called once
    per frame read (a progress bar). `logits_processor` / `stopping_criteria`: the user's host-side ones (or None).
    `output_scores`: keep each frame's main-token logits `[B, V + 1]` (rows of sequences that had ended: zeros).
    """

    def __init__(self, input_ids: torch.Tensor, streamer=None, on_frame=None, logits_processor=None,
                 stopping_criteria=None, output_scores: bool = False):
        self.streamer, self.on_frame = streamer, on_frame
        self.logits_processor, self.stopping_criteria = logits_processor, stopping_criteria
        self.output_scores = output_scores
        self.batch, self.prompt_length, width = input_ids.shape
        self.ids: dict[str, int] = {}  # request id -> batch index
        self.scores: list[torch.Tensor] = []
        self.steps = 0  # frame steps run
        self.sequences = None  # [B, T + n, 1 + NCB] the rows so far, on the device (host hooks only)
        if logits_processor or stopping_criteria:
            self.sequences = torch.cat((input_ids, input_ids.new_zeros(self.batch, OUTPUT_CHUNK_FRAMES, width)), 1)
        self._ended_before = None
        self._layout, self._slots, self._indexes, self._keys = None, None, None, None  # `_index`'s cache

    @property
    def needs_scores(self) -> bool:
        """Whether the frame step must keep its main-token logits (scores, or criteria that read them)."""
        return self.output_scores or bool(self.stopping_criteria)

    @property
    def reads_every_frame(self) -> bool:
        """Whether the call must see each frame on the host as it is made."""
        return self.streamer is not None or bool(self.logits_processor) or bool(self.stopping_criteria)

    def _index(self, runner) -> tuple[torch.Tensor, torch.Tensor, list]:
        """Slots `[n]` of the running sequences, their batch indexes `[n]` (device tensors) and their request ids,
        cached per slot layout."""
        if self._layout != runner.layout:
            slots, keys = runner.taken()
            device = runner.state.write_at.device
            self._slots = torch.tensor(slots, device=device)
            self._indexes = torch.tensor([self.ids[key] for key in keys], device=device)
            self._keys, self._layout = keys, runner.layout
        return self._slots, self._indexes, self._keys

    # -- around the step (the engine's stepping thread) -------------------------------------------------------------

    def before_step(self, runner) -> None:
        if runner.state.scores is not None:
            self._ended_before = runner.state.ended.clone()

    def main_logits_hook(self, runner):
        """The user's processors as a hook inside the step, on the whole batch's view (None without any): rows of
        sequences not running are zeros."""
        if not self.logits_processor:
            return None

        def hook(logits: torch.Tensor) -> torch.Tensor:  # [slots, V + 1]
            slots, indexes, _ = self._index(runner)
            full = logits.new_zeros(self.batch, logits.shape[1])  # [B, V + 1]
            full[indexes] = logits[slots]
            processed = self.logits_processor(self.sequences[:, : self.prompt_length + self.steps], full)
            out = logits.clone()
            out[slots] = processed[indexes].to(out.dtype)
            return out

        return hook

    def after_step(self, engine, runner) -> None:
        """Device work after a step: the batch view, the scores, the user's criteria (which end sequences with
        finish reason "stop")."""
        state = runner.state
        row = self.prompt_length + self.steps  # this step's row of `sequences`
        self.steps += 1
        if self.sequences is None and state.scores is None:  # no host hook and no scores: nothing to do per frame
            return
        slots, indexes, keys = self._index(runner)
        made = state.made[slots]  # [n]
        if self.sequences is not None:
            if row >= self.sequences.shape[1]:
                grow = self.sequences.new_zeros(self.batch, OUTPUT_CHUNK_FRAMES, self.sequences.shape[2])
                self.sequences = torch.cat((self.sequences, grow), 1)
            self.sequences[indexes, row] = torch.where(made[:, None], state.new_rows[slots], 0)
        scores = None
        if state.scores is not None:
            scores = state.scores.new_zeros(self.batch, state.scores.shape[1])  # [B, V + 1]
            device = scores.device
            kept = state.scores[slots.to(device)].masked_fill(self._ended_before[slots].to(device)[:, None], 0)
            scores[indexes.to(device)] = kept
            if self.output_scores:
                self.scores.append(scores)
        if self.stopping_criteria:
            stop = self.stopping_criteria(self.sequences[:, : row + 1], scores)
            stop = torch.as_tensor(stop, device=made.device).expand(self.batch)[indexes] & made
            if bool(stop.any()):
                engine.stop_requests([keys[i] for i in stop.nonzero()[:, 0].tolist()])

    def frame_read(self, made: dict) -> None:
        """One frame read back: `made` maps the request id of each sequence that made a frame to its row
        `[1 + NCB]` (host)."""
        if self.on_frame is not None:
            self.on_frame(1)
        if self.streamer is not None and made:
            some = next(iter(made.values()))
            codes = some.new_full((self.batch, some.shape[0] - 1), -1)  # [B, NCB], a host tensor
            for key, frame in made.items():
                codes[self.ids[key]] = frame[1:]
            self.streamer.put(codes)

    def kept_scores(self, lengths: list[int], eos: list[bool]) -> tuple:
        """The scores of the steps that decided something: up to each sequence's last frame, and its EOS step."""
        decided = [n + ended for n, ended in zip(lengths, eos)]
        return tuple(self.scores[: max(decided, default=0)])


__all__ = ["GenerateObserver"]
