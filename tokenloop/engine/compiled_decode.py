"""The decode step compiled ahead of time: a batch of one new token per sequence runs the whole model forward
as one C++ call.

A decode step of a small model is a few hundred tiny ops; eager PyTorch pays several microseconds of dispatch
for each, as much as the matmuls cost. AOTInductor (torch.export, then inductor's C++ code generation)
fuses them into a handful of C++ kernels around the matmul calls and compiles the lot, Python wrapper
included, into one shared library. Batch size and context length are dynamic, so one package serves every
decode step. Prefill and mixed batches stay eager: their time goes to large matmuls, not dispatch.

The package holds code only: the weights stay the model's own tensors, handed over at load (no second
copy), and the KV caches are inputs, written in place. It is cached under $TOKENLOOP_HOME/compiled, keyed
by everything the code depends on (model structure, dtypes, device, threads, torch and tokenloop sources).
So the first start compiles (about two minutes for SmolLM2-135M on two cores) and later starts only load
a library: they never import torch's compiler (dynamo and inductor weigh over 100 MB of resident memory).
Where compiling is not possible (no C++ compiler, an unsupported op) the step warns once and runs eager:
the same model, the same tokens.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import warnings
from pathlib import Path

import torch
from torch import nn

from tokenloop.models.attention import AttentionGroup, AttentionMetadata
from tokenloop.models.store import tokenloop_home

PACKAGE_SOURCES = [
    *Path(__file__).parent.parent.glob("models/*.py"),
    *Path(__file__).parent.parent.glob("kernels/*.cpp"),
    *Path(__file__).parent.parent.glob("kernels/*.h"),
    Path(__file__),
]


class DecodeStep(nn.Module):
    """model.forward with the attention metadata as tensors and the KV caches as inputs: what torch.export
    traces. The caches are bound to the attention layers only while tracing (in the package they are inputs)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids, positions, slot_mapping, query_index, output_index, key_slots, mask, k_caches, v_caches):
        layers = self.model.attention_layers()
        bound = [(attn.k_cache, attn.v_cache) for attn in layers]
        try:
            for attn, k, v in zip(layers, k_caches, v_caches):
                attn.k_cache, attn.v_cache = k, v
            group = AttentionGroup(query_index, output_index, key_slots, mask, token_rows=None)
            return self.model(input_ids, positions, AttentionMetadata(slot_mapping, [group]))
        finally:
            for attn, (k, v) in zip(layers, bound):
                attn.k_cache, attn.v_cache = k, v


def example_inputs(input_ids: torch.Tensor, caches: list[torch.Tensor]) -> tuple:
    """A decode batch of 2 sequences with 3 tokens of context each, on the caches' first slots."""
    device = caches[0].device
    index = torch.arange(2, device=device)
    num_layers = len(caches) // 2
    return (
        input_ids.new_zeros(2), torch.full((2,), 2, device=device), index * 3 + 2, index[:, None], index,
        torch.arange(6, device=device).view(2, 3), torch.ones(2, 1, 1, 3, dtype=torch.bool, device=device),
        caches[:num_layers], caches[num_layers:],
    )


def named_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer by every name it has: a tied head's names too, and non-persistent buffers
    (the rotary tables), which state_dict leaves out. The package refers to its constants by these names."""
    return dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers(remove_duplicate=False))


def package_key(model: nn.Module, caches: list[torch.Tensor]) -> str:
    """What the compiled code depends on: the model's structure and config, every tensor's dtype and shape,
    which kernels it calls, the caches' dtype and device, the thread count (inductor fixes it in the code),
    and the sources of torch and of tokenloop's model code."""
    parts = [str(model), repr(getattr(model, "config", None)), torch.__version__, str(torch.get_num_threads())]
    parts += [f"{name}:{t.dtype}:{tuple(t.shape)}:{t.device.type}" for name, t in named_tensors(model).items()]
    parts += [f"{name}:{getattr(m, 'cpu_kernel', None)}" for name, m in model.named_modules()]
    kv_heads, _, head_dim = caches[0].shape  # [kv_heads, slots, head_dim]: the slot count is dynamic
    parts += [f"{caches[0].dtype}:{caches[0].device.type}:{kv_heads}:{head_dim}"]
    digest = hashlib.sha256("\n".join(parts).encode())
    for path in sorted(PACKAGE_SOURCES):
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def build_package(model: nn.Module, caches: list[torch.Tensor], target: Path) -> None:
    """torch.export the decode step (batch size, context length and cache size dynamic), then AOTInductor."""
    from torch._inductor import aoti_compile_and_package
    from torch.export import Dim

    use_tokenloop_cache_dir()
    batch, context, slots = Dim("batch", min=1, max=2**16), Dim("context", min=2, max=2**24), Dim("slots", min=6, max=2**31)
    num_layers = len(caches) // 2
    dynamic_shapes = (
        {0: batch}, {0: batch}, {0: batch}, {0: batch}, {0: batch}, {0: batch, 1: context}, {0: batch, 3: context},
        [{1: slots}] * num_layers, [{1: slots}] * num_layers,
    )
    with torch.no_grad():
        program = torch.export.export(DecodeStep(model), example_inputs(torch.zeros(1, dtype=torch.int64), caches), dynamic_shapes=dynamic_shapes, strict=False)
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = os.path.join(tmp, target.name)
        # The weights are not packaged: at load the package is given the model's own tensors.
        aoti_compile_and_package(program, package_path=built, inductor_configs={"aot_inductor.package_constants_in_so": False})
        os.replace(built, target)  # atomic: a concurrent start never loads half a file


def use_tokenloop_cache_dir() -> None:
    """Inductor's caches under $TOKENLOOP_HOME/inductor (kept across reboots, unlike its /tmp default), unless
    TORCHINDUCTOR_CACHE_DIR says otherwise. Inductor writes its default into the variable once it has
    looked it up, so that value counts as unset."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    current = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if current is None or os.path.abspath(current) == os.path.abspath(default_cache_dir()):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(tokenloop_home() / "inductor")


class DecodeForward:
    """model.forward for the model runner: the compiled package for decode-only batches, eager for the rest."""

    def __init__(self, model: nn.Module, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor], compile: bool) -> None:
        self.model = model
        self.caches = [*k_caches, *v_caches]
        self.compiled = None
        self.built = False  # whether this start compiled the package (else it came from the cache)
        if compile:
            try:
                self.compiled = self._load_or_build()
            except Exception as e:  # noqa: BLE001 — export or C++ compilation failed: any error means "eager"
                warnings.warn(f"compiling the decode step failed, running it eager: {type(e).__name__}: {e}", stacklevel=2)

    def _load_or_build(self):
        path = tokenloop_home() / "compiled" / f"decode-{package_key(self.model, self.caches)}.pt2"
        if not path.exists():
            build_package(self.model, self.caches, path)
            self.built = True
        device = self.caches[0].device
        loader = torch._C._aoti.AOTIModelPackageLoader(str(path), "model", False, 1, -1 if device.index is None else device.index)
        tensors = {f"model.{name}": t.data for name, t in named_tensors(self.model).items()}
        # user_managed: the package reads these tensors where they are, without copying them.
        loader.load_constants({name: tensors[name] for name in loader.get_constant_fqns()}, False, True, True)
        return loader

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, decode_only: bool) -> torch.Tensor:
        if self.compiled is not None and decode_only:
            (group,) = meta.groups  # a decode-only batch is one group
            inputs = [input_ids, positions, meta.slot_mapping, group.query_index, group.output_index, group.key_slots, group.mask]
            return self.compiled.run(inputs + self.caches)[0]
        return self.model(input_ids, positions, meta)
