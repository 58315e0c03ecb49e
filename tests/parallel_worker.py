"""One rank of the tensor/expert-parallel tests: `torchrun --standalone --nproc-per-node 2 parallel_worker.py
CHECKPOINT OUTPUT_DIR MODE...` (MODE: tensor or expert).

For each mode it loads CHECKPOINT split over the ranks (float32, CPU, gloo) and saves what `tests/test_parallel.py`
compares with one process into `OUTPUT_DIR/{mode}-rank{rank}.pt`: the teacher-forced outputs of `prompt_rows`,
greedy (also streamed), seeded and unseeded sampled frames, each parameter's local size, and the errors of what
must be refused.
"""

from __future__ import annotations

import os
import sys

import torch

PROMPT_TEXT_IDS = [1, 5, 7, 9, 11, 13]
GREEDY_FRAMES = 6
SAMPLED_FRAMES = 6
SAMPLING_SEED = 1234


def prompt_rows(config) -> torch.Tensor:
    """`[1, 10, 11]` frame rows: 6 text rows then 4 audio rows with fixed random codes (a short reference)."""
    codes = torch.randint(0, config.codebook_size, (4, config.num_codebooks), generator=torch.Generator().manual_seed(0))
    rows = torch.zeros(10, 1 + config.num_codebooks, dtype=torch.long)
    rows[:6, 0] = torch.tensor(PROMPT_TEXT_IDS)
    rows[6:, 0], rows[6:, 1:] = config.semantic_start_token_id + codes[:, 0], codes
    return rows[None]


def run_outputs(model) -> dict:
    """What every rank and the single process compute the same way."""
    prompt = prompt_rows(model.config)
    with torch.no_grad():
        out = model(prompt)
    greedy = model.generate(prompt, do_sample=False, max_new_tokens=GREEDY_FRAMES, output_audio=False)
    sampled = model.generate(prompt, seed=SAMPLING_SEED, max_new_tokens=SAMPLED_FRAMES, output_audio=False)
    return {
        "last_hidden_state": out.last_hidden_state,
        "main_logits": out.main_logits,
        "codebook_logits": out.codebook_logits,
        "greedy": greedy.codes[0],
        "sampled": sampled.codes[0],
    }


class CodesCollector:
    """A streamer (transformers' `put`/`end`) that keeps the codes `[1, NCB]` of every streamed frame (the prompt rows
    `[1, T, 1 + NCB]`, put first, are no frame)."""

    def __init__(self):
        self.frames: list[torch.Tensor] = []

    def put(self, value: torch.Tensor) -> None:
        if value.dim() == 2:
            self.frames.append(value[0])

    def end(self) -> None:
        pass


def refusal(run) -> str:
    """The message of the `Drama3ParallelError` that `run()` must raise ("" when it raised none)."""
    from transformers_drama3.parallel import Drama3ParallelError

    try:
        run()
    except Drama3ParallelError as error:
        return str(error)
    return ""


def run_mode(checkpoint: str, output_dir: str, mode: str) -> None:
    """Load CHECKPOINT split over the ranks with `mode` parallelism and save this rank's results."""
    from transformers_drama3 import FishOmniForSpeech, parallel

    config = parallel.distributed_config(expert_parallel=mode == "expert")
    model = FishOmniForSpeech.from_pretrained(checkpoint, dtype=torch.float32, distributed_config=config)
    prompt = prompt_rows(model.config)
    result = run_outputs(model)
    collector = CodesCollector()
    model.generate(prompt, do_sample=False, max_new_tokens=GREEDY_FRAMES, output_audio=False, streamer=collector)
    result["streamed"] = torch.stack(collector.frames, dim=1)  # [NCB, n]
    torch.manual_seed(100 + parallel.rank())  # independent processes: the global generators differ
    result["unseeded"] = model.generate(prompt, max_new_tokens=4, output_audio=False).codes[0]
    result["local_numel"] = {
        name: (p.to_local() if hasattr(p, "to_local") else p).numel() for name, p in model.named_parameters()
    }
    result["fast_decode_error"] = refusal(
        lambda: model.generate(prompt, max_new_tokens=2, fast_decode=True, output_audio=False))
    result["seed_error"] = refusal(
        lambda: model.generate(prompt, seed=parallel.rank(), max_new_tokens=2, output_audio=False))
    torch.save(result, os.path.join(output_dir, f"{mode}-rank{parallel.rank()}.pt"))


def main() -> None:
    checkpoint, output_dir, modes = sys.argv[1], sys.argv[2], sys.argv[3:]
    torch.set_num_threads(1)
    for mode in modes:
        run_mode(checkpoint, output_dir, mode)


if __name__ == "__main__":
    main()
