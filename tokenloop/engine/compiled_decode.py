"""The decode step compiled ahead of time: a batch of one new token per sequence runs the whole model forward
as one C++ call.

A decode step of a small model is a few hundred tiny ops; eager PyTorch pays several microseconds of dispatch
for each, as much as the matmuls cost. AOTInductor (torch.export, then inductor's C++ code generation)
fuses them into a handful of C++ kernels around the matmul calls and compiles the lot, Python wrapper
included, into one shared library. Batch size and context length are dynamic, so one package serves every
decode step. Prefill and mixed batches stay eager: their time goes to large matmuls, not dispatch.

The package holds code only: the weights stay the model's own tensors, handed over at load (no second
copy), and the KV caches are inputs, written in place. It is cached under $TOKENLOOP_HOME/compiled, keyed
by everything the code depends on (model structure, dtypes, device, torch and tokenloop sources; not the
thread count: the code asks OpenMP for it when it runs). Later starts only load a library: they never import
torch's compiler (dynamo and inductor weigh over 100 MB of resident memory). A first start does not wait for
the compiler (about two minutes for SmolLM2-135M on two cores): it runs eager at once while a child process
at low priority builds the package (engine/compile_worker.py), and switches to it between two steps when it
is ready; the child goes on if the parent exits, so the next start finds the package. A file lock makes two
processes that start together build one package. Where compiling is not possible (no C++ compiler, an
unsupported op) it says so once and runs eager: the same model, the same tokens.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import json
import logging
import os
import resource
import subprocess
import sys
import tempfile
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from tokenloop import kernels
from tokenloop.models.attention import AttentionMetadata
from tokenloop.models.store import tokenloop_home

logger = logging.getLogger(__name__)
BUILD_MINUTES_HINT = "about 2 minutes for a 135M model on 2 cores"

PACKAGE_SOURCES = [
    *Path(__file__).parent.parent.glob("models/*.py"),
    *Path(__file__).parent.parent.glob("kernels/*.cpp"),
    *Path(__file__).parent.parent.glob("kernels/*.h"),
    Path(__file__),
]


class DecodeStep(nn.Module):
    """model.forward with the attention metadata as tensors and the KV caches as inputs: what torch.export
    traces. The caches are bound to the attention layers only while tracing (in the package they are inputs)."""

    def __init__(self, model: nn.Module, block_size: int) -> None:
        super().__init__()
        self.model, self.block_size = model, block_size

    def forward(
        self,
        input_ids,
        positions,
        slot_mapping,
        block_tables,
        query_start,
        query_count,
        first_position,
        k_caches,
        v_caches,
    ):
        layers = self.model.attention_layers()
        bound = [(attn.k_cache, attn.v_cache) for attn in layers]
        try:
            for attn in layers:
                attn.k_cache, attn.v_cache = k_caches[attn.kv_pool], v_caches[attn.kv_pool]
            meta = AttentionMetadata(
                slot_mapping, block_tables, query_start, query_count, first_position, self.block_size
            )
            return self.model(input_ids, positions, meta)
        finally:
            for attn, (k, v) in zip(layers, bound):
                attn.k_cache, attn.v_cache = k, v


def num_kv_groups(model: nn.Module) -> int:
    """The KV cache groups the model's attention layers are bound to (engine/kv_groups.py)."""
    return 1 + max(attn.kv_group for attn in model.attention_layers())


def example_inputs(input_ids: torch.Tensor, caches: list[torch.Tensor], num_groups: int) -> tuple:
    """A decode batch of 2 sequences with 3 tokens of context each, the first verifying a one-token draft (3 query
    tokens in all: the token and sequence counts are distinct dimensions), block tables of 2 blocks per group."""
    device = caches[0].device
    num_pools = len(caches) // 2
    tensor = functools.partial(torch.tensor, dtype=torch.int64, device=device)
    return (
        input_ids.new_zeros(3),
        tensor([1, 2, 2]),
        tensor([[1, 2, 34]] * num_groups),
        tensor([[[0, 1], [2, 3]]] * num_groups),
        tensor([0, 2]),
        tensor([2, 1]),
        tensor([1, 2]),
        caches[:num_pools],
        caches[num_pools:],
    )


