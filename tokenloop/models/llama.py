"""The Llama family decoder (Llama, Mistral, Qwen2): GQA attention with RoPE, RMSNorm, SwiGLU.

The forward takes the new tokens of several sequences flattened into one batch, with their positions
and the attention metadata that says where their K/V go in the cache and what each one attends to.
Each layer has its own attention window and RoPE table (from ModelConfig), computed once per forward for
the layers that share them: other decoders (Gemma 3) subclass it with their own layer and embedding.
"""

from __future__ import annotations

import torch
from torch import nn

from tokenloop.models.attention import AttentionMetadata, KVCacheAttention, PackedSequences
from tokenloop.models.config import ModelConfig
from tokenloop.models.layers import GatedMLP, Linear, RMSNorm, RotaryEmbedding, apply_rotary
from tokenloop.models.quant import Int8Embedding, low_precision_linear


class DecoderAttention(nn.Module):
    """qkv projection, RoPE, attention over the KV cache, output projection; with qk_norm, queries and keys are
    RMS-normalised per head before RoPE (Gemma 3)."""

    def __init__(self, config: ModelConfig, qk_norm: bool = False) -> None:
        super().__init__()
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.head_dim = config.head_dim
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias)
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=False)
        self.attn = KVCacheAttention(config.num_heads, config.num_kv_heads, config.head_dim, config.attention_scale)
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if qk_norm else None

    def normalize_qk(self, qkv: torch.Tensor) -> torch.Tensor:
        """(T, q + 2 kv) with each query and key head RMS-normalised, values as they were."""
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.q_norm(q.unflatten(-1, (-1, self.head_dim))).flatten(-2)
        k = self.k_norm(k.unflatten(-1, (-1, self.head_dim))).flatten(-2)
        return torch.cat([q, k, v], dim=-1)

    def forward(
        self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor, meta: AttentionMetadata | PackedSequences
    ) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        num_heads, num_kv_heads = self.q_size // self.head_dim, self.kv_size // self.head_dim
        if self.attn.cpu_kernel and qkv.dtype == torch.float32 and isinstance(meta, AttentionMetadata):
            # Normalise and rotate q and k and write k and v into the cache in one kernel pass (eager and compiled
            # alike).
            cos, sin = rope
            qkv = qkv.contiguous()
            norms = (
                (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)
                if self.q_norm is not None
                else (None, None, 0.0)
            )
            torch.ops.tokenloop.rotary_cache_write(
                qkv,
                cos.squeeze(1),
                sin.squeeze(1),
                self.attn.k_cache,
                self.attn.v_cache,
                meta.slot_mapping[self.attn.kv_group],
                meta.block_size,
                num_heads,
                *norms,
            )
            return self.o_proj(self.attn.attend(qkv[:, : self.q_size].view(-1, num_heads, self.head_dim), meta))
        if self.q_norm is not None:
            qkv = self.normalize_qk(qkv)
        qk = apply_rotary(qkv[:, : self.q_size + self.kv_size].view(-1, num_heads + num_kv_heads, self.head_dim), rope)
        q, k = qk.split([num_heads, num_kv_heads], dim=1)  # (T, num_heads, head_dim), (T, num_kv_heads, head_dim)
        v = qkv[:, self.q_size + self.kv_size :].view(-1, num_kv_heads, self.head_dim)
        return self.o_proj(self.attn(q, k, v, meta))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = DecoderAttention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_activation)

    def forward(
        self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor, meta: AttentionMetadata | PackedSequences
    ) -> torch.Tensor:
        x = x + self.self_attn(rope, self.input_layernorm(x), meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(nn.Module):
    """Parameters named as transformers' are, but for two packed matmuls per layer (self_attn.qkv_proj,
    mlp.gate_up_proj); how checkpoint tensors reach them is the loaders' business (models/weights.py)."""

    decoder_layer: type[nn.Module] = DecoderLayer  # built from the config, called as layer(rope, x, meta)

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        ropes = [config.layer_rope(i) for i in range(config.num_layers)]
        distinct = [rope for i, rope in enumerate(ropes) if rope not in ropes[:i]]
        self.rotary = nn.ModuleList(
            RotaryEmbedding(config.head_dim, config.max_position_embeddings, theta, scaling)
            for theta, scaling in distinct
        )
        self.layer_rotary = [distinct.index(rope) for rope in ropes]  # per layer, its table in self.rotary
        self.layer_windows = [config.layer_window(i) for i in range(config.num_layers)]
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(self.decoder_layer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        """The LM head shares the embedding matrix when the config says so (again after to_empty)."""
        if self.config.tie_word_embeddings and isinstance(self.embed_tokens, Int8Embedding):
            self.lm_head = self.embed_tokens
        elif self.config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """(T,) token ids → (T, hidden) in the activation dtype (the embedding may be stored in bfloat16)."""
        return self.embed_tokens(input_ids).to(self.norm.weight.dtype)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata | PackedSequences
    ) -> torch.Tensor:
        """(T,) token ids and positions → (T, hidden) final hidden states."""
        x = self.embed(input_ids)
        tables = [rotary.tables(positions) for rotary in self.rotary]
        metas = {window: meta if window is None else meta.windowed(window) for window in set(self.layer_windows)}
        for layer, rope, window in zip(self.layers, self.layer_rotary, self.layer_windows):
            x = layer(tables[rope], x, metas[window])
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if isinstance(self.lm_head, Int8Embedding):
            return self.lm_head.logits(hidden)  # (N, vocab)
        return low_precision_linear(hidden, self.lm_head.weight)

    def attention_layers(self) -> list[KVCacheAttention]:
        return [layer.self_attn.attn for layer in self.layers]
