"""ModelConfig: the shape of a decoder-only transformer, read from config.json or GGUF metadata."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tokenloop.models.layers import ACTIVATIONS

LAYER_TYPES = ("sliding_attention", "full_attention")


@dataclass(slots=True)
class ModelConfig:
    architecture: str  # Hugging Face class name, the model registry's key (e.g. "LlamaForCausalLM")
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # width of the gated MLP
    num_layers: int
    num_heads: int  # query heads
    num_kv_heads: int  # key/value heads; num_heads / num_kv_heads queries share one (GQA)
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int  # the context length
    rope_scaling: dict[str, Any] | None = None  # {"rope_type": "llama3" or "linear", "factor", ...} or None
    tie_word_embeddings: bool = False  # the LM head reuses the token embedding matrix
    attention_bias: bool = False  # q/k/v projections carry a bias (Qwen2)
    sliding_window: int | None = None  # attend only to the last sliding_window positions (Mistral: every layer)
    # Per layer, "sliding_attention" (within sliding_window) or "full_attention" (Gemma 3 interleaves them);
    # None: every layer is sliding when sliding_window is set, else full.
    layer_types: tuple[str, ...] | None = None
    rope_local_theta: float | None = None  # RoPE base of the sliding layers, without rope_scaling; None: rope_theta
    hidden_activation: str = "silu"  # of the gated MLP: "silu" (SwiGLU) or "gelu_pytorch_tanh" (GeGLU, Gemma)
    query_pre_attn_scalar: float | None = None  # attention scores are scaled by its inverse square root; None: head_dim

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"model config: {name} must be >= 1, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"model config: num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.rope_scaling is not None and self.rope_scaling.get("rope_type", "default") not in (
            "default",
            "linear",
            "llama3",
        ):
            raise ValueError(
                f"model config: unsupported rope_scaling {self.rope_scaling!r} (supported: linear, llama3)"
            )
        if self.layer_types is not None:
            self.layer_types = tuple(self.layer_types)
            if len(self.layer_types) != self.num_layers or not set(self.layer_types) <= set(LAYER_TYPES):
                raise ValueError(
                    f"model config: layer_types must name one of {LAYER_TYPES} per layer ({self.num_layers}), "
                    f"got {self.layer_types!r}"
                )
            if "sliding_attention" in self.layer_types and self.sliding_window is None:
                raise ValueError("model config: layer_types has sliding_attention layers but sliding_window is not set")
        if self.hidden_activation not in ACTIVATIONS:
            raise ValueError(
                f"model config: hidden_activation must be one of {tuple(ACTIVATIONS)}, got {self.hidden_activation!r}"
            )

    def layer_window(self, layer: int) -> int | None:
        """How many positions layer `layer` attends back to (itself included); None: all of them."""
        if self.layer_types is None or self.layer_types[layer] == "sliding_attention":
            return self.sliding_window
        return None

    def layer_rope(self, layer: int) -> tuple[float, dict[str, Any] | None]:
        """RoPE base and scaling of layer `layer`: a sliding layer's own base, unscaled, where the model has one."""
        if self.rope_local_theta is not None and self.layer_window(layer) is not None:
            return self.rope_local_theta, None
        return self.rope_theta, self.rope_scaling

    @property
    def attention_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> ModelConfig:
        """From a Hugging Face config.json (Llama, Mistral, Qwen2, Gemma 3 field names)."""
        architectures = cfg.get("architectures") or []
        if len(architectures) != 1:
            raise ValueError(f"config.json must name exactly one architecture, got {architectures!r}")
        for unsupported in ("final_logit_softcapping", "attn_logit_softcapping", "use_bidirectional_attention"):
            if cfg.get(unsupported):
                raise ValueError(f"config.json: unsupported {unsupported}={cfg[unsupported]!r}")
        num_heads = cfg["num_attention_heads"]
        rope_theta, rope_scaling, rope_local_theta = _hf_rope(cfg)
        # Qwen2 configs carry a sliding_window value even when use_sliding_window is false.
        sliding_window = cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None
        layer_types = cfg.get("layer_types")
        pattern = cfg.get("sliding_window_pattern", cfg.get("_sliding_window_pattern"))
        if (
            layer_types is None and pattern is not None
        ):  # Gemma 3 before transformers wrote layer_types: every pattern-th layer is full
            layer_types = [
                "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(cfg["num_hidden_layers"])
            ]
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
            layer_types=layer_types,
            rope_local_theta=rope_local_theta,
            hidden_activation=cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu",
            query_pre_attn_scalar=cfg.get("query_pre_attn_scalar"),
        )


def _hf_rope(cfg: dict[str, Any]) -> tuple[float | None, dict[str, Any] | None, float | None]:
    """(rope_theta, rope_scaling, rope_local_theta) from any of config.json's spellings: transformers >= 5 folds
    theta and scaling into one `rope_parameters` dict, keyed by layer type where they differ (Gemma 3); earlier
    configs have rope_theta, rope_scaling and Gemma 3's rope_local_base_freq."""
    rope_theta, rope_scaling, local_theta = (
        cfg.get("rope_theta"),
        cfg.get("rope_scaling"),
        cfg.get("rope_local_base_freq"),
    )
    params = cfg.get("rope_parameters")
    if params and "full_attention" in params:
        local = params.get("sliding_attention") or {}
        if local.get("rope_type", "default") != "default":
            raise ValueError(f"config.json: unsupported rope_parameters for sliding layers {local!r}")
        local_theta = local.get("rope_theta", local_theta)
        params = params["full_attention"]
    if params:
        rope_theta = params.get("rope_theta", rope_theta)
        if params.get("rope_type", "default") != "default":
            rope_scaling = params
    if rope_scaling is not None and "rope_type" not in rope_scaling:
        rope_scaling = {**rope_scaling, "rope_type": rope_scaling.get("type", "default")}
    return rope_theta, rope_scaling, local_theta
