"""Time to build the real-size Fish DAC codec with the weights of an original `codec.pth` state dict, two ways.

- `FishDACCodec(config)` then `load_original_state_dict`: the codec draws its random initial weights first.
- `FishDACCodec.from_codec_state_dict` (what `from_codec_file` and `FishOmniForSpeech.from_pretrained` run): the
  keys and shapes are checked on the meta device, the weights are allocated uninitialised and the load writes each
  of them once.

Both give the same weights (checked). The state dict is random (`random_original_codec_state_dict`), in memory, so
file reading is not timed.

    python benchmarks/codec_load.py --rounds 2 --threads 1
"""

from __future__ import annotations

import argparse
import time

import torch

from transformers_drama3.configuration_drama3 import FishDACConfig
from transformers_drama3.modeling_codec import FishDACCodec
from transformers_drama3.testing import random_original_codec_state_dict


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2, help="timed rounds (each times both ways)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    config = FishDACConfig()
    state_dict = random_original_codec_state_dict(config, torch.Generator().manual_seed(0))
    print("| round | random init + load (s) | from_codec_state_dict (s) | ratio |\n| --- | --- | --- | --- |")
    for round_index in range(args.rounds):
        start = time.perf_counter()
        initialised = FishDACCodec(config)
        initialised.load_original_state_dict(state_dict)
        old = time.perf_counter() - start
        start = time.perf_counter()
        direct = FishDACCodec.from_codec_state_dict(state_dict, config)
        new = time.perf_counter() - start
        same = all(torch.equal(a, b) for a, b in zip(initialised.state_dict().values(), direct.state_dict().values()))
        if not same:
            raise SystemExit("the two ways gave different weights")
        print(f"| {round_index + 1} | {old:.1f} | {new:.1f} | {old / new:.2f} |")
        del initialised, direct


if __name__ == "__main__":
    main()
