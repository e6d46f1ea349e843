"""A trained model out of tokenloop: a Hugging Face folder, a PEFT adapter, LoRA merged into the weights (and, in
gguf_export.py, a GGUF file in its base's types).

Our modules pack q/k/v and gate/up (models/weights.py); every format written has them apart, so one name mapping,
`checkpoint_sources` (the inverse of weights.checkpoint_target), serves them all. LoRA on a packed module
splits exactly: each shard keeps the same A and takes its rows of B, so B A is the same delta row for row.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

from tokenloop.models.config import ModelConfig
from tokenloop.models.hf_loader import ONE_CENTERED_NORMS
from tokenloop.models.quant import QuantizedModule
from tokenloop.models.weights import PACKED_MODULES, shard_sizes
from tokenloop.tokenizer.tokenizer import Tokenizer

HF_MODEL_TYPES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Gemma3ForCausalLM": "gemma3_text",
}
LORA_WEIGHTS = ("lora_A", "lora_B")


def checkpoint_sources(config: ModelConfig, name: str) -> list[tuple[str, slice]]:
    """Our parameter (or a LoRA weight under it) → the checkpoint names (without `model.`) it holds, each with its
    rows: `layers.0.self_attn.qkv_proj.weight` → q_proj, k_proj, v_proj and their row ranges; else itself, all rows."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        shards = [ckpt for ckpt, (packed, _) in PACKED_MODULES.items() if packed == part]
        if shards:
            sizes, start, out = shard_sizes(config, part), 0, []
            for ckpt, size in zip(shards, sizes):
                out.append((".".join(parts[:i] + [ckpt] + parts[i + 1 :]), slice(start, start + size)))
                start += size
            return out
    return [(name, slice(None))]


def hf_tensor_name(name: str) -> str:
    """A checkpoint name without `model.` → transformers' (the LM head sits beside the decoder, not in it)."""
    return name if name.startswith("lm_head.") else f"model.{name}"


def peft_key(our_key: str, config: ModelConfig) -> list[tuple[str, slice]]:
    """A LoRA weight of our module tree (`layers.0.self_attn.qkv_proj.lora_B.weight`, as peft's
    get_peft_model_state_dict names it) → PEFT's keys on the transformers model and the rows each takes: lora_A
    is shared whole by a packed module's shards, lora_B is split by rows."""
    if not any(f".{kind}." in our_key for kind in LORA_WEIGHTS):
        raise ValueError(f"{our_key!r} is not a LoRA weight (lora_A or lora_B); DoRA, biases and embeddings are not")
    is_a = ".lora_A." in our_key
    return [
        (f"base_model.model.{hf_tensor_name(name)}", slice(None) if is_a else rows)
        for name, rows in checkpoint_sources(config, our_key)
    ]


def checkpoint_tensors(model: nn.Module, config: ModelConfig) -> dict[str, torch.Tensor]:
    """The model's weights under their checkpoint names (Hugging Face's, without `model.`), packed ones split, as the
    model holds them (Gemma's norms as 1 + w); copies, so that no two share memory (safetensors refuses that).
    A tied LM head is the embedding and is not repeated."""
    if any(isinstance(m, QuantizedModule) for m in model.modules()):
        raise ValueError("the model holds quantized weights: load it with keep_quantized=False to export it")
    out = {}
    for name, param in model.named_parameters():  # a tied lm_head.weight is the embedding's, listed once
        if any(kind in name for kind in LORA_WEIGHTS):
            raise ValueError(f"the model has LoRA weights ({name}): merge_lora(model) first, or save_peft_adapter")
        for ckpt, rows in checkpoint_sources(config, name):
            out[ckpt] = param.detach()[rows].float().clone()
    return out


def merge_lora(model: nn.Module) -> nn.Module:
    """Fold every injected LoRA into its base weight (W += scale B A) and put the base layer back in its place:
    the plain module tree save_hf_folder and export_gguf write."""
    from peft.tuners.lora import LoraLayer

    for name, module in list(model.named_modules()):
        if isinstance(module, LoraLayer):
            module.merge()
            parent, child = name.rsplit(".", 1)
            setattr(model.get_submodule(parent), child, module.get_base_layer())
    if hasattr(model, "peft_config"):  # left by inject_adapter_in_model; the model has no adapter any more
        del model.peft_config
    return model


