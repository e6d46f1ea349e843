"""Model classes keyed by the checkpoint's architecture name (config.json's `architectures`)."""

from __future__ import annotations

from torch import nn

from tokenloop.models.gemma3 import Gemma3ForCausalLM
from tokenloop.models.llama import LlamaForCausalLM

# Mistral and Qwen2 are the Llama decoder with a sliding window or q/k/v biases, both set by ModelConfig.
MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
}


def model_class(architecture: str) -> type[nn.Module]:
    try:
        return MODEL_REGISTRY[architecture]
    except KeyError:
        raise ValueError(f"unsupported architecture {architecture!r}; supported: {', '.join(MODEL_REGISTRY)}") from None
