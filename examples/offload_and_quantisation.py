"""Load Drama 3 in less memory, speak one sentence, and optionally save the loaded model.

    python examples/offload_and_quantisation.py --mode offload [--gpu-memory 20GB] [--cpu-memory 60GB]
    python examples/offload_and_quantisation.py --mode 8bit        # or 4bit: bitsandbytes on the dense linears
    python examples/offload_and_quantisation.py --mode offload --save drama3-bf16   # a checkpoint with no flags

Modes: `offload` fills the GPU (if any) up to --gpu-memory, then the RAM up to --cpu-memory, then the disk
(--offload-folder), with accelerate's `device_map="auto"`; `8bit` / `4bit` quantise the backbone's dense linears
with bitsandbytes (the experts, 89 % of the model, stay bf16). See docs/hardware.md for what fits where. Without
`--model` the embedded tiny random checkpoint is used (it speaks noise) with a memory limit small enough to
offload most of it to disk.
"""

import argparse

import torch
from transformers import AutoModel, AutoProcessor, BitsAndBytesConfig

import transformers_drama3  # noqa: F401  (registers Drama 3 with AutoModel / AutoProcessor)
from transformers_drama3.device_placement import execution_device
from transformers_drama3.testing import default_tiny_checkpoint
from example_setup import example_parser


def load(path: str, args: argparse.Namespace):
    gpu = torch.cuda.is_available()
    dtype = torch.bfloat16 if gpu or args.model else torch.float32
    if args.mode == "offload":
        max_memory = {"cpu": args.cpu_memory or ("60GB" if args.model else "15MB")}
        if gpu:
            max_memory[0] = args.gpu_memory
        return AutoModel.from_pretrained(path, dtype=dtype, device_map="auto", max_memory=max_memory,
                                         offload_folder=args.offload_folder)
    quantization = BitsAndBytesConfig(load_in_8bit=args.mode == "8bit", load_in_4bit=args.mode == "4bit")
    return AutoModel.from_pretrained(path, dtype=dtype, quantization_config=quantization)


def main() -> None:
    parser = example_parser(__doc__)
    parser.add_argument("--mode", choices=["offload", "8bit", "4bit"], default="offload")
    parser.add_argument("--gpu-memory", default="20GB", help="weights allowed on GPU 0 (offload mode)")
    parser.add_argument("--cpu-memory", help="weights allowed in RAM (offload mode; default 60GB, 15MB for tiny)")
    parser.add_argument("--offload-folder", default="drama3-offload", help="where disk-offloaded weights go")
    parser.add_argument("--text", default="Hello there! How are you today?")
    parser.add_argument("--output", default="offloaded.wav")
    parser.add_argument("--save", help="also save the loaded model (and tokenizer) to this directory")
    args = parser.parse_args()

    path = args.model or default_tiny_checkpoint()
    model = load(path, args)
    processor = AutoProcessor.from_pretrained(path)
    print("device map:", getattr(model, "hf_device_map", "one device"))
    print("codec on:", next(model.codec.parameters()).device)  # never offloaded

    # Offloaded weights sit on the meta device: inputs go where the embedding runs, not to a parameter's device.
    inputs = processor(args.text, return_tensors="pt").to(execution_device(model.backbone.embed_tokens))
    settings = {"max_new_tokens": 16} if args.model is None else {}  # the tiny checkpoint rarely stops by itself
    speech = model.generate(**inputs, seed=0, **settings)
    processor.save_audio(speech.audio[0], args.output)
    print(f"{args.output}: {speech.audio[0].shape[-1] / model.config.sampling_rate:.2f} s ({speech.finish_reason[0]})")

    if args.save:
        model.save_pretrained(args.save)  # original layout + codec.pth; loads back with no flag
        processor.save_pretrained(args.save)  # the tokenizer
        print(f"saved to {args.save}")


if __name__ == "__main__":
    main()
