"""The decode step compiled: a batch of one new token per sequence runs the whole model forward as one graph.

A decode step of a small model is a few hundred tiny ops; eager PyTorch pays several microseconds of dispatch
for each, as much as the matmuls cost. torch.compile (inductor) fuses them into a handful of
C++ kernels around the matmul calls. Shapes are dynamic (batch size, context length), so one graph serves
every single-sequence decode step and one more every batch of two or more sequences. Prefill and
mixed batches stay eager: their time goes to large matmuls, not dispatch.

Inductor's caches live under $TOKENLOOP_HOME/inductor, so a later start reuses the compiled code instead
of compiling again. Where compiling is not possible (no C++ compiler, an unsupported op) the step warns
once and runs eager from then on: the same model, the same tokens.
"""

from __future__ import annotations

import os
import warnings

import torch
from torch import nn
from torch.fx.experimental import _config as fx_config
from torch._inductor.runtime.cache_dir_utils import default_cache_dir

from tokenloop.models.attention import AttentionMetadata
from tokenloop.models.store import tokenloop_home

# Guards dynamo checks before every call of a compiled graph that cannot fail once a model is loaded:
# ~300 weight tensors that never change dtype, shape or device; the hook dicts of ~400 modules that never
# get hooks; the type of each module's _parameters/_buffers/_modules (always a dict); whether anyone marked
# a tensor's dimensions dynamic (nobody does). Checking them costs milliseconds a step. The model's
# structure (module types, sizes such as q_size and head_dim) stays guarded, so another model never runs
# this one's graph.
SKIPPED_GUARDS = {"EMPTY_NN_MODULE_HOOKS_DICT", "NOT_PRESENT_IN_GENERIC_DICT", "DIMENSION_DYNAMIC_MARKING_GUARD"}
MODULE_DICTS = ("._parameters", "._buffers", "._modules")


def keep_guard(entry) -> bool:
    is_weight = "._parameters[" in entry.name or "._buffers[" in entry.name
    is_module_dict = entry.guard_type == "TYPE_MATCH" and entry.name.endswith(MODULE_DICTS)
    return not (entry.guard_type in SKIPPED_GUARDS or is_module_dict or (entry.guard_type == "TENSOR_MATCH" and is_weight))


def compile_options() -> dict:
    return {
        "guard_filter_fn": lambda entries: [keep_guard(e) for e in entries],
        # Inductor's generated code re-checks the size, stride and alignment of every buffer on every call
        # (about 600 checks a step, over a millisecond): debugging checks of a graph that does not change.
        "size_asserts": False,
        "alignment_asserts": False,
        "scalar_asserts": False,
    }


def use_tokenloop_cache_dir() -> None:
    """Inductor's caches under $TOKENLOOP_HOME/inductor (kept across reboots, unlike its /tmp default), unless
    TORCHINDUCTOR_CACHE_DIR says otherwise. Inductor writes its default into the variable once it has
    looked it up, so that value counts as unset."""
    current = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if current is None or os.path.abspath(current) == os.path.abspath(default_cache_dir()):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(tokenloop_home() / "inductor")


class DecodeForward:
    """model.forward for the model runner: compiled for decode-only batches, eager for everything else."""

    def __init__(self, model: nn.Module, compile: bool) -> None:
        self.model = model
        self.compiled = None
        self.guards_frozen = False
        if compile:
            use_tokenloop_cache_dir()
            self.compiled = torch.compile(model.forward, fullgraph=True, dynamic=True, options=compile_options())

    def freeze_guards(self) -> None:
        """Called once the graphs are built (LLMEngine.warm_up: one sequence, then several). From then on dynamo
        checks only the guards that tell those two graphs apart, not the ~3,000 that re-prove that the model
        is unchanged (about 1 ms a step). torch calls this unsafe because a call that needs a new graph would
        run an old one instead; after the warm-up none does: batch size and context length are dynamic, and
        the model, its dtypes and its caches never change."""
        self.guards_frozen = True

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, decode_only: bool) -> torch.Tensor:
        if self.compiled is not None and decode_only:
            try:
                # No duck shaping: a context length that happens to equal a model size (the KV head count,
                # say) on the step that traces must stay a symbol, not become that constant.
                with fx_config.patch(use_duck_shape=False), torch.compiler.set_stance(skip_guard_eval_unsafe=self.guards_frozen):
                    return self.compiled(input_ids, positions, meta)
            except torch._dynamo.exc.TorchDynamoException as e:  # tracing or code generation failed
                warnings.warn(f"compiling the decode step failed, running it eager from now on: {e}", stacklevel=2)
                self.compiled = None
        return self.model(input_ids, positions, meta)
