"""The Gemma 3 text decoder (Gemma3ForCausalLM; GGUF arch `gemma3`): the Llama decoder with Gemma's layer and
embedding.

What differs from Llama, and where it is set:
- each layer normalises before and after attention and before and after the MLP (four RMSNorms, below);
- queries and keys are RMS-normalised per head before RoPE (DecoderAttention's qk_norm);
- the embedding is scaled by sqrt(hidden_size), rounded to the embedding's dtype first, as transformers does;
- sliding-window (local) and global layers interleave, each type with its own RoPE base, the attention scale
  comes from query_pre_attn_scalar, and the MLP is GELU-tanh gated: all read from ModelConfig.
Gemma's RMSNorm multiplies by (1 + w): the loaders store 1 + w as the weight (llama.cpp's converter already has
in GGUF files), so the model's RMSNorm is Llama's.
"""

from __future__ import annotations

import torch
from torch import nn

from tokenloop.models.attention import AttentionMetadata, PackedSequences
from tokenloop.models.config import ModelConfig
from tokenloop.models.layers import GatedMLP, RMSNorm
from tokenloop.models.llama import DecoderAttention, LlamaForCausalLM


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(hidden, eps)
        self.self_attn = DecoderAttention(config, qk_norm=True)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = RMSNorm(hidden, eps)
        self.mlp = GatedMLP(hidden, config.intermediate_size, config.hidden_activation)
        self.post_feedforward_layernorm = RMSNorm(hidden, eps)

    def forward(
        self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor, meta: AttentionMetadata | PackedSequences
    ) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(rope, self.input_layernorm(x), meta))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Gemma3ForCausalLM(LlamaForCausalLM):
    decoder_layer = Gemma3DecoderLayer

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        # sqrt(hidden_size) rounded to the embedding's dtype before the product (bfloat16: sqrt(640) = 25.25).
        return (x * x.new_full((), self.config.hidden_size**0.5)).to(self.norm.weight.dtype)
