"""EngineConfig: what an engine is built from (model, precision, device, KV cache, batching, compile, speculation)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch

from tokenloop import kernels
from tokenloop.engine.compiled_decode import CompileSpec
from tokenloop.engine.kv_groups import kv_bytes_per_block, kv_cache_tokens
from tokenloop.engine.lora import LoRARequest
from tokenloop.models.config import ModelConfig
from tokenloop.spec_decode.config import SpeculativeConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# The KV cache's: "auto" follows dtype (16 bits on the fast path); "int8" quantizes each token's head with a float16
# scale (models/kv_layout.py): twice the tokens in the same memory, half the bytes read per step.
KV_CACHE_DTYPES = ("auto", "int8")


def _check_device(device: str) -> None:
    try:
        kind = torch.device(device).type
    except RuntimeError as e:
        raise ValueError(f"device {device!r} is not a torch device: {e}") from None
    if kind != "cpu" and not (
        torch.accelerator.is_available() and torch.accelerator.current_accelerator().type == kind
    ):
        build = (
            "a CPU-only build"
            if torch.version.cuda is None and torch.version.hip is None
            else f"built for {torch.version.cuda or torch.version.hip}"
        )
        raise ValueError(
            f"device {device!r} is not available: this torch {torch.__version__} is {build} (see the README on GPUs)"
        )


def compile_by_default() -> bool:
    """Decode steps are compiled unless TOKENLOOP_COMPILE=0 says otherwise."""
    return os.environ.get("TOKENLOOP_COMPILE", "1") != "0"


@dataclass(slots=True)
class EngineConfig:
    model: str | None = None  # known name, .gguf file or Hugging Face folder; None = the default model
    # "auto": the fast path (4-bit GGUF weights stay 4-bit, float32 activations); "float32": every weight
    # dequantized to float32 (the exact reference path); "bfloat16", "float16".
    dtype: str = "auto"
    device: str | None = None  # None = the first accelerator torch finds, else the CPU
    block_size: int = 16  # tokens per KV cache block
    kv_cache_gb: float = 1.0  # memory for the KV block pool
    kv_cache_dtype: str = "auto"  # one of KV_CACHE_DTYPES
    max_num_seqs: int = 64  # sequences in one step at most
    max_num_batched_tokens: int = 2048  # tokens in one step at most (decodes plus prefill chunks)
    max_model_len: int | None = None  # context length; None = the model's own
    enable_prefix_caching: bool = True
    # Decode steps run as one compiled C++ call (engine/compiled_decode.py), cached under $TOKENLOOP_HOME/compiled.
    # A start without the package runs eager while a child process compiles it (compile_in_background), or
    # compiles it first. TOKENLOOP_COMPILE=0 in the environment turns the default off.
    compile: bool = field(default_factory=compile_by_default)
    compile_in_background: bool = True
    threads: int | None = (
        None  # CPU threads for the step (torch.set_num_threads); None = one per idle core (engine/threads.py)
    )
    inject_faults: tuple[str, ...] = ()  # tests only: "STAGE:TOKEN_ID" each (engine/faults.py)
    # Speculative decoding (spec_decode/): {"method": "ngram" | "draft", "num_speculative_tokens": k, ...}; None = off.
    speculative_config: SpeculativeConfig | dict[str, Any] | None = None
    # LoRA adapters (engine/lora.py): requests may name one (loaded on first use); lora_modules are loaded at start
    # (and turn enable_lora on). With adapters the decode step runs eager (the compiled package is the base model's).
    enable_lora: bool = False
    # Disaggregated serving: the KV pools live in shared-memory files under this name (engine/shared_pools.py), for
    # a decode worker to copy a prefill worker's blocks from (None: private, anonymous memory).
    kv_shared_memory: str | None = None
    lora_modules: tuple[LoRARequest, ...] = ()

    def __post_init__(self) -> None:
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be 'auto' or one of {', '.join(DTYPES)}, got {self.dtype!r}")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.block_size % 16:  # attention reads keys 16 consecutive positions at a time
            raise ValueError(f"block_size must be a multiple of 16, got {self.block_size}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if not self.kv_cache_gb > 0:
            raise ValueError(f"kv_cache_gb must be > 0, got {self.kv_cache_gb}")
        if self.device is not None:
            _check_device(self.device)
        if self.threads is not None and (not isinstance(self.threads, int) or self.threads < 1):
            raise ValueError(f"threads must be an integer >= 1, got {self.threads!r}")
        if self.speculative_config is not None:
            self.speculative_config = SpeculativeConfig.of(self.speculative_config)
        self.lora_modules = tuple(self.lora_modules)
        if names := [m.name for m in self.lora_modules]:
            if len(set(names)) != len(names):
                raise ValueError(f"lora_modules names must be distinct, got {names}")
            self.enable_lora = True

    def context_length(self, model: ModelConfig) -> int:
        """The engine's context: max_model_len, at most the model's own."""
        return min(self.max_model_len or model.max_position_embeddings, model.max_position_embeddings)

    def num_kv_blocks(self, model: ModelConfig) -> int:
        """The KV blocks kv_cache_gb holds of this model."""
        return int(self.kv_cache_gb * 2**30) // kv_bytes_per_block(model, self.block_size, self.kv_dtype)

    def kv_cache_tokens(self, model: ModelConfig) -> int:
        """The tokens one sequence can always hold in the KV cache."""
        return kv_cache_tokens(model, self.num_kv_blocks(model), self.block_size, self.max_num_batched_tokens)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES["float32" if self.dtype == "auto" else self.dtype]

    @property
    def kv_dtype(self) -> torch.dtype:
        """The KV cache's torch dtype. By default the fast path keeps K/V in 16 bits, as llama.cpp does (half the
        memory of a long or busy cache): bfloat16 where the CPU multiplies bfloat16 pairs (AVX512-BF16), which
        attention's products then read as they are, else float16, converted to float32 as attention reads it. The
        exact path keeps its own dtype. kv_cache_dtype="int8" is int8 on either."""
        if self.kv_cache_dtype == "int8":
            return torch.int8
        if self.dtype != "auto":
            return self.torch_dtype
        return (
            torch.bfloat16 if self.torch_device.type == "cpu" and kernels.bfloat16_cache_supported() else torch.float16
        )

    @property
    def torch_device(self) -> torch.device:
        if self.device is not None:
            return torch.device(self.device)
        accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
        return accelerator if accelerator is not None else torch.device("cpu")


def compile_spec(config: EngineConfig, path: os.PathLike | str) -> CompileSpec:
    """How a background compile loads the model at `path` with this config."""
    return CompileSpec(
        str(path),
        str(config.torch_dtype).removeprefix("torch."),
        str(config.torch_device),
        config.dtype == "auto",
        str(config.kv_dtype).removeprefix("torch."),
        config.block_size,
    )