def hf_config(config: ModelConfig, tokenizer: Tokenizer | None) -> dict[str, Any]:
    """config.json for transformers that ModelConfig.from_hf_config reads back to `config`: RoPE as rope_theta and
    rope_scaling, which transformers >= 5 still reads; Gemma 3's per-layer-type bases also as its rope_parameters."""
    if config.architecture not in HF_MODEL_TYPES:
        raise ValueError(f"no Hugging Face model_type known for {config.architecture!r}")
    cfg: dict[str, Any] = dict(
        architectures=[config.architecture],
        model_type=HF_MODEL_TYPES[config.architecture],
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        rms_norm_eps=config.rms_norm_eps,
        max_position_embeddings=config.max_position_embeddings,
        rope_theta=config.rope_theta,
        rope_scaling=config.rope_scaling,
        tie_word_embeddings=config.tie_word_embeddings,
        attention_bias=config.attention_bias,
        hidden_act=config.hidden_activation,
        torch_dtype="float32",
        dtype="float32",
    )
    if tokenizer is not None:
        cfg |= dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    if config.sliding_window is not None:
        cfg |= dict(sliding_window=config.sliding_window, use_sliding_window=True)
    if config.layer_types is not None:
        cfg["layer_types"] = list(config.layer_types)
    if config.architecture == "Gemma3ForCausalLM":
        local_theta = config.rope_local_theta or config.rope_theta
        full_rope = {"rope_type": "default", "rope_theta": config.rope_theta} | (config.rope_scaling or {})
        cfg |= dict(
            hidden_activation=config.hidden_activation,
            query_pre_attn_scalar=config.query_pre_attn_scalar or config.head_dim,
            rope_local_base_freq=local_theta,
            rope_parameters={
                "full_attention": full_rope,
                "sliding_attention": {"rope_type": "default", "rope_theta": local_theta},
            },
            final_logit_softcapping=None,
            attn_logit_softcapping=None,
        )
    return cfg


def save_hf_folder(model: nn.Module, config: ModelConfig, tokenizer: Tokenizer, out_dir: str | os.PathLike) -> Path:
    """A Hugging Face folder of the model in float32: config.json, model.safetensors, generation_config.json and the
    tokenizer's files; transformers, `tokenloop.LLM(out_dir)` and `tokenloop serve` load it."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, tensor in checkpoint_tensors(model, config).items():
        if config.architecture in ONE_CENTERED_NORMS and name.endswith("norm.weight"):
            tensor = tensor - 1.0  # transformers' Gemma computes 1 + w from the w it stores
        tensors[hf_tensor_name(name)] = tensor
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    _write_json(out / "config.json", hf_config(config, tokenizer))
    eos_ids = tokenizer.eos_token_ids
    generation = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": eos_ids[0] if len(eos_ids) == 1 else eos_ids}
    _write_json(out / "generation_config.json", generation)
    save_tokenizer(tokenizer, out, config.max_position_embeddings)
    return out


def save_tokenizer(tokenizer: Tokenizer, out: Path, max_length: int) -> None:
    """tokenizer.json (the Rust tokenizer whole: its post-processor adds BOS where the model wants it),
    tokenizer_config.json (special tokens, add_bos_token, the chat template) and special_tokens_map.json."""
    tokenizer.backend.save(str(out / "tokenizer.json"))
    # The tokenizer carries no pad token: a vocabulary's own "<pad>" (Gemma), else EOS as llama.cpp's Llama files do.
    pad = "<pad>" if tokenizer.backend.token_to_id("<pad>") is not None else tokenizer.eos_token
    special = {"bos_token": tokenizer.bos_token, "eos_token": tokenizer.eos_token, "pad_token": pad}
    special = {k: v for k, v in special.items() if v is not None}
    tokenizer_config = special | dict(
        tokenizer_class="PreTrainedTokenizerFast",
        add_bos_token=tokenizer.add_bos_token,
        add_eos_token=False,
        clean_up_tokenization_spaces=False,
        model_max_length=max_length,
    )
    if tokenizer.chat_template is not None:
        tokenizer_config["chat_template"] = tokenizer.chat_template
    _write_json(out / "tokenizer_config.json", tokenizer_config)
    _write_json(out / "special_tokens_map.json", special)


def save_peft_adapter(
    lora_state: dict[str, torch.Tensor],
    config: ModelConfig,
    r: int,
    lora_alpha: float,
    base_name: str,
    out_dir: str | os.PathLike,
) -> Path:
    """PEFT's adapter folder (adapter_config.json, adapter_model.safetensors) for the transformers model of the base:
    `PeftModel.from_pretrained(base, out_dir)` loads it. `lora_state`: peft.get_peft_model_state_dict of our model."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for key, tensor in lora_state.items():
        if ".lora_A." in key and tensor.shape[0] != r:
            raise ValueError(f"{key} has {tensor.shape[0]} rows, expected r={r}")
        for hf_key, rows in peft_key(key, config):
            tensors[hf_key] = tensor.detach()[rows].float().contiguous().clone()
    target_modules = sorted({key.split(".")[-3] for key in tensors})
    adapter_config = dict(
        peft_type="LORA",
        task_type="CAUSAL_LM",
        r=r,
        lora_alpha=lora_alpha,
        target_modules=target_modules,
        base_model_name_or_path=base_name,
        lora_dropout=0.0,
        bias="none",
        fan_in_fan_out=False,
        inference_mode=True,
        use_rslora=False,
        use_dora=False,
        modules_to_save=None,
    )
    save_file(tensors, out / "adapter_model.safetensors", metadata={"format": "pt"})
    _write_json(out / "adapter_config.json", adapter_config)
    return out


def _write_json(path: Path, value: dict[str, Any]) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
