"""ModelConfig: the shape of a decoder-only transformer, read from config.json or GGUF metadata."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(slots=True)
class ModelConfig:
    architecture: str  # Hugging Face class name, the model registry's key (e.g. "LlamaForCausalLM")
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # width of the SwiGLU MLP
    num_layers: int
    num_heads: int  # query heads
    num_kv_heads: int  # key/value heads; num_heads / num_kv_heads queries share one (GQA)
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int  # the context length
    rope_scaling: dict[str, Any] | None = None  # {"rope_type": "llama3", "factor", "low_freq_factor", ...} or None
    tie_word_embeddings: bool = False  # the LM head reuses the token embedding matrix
    attention_bias: bool = False  # q/k/v projections carry a bias (Qwen2)
    sliding_window: int | None = None  # attend only to the last sliding_window positions (Mistral)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"model config: {name} must be >= 1, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"model config: num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.rope_scaling is not None and self.rope_scaling.get("rope_type", "default") not in ("default", "llama3"):
            raise ValueError(f"model config: unsupported rope_scaling {self.rope_scaling!r} (supported: llama3)")

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> ModelConfig:
        """From a Hugging Face config.json (Llama, Mistral, Qwen2 field names)."""
        architectures = cfg.get("architectures") or []
        if len(architectures) != 1:
            raise ValueError(f"config.json must name exactly one architecture, got {architectures!r}")
        num_heads = cfg["num_attention_heads"]
        rope_scaling = cfg.get("rope_scaling")
        rope_theta = cfg.get("rope_theta")
        rope_parameters = cfg.get("rope_parameters")  # transformers >= 5 folds theta and scaling into one dict
        if rope_parameters:
            rope_theta = rope_parameters.get("rope_theta", rope_theta)
            if rope_parameters.get("rope_type", "default") != "default":
                rope_scaling = rope_parameters
        if rope_scaling is not None and "rope_type" not in rope_scaling:
            rope_scaling = {**rope_scaling, "rope_type": rope_scaling.get("type", "default")}
        # Qwen2 configs carry a sliding_window value even when use_sliding_window is false.
        sliding_window = cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None
        return cls(
            architecture=architectures[0],
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta if rope_theta is not None else 10000.0,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            rope_scaling=rope_scaling,
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            attention_bias=cfg.get("attention_bias", architectures[0] == "Qwen2ForCausalLM"),
            sliding_window=sliding_window,
        )