def named_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer by every name it has: a tied head's names too, and non-persistent buffers
    (the rotary tables), which state_dict leaves out. The package refers to its constants by these names."""
    return dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers(remove_duplicate=False))


def package_key(model: nn.Module, caches: list[torch.Tensor], block_size: int) -> str:
    """What the compiled code depends on: the model's structure and config, every tensor's dtype and shape,
    which kernels it calls, the caches' dtype and device and block size, and the sources of torch and of
    tokenloop's model code."""
    parts = [
        str(model),
        repr(getattr(model, "config", None)),
        torch.__version__,
        f"block_size={block_size}",
    ]
    parts += [f"{name}:{t.dtype}:{tuple(t.shape)}:{t.device.type}" for name, t in named_tensors(model).items()]
    parts += [f"{name}:{getattr(m, 'cpu_kernel', None)}" for name, m in model.named_modules()]
    kv_heads, _, width = caches[0].shape  # [kv_heads, slots, width]: the slot count is dynamic
    parts += [f"{caches[0].dtype}:{caches[0].device.type}:{kv_heads}:{width}"]
    digest = hashlib.sha256("\n".join(parts).encode())
    for path in sorted(PACKAGE_SOURCES):
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def package_path(model: nn.Module, caches: list[torch.Tensor], block_size: int) -> Path:
    return tokenloop_home() / "compiled" / f"decode-{package_key(model, caches, block_size)}.pt2"


def build_package(model: nn.Module, caches: list[torch.Tensor], block_size: int, target: Path) -> bool:
    """torch.export the decode step (batch size, context length and cache size dynamic), then AOTInductor.
    Under a lock on the target: a process that finds it built meanwhile builds nothing (returns False)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.exists():
            return False
        _build(model, caches, block_size, target)
        return True


def _build(model: nn.Module, caches: list[torch.Tensor], block_size: int, target: Path) -> None:
    from torch._inductor import aoti_compile_and_package
    from torch.export import Dim

    use_tokenloop_cache_dir()
    tokens, seqs, blocks, slots = (
        Dim("tokens", min=1, max=2**16),
        Dim("seqs", min=1, max=2**16),
        Dim("blocks", min=1, max=2**20),
        Dim("slots", min=6, max=2**31),
    )
    num_pools = len(caches) // 2
    dynamic_shapes = (
        {0: tokens},
        {0: tokens},
        {1: tokens},
        {1: seqs, 2: blocks},
        {0: seqs},
        {0: seqs},
        {0: seqs},
        [{1: slots}] * num_pools,
        [{1: slots}] * num_pools,
    )
    inputs = example_inputs(torch.zeros(1, dtype=torch.int64), caches, num_kv_groups(model))
    with torch.no_grad():
        program = torch.export.export(
            DecodeStep(model, block_size), inputs, dynamic_shapes=dynamic_shapes, strict=False
        )
    configs = {
        "aot_inductor.package_constants_in_so": False,  # at load the package is given the model's own tensors
        # The package's own loops run on one thread, with no OpenMP region: they are a step's few small
        # elementwise ones (residual adds, a row's gather), where starting and joining a region costs more than
        # the loop, and there are two of them per layer. The products and attention split across the cores in
        # tokenloop's kernels. A package so built serves any thread count.
        "cpp.threads": 1,
    }
    if kernels.cpu_kernels_available():
        configs["aot_inductor.custom_ops_to_c_shims"] = kernels.aoti_c_shims()
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = os.path.join(tmp, target.name)
        aoti_compile_and_package(program, package_path=built, inductor_configs=configs)
        os.replace(built, target)  # atomic: a concurrent start never loads half a file


@dataclass(slots=True)
class CompileSpec:
    """How a child process loads the same model to compile its decode step (engine/compile_worker.py)."""

    model: str  # the model's file or folder
    dtype: str  # activation dtype name, e.g. "float32"
    device: str
    keep_quantized: bool
    kv_dtype: str  # the KV caches' dtype name
    block_size: int  # the KV cache's, which the package's attention calls take as a constant


def use_tokenloop_cache_dir() -> None:
    """Inductor's caches under $TOKENLOOP_HOME/inductor (kept across reboots, unlike its /tmp default), unless
    TORCHINDUCTOR_CACHE_DIR says otherwise. Inductor writes its default into the variable once it has
    looked it up, so that value counts as unset."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    current = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if current is None or os.path.abspath(current) == os.path.abspath(default_cache_dir()):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(tokenloop_home() / "inductor")


