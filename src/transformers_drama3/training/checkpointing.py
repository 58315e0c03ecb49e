"""Activation (gradient) checkpointing across transformers versions.

transformers 5.24 renamed gradient checkpointing to activation checkpointing (`model.activation_checkpointing_enable()`,
`TrainingArguments(activation_checkpointing=True)`) and warns on the old names; 5.17 has only the old ones. These
two helpers pick the name the installed version has, so the recipe runs on both without warnings.
"""

from __future__ import annotations

from transformers import PreTrainedModel, TrainingArguments

_NEW_NAMES = hasattr(PreTrainedModel, "activation_checkpointing_enable")


def checkpointing_arguments(enabled: bool = True) -> dict[str, bool]:
    """`TrainingArguments` keyword that turns checkpointing on (or off): `{"activation_checkpointing": True}` on
    transformers >= 5.24, `{"gradient_checkpointing": True}` before."""
    name = "activation_checkpointing" if "activation_checkpointing" in TrainingArguments.__dataclass_fields__ \
        else "gradient_checkpointing"
    return {name: enabled}


def enable_checkpointing(model) -> None:
    """Turn checkpointing on for `model` (a `FishOmniForSpeech`, or a peft model wrapping one): the backbone's
    decoder layers and the tower's layers keep only their inputs and run again during backward."""
    if _NEW_NAMES:
        model.activation_checkpointing_enable()
    else:
        model.gradient_checkpointing_enable()


def disable_checkpointing(model) -> None:
    """Turn checkpointing off again."""
    if _NEW_NAMES:
        model.activation_checkpointing_disable()
    else:
        model.gradient_checkpointing_disable()


__all__ = ["checkpointing_arguments", "disable_checkpointing", "enable_checkpointing"]
