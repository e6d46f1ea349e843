"""Load a model from a known name, a .gguf file or a Hugging Face folder: weights, config and tokenizer."""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from tokenloop.models import store
from tokenloop.models.config import ModelConfig
from tokenloop.models.gguf_loader import config_from_gguf, iter_gguf_weights, quantized_layouts
from tokenloop.models.gguf_metadata import open_gguf, read_metadata
from tokenloop.models.hf_loader import config_from_folder, iter_safetensors_weights
from tokenloop.models.huge_pages import allocate_in_huge_pages
from tokenloop.models.layers import RotaryEmbedding
from tokenloop.models.quant import Int8Embedding, QuantizedModule, QuantLayout
from tokenloop.models.registry import model_class
from tokenloop.models.weights import load_weights, use_quantized
from tokenloop.tokenizer.tokenizer import Tokenizer


class SkipInit(TorchFunctionMode):
    """nn.init's functions do nothing: a model built on the meta device has no values to initialise. (Run on
    meta tensors, the random ones go through Python references that import torch's compiler: 70 MB of
    resident memory for nothing.)"""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__module__", None) == "torch.nn.init":
            return kwargs["tensor"] if "tensor" in kwargs else args[0]
        return func(*args, **kwargs)


@dataclass(slots=True)
class LoadedModel:
    model: nn.Module
    config: ModelConfig
    tokenizer: Tokenizer | None
    path: Path


def load_model(
    name_or_path: str | os.PathLike | None,
    dtype: torch.dtype,
    device: torch.device,
    load_tokenizer: bool = True,
    keep_quantized: bool = False,
) -> LoadedModel:
    """keep_quantized: GGUF linears of the types in ggml_types.GGML_FORMATS stay 4-, 5- or 8-bit (Int4Linear,
    Int5Linear, Int8Linear), a tied 5- or 8-bit embedding / LM head is held as 8-bit (Int8Embedding) and any other
    embedding / LM head of such a file is held in bfloat16 (the fast path); otherwise every weight is dequantized to
    `dtype` (the exact path)."""
    path = store.resolve(name_or_path)
    layouts: dict[str, QuantLayout] = {}
    if path.is_dir():
        config = config_from_folder(path)
        weights: Iterable[tuple[str, torch.Tensor]] = iter_safetensors_weights(path, config)
        tokenizer = Tokenizer.from_hf_folder(path) if load_tokenizer else None
    else:
        reader = open_gguf(path)
        meta = read_metadata(reader)
        config = config_from_gguf(meta, {t.name for t in reader.tensors})
        if keep_quantized:
            layouts = quantized_layouts(reader, config)
        weights = iter_gguf_weights(reader, config, keep_quantized=keep_quantized)
        tokenizer = Tokenizer.from_gguf_metadata(meta) if load_tokenizer else None
        # The parsed metadata (a vocabulary of tens of thousands of small arrays) is not needed any more:
        # freed before the weights arrive, it stays out of the peak memory of loading.
        reader.fields.clear()
        del meta
    model = build_model(config, dtype, device, layouts)
    load_weights(model, weights)
    for module in model.modules():
        if isinstance(module, QuantizedModule):
            module.use_cpu_kernel()
    return LoadedModel(model=model.eval(), config=config, tokenizer=tokenizer, path=path)


def load_config(name_or_path: str | os.PathLike | None) -> ModelConfig:
    """A model's config (a known name, a .gguf file or a Hugging Face folder), read without its weights."""
    path = store.resolve(name_or_path)
    if path.is_dir():
        return config_from_folder(path)
    reader = open_gguf(path)
    return config_from_gguf(read_metadata(reader), {t.name for t in reader.tensors})


def load_tokenizer(name_or_path: str | os.PathLike | None) -> Tokenizer:
    """A model's tokenizer alone (its metadata read, none of its weights)."""
    path = store.resolve(name_or_path)
    if path.is_dir():
        return Tokenizer.from_hf_folder(path)
    return Tokenizer.from_gguf_metadata(read_metadata(open_gguf(path)))


def build_model(
    config: ModelConfig, dtype: torch.dtype, device: torch.device, layouts: dict[str, QuantLayout] | None = None
) -> nn.Module:
    """Parameters in their dtype on their device, left uninitialised: the checkpoint writes every one of them
    (load_weights checks), so random initialisation would be seconds of wasted work."""
    cls = model_class(config.architecture)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"), SkipInit():
            model = cls(config)
            use_quantized(model, layouts or {})
    finally:
        torch.set_default_dtype(previous)
    if layouts:  # the fast path holds an embedding / LM head it did not keep in int8 in bfloat16
        for module in {model.embed_tokens, model.lm_head}:
            if not isinstance(module, Int8Embedding):
                module.to(torch.bfloat16)
    allocate_in_huge_pages(model, torch.device(device))  # before load_weights first writes them
    model.tie_weights()
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):  # its tables are computed, not loaded
            module.reset_tables()
    return model