class DecodeForward:
    """model.forward for the model runner: the compiled package for decode-only batches, eager for the rest.

    `background`: build a missing package in a child process and switch to it when it is ready (else build
    it here, before the first step)."""

    def __init__(
        self,
        model: nn.Module,
        k_caches: list[torch.Tensor],
        v_caches: list[torch.Tensor],
        block_size: int,
        compile: bool,
        background: CompileSpec | None = None,
    ) -> None:
        self.model, self.block_size = model, block_size
        self.caches = [*k_caches, *v_caches]
        self.compiled = None
        self.built = False  # whether this process compiled the package (else it came from the cache or a child)
        self.worker: subprocess.Popen | None = None  # the background build, until its package is loaded
        if not compile:
            return
        self.path = package_path(model, self.caches, block_size)
        try:
            if not self.path.exists() and background is not None:
                self.worker = _start_worker(background, self.path)
                return
            if not self.path.exists():
                logger.info("compiling the decode step (%s; cached after)", BUILD_MINUTES_HINT)
                self.built = build_package(model, self.caches, block_size, self.path)
            self.compiled = self._load()
        except Exception as e:  # noqa: BLE001 — export or C++ compilation failed: any error means "eager"
            warnings.warn(f"compiling the decode step failed, running it eager: {type(e).__name__}: {e}", stacklevel=2)

    def _load(self):
        device = self.caches[0].device
        loader = torch._C._aoti.AOTIModelPackageLoader(
            str(self.path), "model", False, 1, -1 if device.index is None else device.index
        )
        tensors = {f"model.{name}": t.data for name, t in named_tensors(self.model).items()}
        # user_managed: the package reads these tensors where they are, without copying them.
        loader.load_constants({name: tensors[name] for name in loader.get_constant_fqns()}, False, True, True)
        return loader

    def poll(self) -> None:
        """Between steps: switch to the package once the background build has ended with one."""
        if self.worker is None or self.worker.poll() is None:
            return
        worker, self.worker = self.worker, None
        if worker.returncode != 0 or not self.path.exists():
            log = self.path.with_suffix(".log")
            warnings.warn(
                f"the background compile of the decode step failed (exit status {worker.returncode}, see {log}): "
                "running eager",
                stacklevel=2,
            )
            return
        self.compiled = self._load()
        logger.info("decode steps now run the compiled package")

    def __call__(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, decode_only: bool
    ) -> torch.Tensor:
        if decode_only and self.worker is not None:
            self.poll()
        if self.compiled is not None and decode_only:
            inputs = [
                input_ids,
                positions,
                meta.slot_mapping,
                meta.block_tables,
                meta.query_start,
                meta.query_count,
                meta.first_position,
            ]
            return self.compiled.run(inputs + self.caches)[0]
        return self.model(input_ids, positions, meta)


# The background build's address space, and that of each compiler it runs: SmolLM2's build peaked at 1.2 GiB
# (728 MiB resident), its C++ compile at 540 MiB. A build that needs more than this fails, and the engine says so
# and stays eager, rather than let a background job take the machine's memory.
WORKER_ADDRESS_SPACE_BYTES = 4 << 30


def _lower_priority_and_bound_memory() -> None:
    os.nice(19)
    resource.setrlimit(resource.RLIMIT_AS, (WORKER_ADDRESS_SPACE_BYTES, WORKER_ADDRESS_SPACE_BYTES))


def _start_worker(spec: CompileSpec, target: Path) -> subprocess.Popen:
    """The background build: a child at the lowest CPU priority, on one thread, its memory bounded, in a session
    of its own (it outlives a one-shot command, so that the next start finds the package)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    log = target.with_suffix(".log")
    env = os.environ | {"OMP_NUM_THREADS": "1", "TORCHINDUCTOR_COMPILE_THREADS": "1"}
    with open(log, "ab") as out:
        worker = subprocess.Popen(
            [sys.executable, "-m", "tokenloop.engine.compile_worker", json.dumps(asdict(spec)), str(target)],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=out,
            env=env,
            start_new_session=True,
            preexec_fn=_lower_priority_and_bound_memory,
        )
    logger.info(
        "compiling the decode step in the background (%s); running eager until it is ready. Log: %s",
        BUILD_MINUTES_HINT,
        log,
    )
    return worker
