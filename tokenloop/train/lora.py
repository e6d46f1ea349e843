"""LoRA on the serving model's own module tree, through peft: a low-rank update beside each attention and MLP
projection (the packed ones too: a LoRA of qkv_proj is exactly one LoRA per q, k, v sharing its A), the base
weights frozen."""

from __future__ import annotations

import torch
from torch import nn

TARGET_MODULES = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]


def add_lora(model: nn.Module, rank: int, alpha: float) -> None:
    """Inject rank-`rank` adapters (B zero: the model is unchanged until trained) and freeze everything else."""
    try:
        from peft import LoraConfig, inject_adapter_in_model
    except ImportError:
        raise ValueError("lora_rank: LoRA trains through peft: pip install 'tokenloop[train]'") from None
    config = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0, target_modules=TARGET_MODULES, bias="none")
    inject_adapter_in_model(config, model)
    for name, param in model.named_parameters():
        param.requires_grad = "lora_" in name


def lora_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapters' weights by our module names: `layers.N.self_attn.qkv_proj.lora_A.weight` (r, in) and `.lora_B.`
    (out, r)."""
    from peft.utils import get_peft_model_state_dict

    return {name: t.detach().contiguous() for name, t in get_peft_model_state_dict(model).items()}
