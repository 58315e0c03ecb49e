"""`drama3-tts`: the command line of transformers-drama3.

Today it loads a checkpoint and prints a summary of it (`--summary`); speech synthesis arrives with generation
and until then the command says so and exits with status 2 instead of pretending to synthesise.
"""

from __future__ import annotations

import argparse
import sys

SYNTHESIS_NOT_AVAILABLE = 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="drama3-tts",
        description="Fish Audio Drama 3 text-to-speech with Hugging Face transformers.",
        epilog="Speech synthesis is not available yet in this version: it arrives with the generation loop. "
        "`--summary` loads a checkpoint and prints what it holds.",
    )
    parser.add_argument("text", nargs="?", help="text to speak (not available yet)")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--model", help="checkpoint directory or Hub repository id (e.g. fishaudio/drama-3)")
    source.add_argument("--tiny", action="store_true", help="use the embedded tiny random checkpoint (default)")
    parser.add_argument("--summary", action="store_true", help="load the checkpoint and print a model summary")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="weights dtype")
    return parser


def model_summary(model) -> str:
    """A short, human-readable description of a loaded `FishOmniForSpeech`."""
    config = model.config
    text, tower, codec = config.text_config, config.audio_decoder_config, config.codec_config
    lines = [f"{type(model).__name__} ({config.speech_template_version}, {config.sampling_rate} Hz)"]
    for name, module in model.named_children():
        count = sum(p.numel() for p in module.parameters())
        dtypes = sorted({str(p.dtype).removeprefix("torch.") for p in module.parameters()})
        lines.append(f"  {name:<9} {count:>14,d} parameters  {'/'.join(dtypes)}")
    lines += [
        f"  backbone: {text.num_hidden_layers} layers ({text.layer_types.count('full_attention')} full attention), "
        f"hidden {text.hidden_size}, {text.num_experts} experts top-{text.num_experts_per_tok}",
        f"  tower: {tower.shared_enrichment_layers} shared + {tower.num_codebooks - 1} residual layers, "
        f"{tower.num_codebooks} codebooks x {tower.vocab_size}, k = {tower.vq_backbone_codebooks}",
        f"  codec: frame {codec.frame_length} samples ({codec.sample_rate / codec.frame_length:.2f} frames/s)",
        f"  semantic band: ids {config.semantic_start_token_id}..{config.semantic_end_token_id}, "
        f"EOS {config.eos_token_id}",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not args.summary:
        print(
            "drama3-tts: speech synthesis is not available yet in this version of transformers-drama3 "
            "(it arrives with the generation loop). Use `drama3-tts --summary [--model PATH]` to load a "
            "checkpoint and inspect it.",
            file=sys.stderr,
        )
        return SYNTHESIS_NOT_AVAILABLE

    import torch

    from . import FishOmniForSpeech
    from .testing import default_tiny_checkpoint

    path = args.model or default_tiny_checkpoint()
    try:
        model = FishOmniForSpeech.from_pretrained(path, dtype=getattr(torch, args.dtype))
    except (OSError, ValueError) as error:  # missing files, bad config or checkpoint, unknown repository
        print(f"drama3-tts: cannot load {path!r}: {error}", file=sys.stderr)
        return 1
    print(f"loaded {path}")
    print(model_summary(model))
    return 0


if __name__ == "__main__":
    sys.exit(main())
