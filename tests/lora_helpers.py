"""Test LoRA adapters made with PEFT on a transformers model, and the merged model they must equal."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(
    model,
    tokenizer_files: Path | object,
    folder: Path,
    seed: int,
    targets: list[str] | None = None,
    b_scale: float = 4.0,
    **lora_args,
) -> tuple[Path, Path]:
    """A random adapter (non-zero B) on `model` (transformers, float32), saved in PEFT's layout in folder/adapter,
    and the model with it merged in, saved with the tokenizer in folder/merged: (adapter folder, merged folder).
    `tokenizer_files`: a folder whose tokenizer files are copied, or a transformers tokenizer to save. `b_scale`
    multiplies PEFT's random B: x4 changes the tiny model's greedy tokens; a 30-layer model wants less (x0.25 moves
    SmolLM2's logits by about 5, as a fine-tune might), else its activations grow far past a trained adapter's."""
    peft = pytest.importorskip("peft")
    if getattr(model, "hf_quantizer", None) is not None:  # loaded from a GGUF: a plain copy saves as safetensors
        plain = type(model)(model.config).to(torch.float32)
        plain.load_state_dict(model.state_dict())
        model = plain.eval()
    torch.manual_seed(seed)
    config = peft.LoraConfig(
        **({"r": 8, "lora_alpha": 16, "target_modules": targets or ALL_TARGETS, "init_lora_weights": False} | lora_args)
    )
    peft_model = peft.get_peft_model(model, config)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.mul_(b_scale)
    adapter, merged = folder / "adapter", folder / "merged"
    peft_model.save_pretrained(adapter)
    peft_model.merge_and_unload().save_pretrained(merged)
    if isinstance(tokenizer_files, Path):
        for file in tokenizer_files.iterdir():
            if file.name.startswith(("tokenizer", "generation_config", "special_tokens")):
                shutil.copy(file, merged / file.name)
    else:
        tokenizer_files.save_pretrained(merged)
    return adapter, merged


def write_random_adapter(folder: Path, config, seed: int, r: int = 4, scale: float = 0.2) -> Path:
    """A random adapter for any model of `config` (tokenloop's ModelConfig), written directly in PEFT's layout
    (lora_alpha = r: scaling 1): for models transformers cannot load with PEFT here (a K-quant GGUF)."""
    import json

    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(seed)
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    hidden, inter = config.hidden_size, config.intermediate_size
    shapes = {
        "self_attn.q_proj": (hidden, q),
        "self_attn.k_proj": (hidden, kv),
        "self_attn.v_proj": (hidden, kv),
        "self_attn.o_proj": (q, hidden),
        "mlp.gate_proj": (hidden, inter),
        "mlp.up_proj": (hidden, inter),
        "mlp.down_proj": (inter, hidden),
    }
    tensors = {}
    for layer in range(config.num_layers):
        for module, (n_in, n_out) in shapes.items():
            key = f"base_model.model.model.layers.{layer}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(r, n_in, generator=generator) * scale / n_in**0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(n_out, r, generator=generator) * scale
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, folder / "adapter_model.safetensors")
    targets = [m.rpartition(".")[2] for m in shapes]
    config_json = {"peft_type": "LORA", "r": r, "lora_alpha": r, "target_modules": targets, "bias": "none"}
    (folder / "adapter_config.json").write_text(json.dumps(config_json))
    return folder
