"""tokenloop's own CPU kernels (C++), compiled on first use and cached under $TOKENLOOP_HOME/kernels.

- `quantized_matmul.cpp` computes x W^T for GGUF 4-, 5- and 8-bit weights the way llama.cpp does on a CPU:
  int8 activations and integer dot products. PyTorch ships no such kernel for AVX2 CPUs (its int4 kernel
  converts every weight to bfloat16 and is compute-bound on it), and this product is most of a step.
- `float_matmul.cpp` computes x W^T for float32 weights (the exact path), each output one fixed sum over K for any
  row count, a few rows in one pass over the weights (BLAS packs them first, and sums in an order that changes
  with the shape).
- `paged_attention.cpp` computes every query's attention (prompt chunks, decodes, drafts) straight from the paged
  KV cache (laid out for it: kv_cache.h), each query row in one fixed order whatever the call: bfloat16 products
  on a bfloat16 cache (CPUs with AVX512-BF16), float32 on a float16 or float32 one, integer on an int8 one.
- `rms_norm.cpp` normalises rows in one pass (eager PyTorch makes six).
- `top_candidates.cpp` is the sampler's softmax at each row's temperature: its normalisers in two passes that
  write nothing, then whole rows, or a row's k most likely tokens in a stable sort's order with their
  probabilities, for top-k and top-p sampling (torch.topk orders ties arbitrarily; dividing, normalising and
  selecting were each a pass over every row); and the greedy argmax, vectorised (torch's compares a value at a time).
- `rotary_cache.cpp` rotates queries and keys and writes keys and values into the cache in one pass (eager
  PyTorch makes about nine).

Every op has a fake implementation (its output's shape), so the compiled decode step calls these same kernels:
eager and compiled steps run one program and give the same floats. The step calls them through C functions
(`aoti_shims.h`), not the dispatcher.

The library is built with the C++ compiler inductor uses too, against the installed torch's headers, once
per source/torch version, each source by a compiler process of its own (about 30 s on 2 cores). Where it cannot
be built or run (no compiler, no AVX2, not x86), it warns once and the model runs PyTorch's own ops instead
(dequantized weights, SDPA): slower, never wrong.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import re
import shutil
import subprocess
import tempfile
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from tokenloop.models.store import tokenloop_home

logger = logging.getLogger(__name__)
SOURCES = sorted(Path(__file__).parent.glob("*.cpp"))
HEADERS = sorted(Path(__file__).parent.glob("*.h"))  # included by the sources: part of the build key
# -ffp-contract=off: a * b + c stays two roundings, as in PyTorch's eager ops (gcc would fuse it into one FMA),
# so that a kernel standing in for a chain of eager ops gives the same floats. FMAs are written out where wanted.
CXX_FLAGS = [
    "-O3",
    "-std=c++20",
    "-shared",
    "-fPIC",
    "-mavx2",
    "-mfma",
    "-mf16c",
    "-ffp-contract=off",
    "-fopenmp",
    "-w",
]
# The library is built on the machine that runs it, so it may use what this CPU has beyond AVX2: AVX512-VNNI's
# byte dot products, on 512-bit vectors (two groups of weight rows at once) and 256-bit ones (VL). Same results.
VNNI_FLAGS = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni"]
# And AVX512-BF16's bfloat16 dot products, for attention (paged_attention.cpp uses them only where built with them).
BF16_FLAGS = ["-mavx512bf16"]


def _cxx_flags() -> list[str]:
    # torch.cpu._is_vnni_supported checks avx512_vnni only; VL comes with every CPU that has it.
    if not (torch.cpu._is_vnni_supported() and torch.cpu._is_avx512_supported()):
        return CXX_FLAGS
    return CXX_FLAGS + VNNI_FLAGS + (BF16_FLAGS if torch.cpu._is_avx512_bf16_supported() else [])


@functools.cache
def cpu_kernels_available() -> bool:
    """Whether torch.ops.tokenloop's kernels are registered (building the library if needed)."""
    why = _unsupported_reason()
    if why is None:
        try:
            library = str(_built_library())
            torch.ops.load_library(library)
            # Its symbols global too (torch loads it RTLD_LOCAL): the compiled decode step calls the C shims.
            ctypes.CDLL(library, mode=os.RTLD_GLOBAL | os.RTLD_NOLOAD)
            _register_fake_kernels()
            _register_autograd()
            return True
        except (OSError, RuntimeError, subprocess.CalledProcessError) as e:
            why = f"building or loading it failed: {getattr(e, 'stderr', None) or e}"
    warnings.warn(
        f"tokenloop's CPU kernels are not used ({why}); "
        "quantized weights are dequantized for every product, which is slower",
        stacklevel=2,
    )
    return False


def aoti_c_shims() -> dict[torch._ops.OpOverload, list[str]]:
    """The ops' C functions for AOTInductor (its aot_inductor.custom_ops_to_c_shims): aoti_shims.h declares one a
    line, aoti_torch_cpu_<op>, and the package then calls them without the dispatcher."""
    shims = {}
    for line in (Path(__file__).parent / "aoti_shims.h").read_text().splitlines():
        match = re.match(r"AOTITorchError aoti_torch_cpu_(\w+)\(.*\);$", line)
        if match:
            shims[getattr(torch.ops.tokenloop, match[1]).default] = [line.removesuffix(";")]
    return shims


def bfloat16_cache_supported() -> bool:
    """Whether the attention kernel reads a bfloat16 KV cache here: built with AVX512-BF16's dot products."""
    return cpu_kernels_available() and "-mavx512bf16" in _cxx_flags()


def attention_kernel_supports(kv_dtype: torch.dtype, head_dim: int) -> bool:
    """Whether paged_attention runs on a CPU cache of this dtype and head size (elsewhere, SDPA does)."""
    if kv_dtype == torch.bfloat16:
        return head_dim % 16 == 0 and bfloat16_cache_supported()
    if kv_dtype == torch.int8:  # int16 products whose sums stay within int32
        return head_dim % 16 == 0 and head_dim <= 256 and cpu_kernels_available()
    return kv_dtype in (torch.float16, torch.float32) and head_dim % 8 == 0 and cpu_kernels_available()


def _unsupported_reason() -> str | None:
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"it is written for x86-64 CPUs, this is {platform.machine()}"
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return "this CPU has no AVX2"
    if _compiler() is None:
        return "no C++ compiler found (set CXX or install g++)"
    return None


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CXX", "g++")) or shutil.which("c++")


def _built_library() -> Path:
    """The compiled library for this source and this torch, built into the cache if it is not there yet."""
    sources = b"".join(path.read_bytes() for path in [*SOURCES, *HEADERS])
    flags = _cxx_flags()
    key = hashlib.sha256(sources + torch.__version__.encode() + " ".join(flags).encode()).hexdigest()[:16]
    target = tokenloop_home() / "kernels" / f"tokenloop_kernels-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    logger.info("building tokenloop's C++ kernels (once per torch version; about 30 s on 2 cores)")
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        build_library(flags, built)
        os.replace(built, target)  # atomic: a concurrent build or a reader never sees half a file
    return target


def build_library(flags: list[str], library: Path) -> None:
    """Compile SOURCES with `flags` into the shared library `library`: each source by a compiler of its own, as many
    at once as there are cores (one compiler for every source used one core), then one link."""
    from torch.utils import cpp_extension

    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
    includes = [f"-I{p}" for p in cpp_extension.include_paths()]
    libraries = [f for p in cpp_extension.library_paths() for f in (f"-L{p}", f"-Wl,-rpath,{p}")]
    objects = [library.with_name(f"{library.stem}-{source.stem}.o") for source in SOURCES]
    compile_flags = [f for f in flags if f != "-shared"]

    def compile_one(source: Path, obj: Path) -> None:
        command = [_compiler(), *compile_flags, abi, *includes, "-c", str(source), "-o", str(obj)]
        subprocess.run(command, check=True, capture_output=True, text=True)

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        for done in [pool.submit(compile_one, source, obj) for source, obj in zip(SOURCES, objects)]:
            done.result()
    link = [_compiler(), *flags, *map(str, objects), "-o", str(library), *libraries, "-lc10", "-ltorch_cpu"]
    subprocess.run(link, check=True, capture_output=True, text=True)
    for obj in objects:
        obj.unlink()


def _register_fake_kernels() -> None:
    """Output shapes for torch.compile, which traces the ops without running them."""

    # Weight rows come in interleaved groups of 8 (weight.shape[0] groups); a gated product takes [gate | up].
    @torch.library.register_fake("tokenloop::q4_matmul")
    def _(x, weight, scale, offset, scale_per_256=None, offset_per_256=None):
        return x.new_empty(x.shape[0], weight.shape[0] * 8)

    @torch.library.register_fake("tokenloop::q8_matmul")
    def _(x, weight, scale, scale_per_256=None):
        return x.new_empty(x.shape[0], weight.shape[0] * 8)

    @torch.library.register_fake("tokenloop::q5_matmul")
    def _(x, weight, scale):
        return x.new_empty(x.shape[0], weight.shape[0] * 8)

    @torch.library.register_fake("tokenloop::q4_gated_matmul")
    def _(gate_up, weight, scale, offset, activation, scale_per_256=None, offset_per_256=None):
        return gate_up.new_empty(gate_up.shape[0], weight.shape[0] * 8)

    @torch.library.register_fake("tokenloop::q8_gated_matmul")
    def _(gate_up, weight, scale, activation, scale_per_256=None):
        return gate_up.new_empty(gate_up.shape[0], weight.shape[0] * 8)

    @torch.library.register_fake("tokenloop::q5_gated_matmul")
    def _(gate_up, weight, scale, activation):
        return gate_up.new_empty(gate_up.shape[0], weight.shape[0] * 8)

    @torch.library.register_fake("tokenloop::f32_matmul")
    def _(x, weight):
        return x.new_empty(x.shape[0], weight.shape[0])

    @torch.library.register_fake("tokenloop::rms_norm")
    def _(x, weight, eps):
        return torch.empty_like(x)

    # Writes q and k in place (rotated) and k and v into the caches: the schema marks them mutated.
    @torch.library.register_fake("tokenloop::rotary_cache_write")
    def _(qkv, cos, sin, k_cache, v_cache, slot_mapping, block_size, q_heads, q_norm=None, k_norm=None, eps=0.0):
        return None

    @torch.library.register_fake("tokenloop::paged_attention")
    def _(q, k_cache, v_cache, block_tables, block_size, query_start, query_count, first_position, window, scale):
        return q.new_empty(q.shape[0], q.shape[1] * q.shape[2])


def _register_autograd() -> None:
    """Gradients of the float32 kernels a training forward runs (the dense product and RMSNorm), so training runs the
    serving model's own forward. Backward is plain PyTorch: it need not match any other path's floats."""

    def matmul_setup(ctx, inputs, output) -> None:
        ctx.save_for_backward(*inputs)

    def matmul_backward(ctx, grad):  # y = x W^T
        x, weight = ctx.saved_tensors
        return grad @ weight if ctx.needs_input_grad[0] else None, grad.t() @ x if ctx.needs_input_grad[1] else None

    torch.library.register_autograd("tokenloop::f32_matmul", matmul_backward, setup_context=matmul_setup)

    def norm_setup(ctx, inputs, output) -> None:
        x, weight, ctx.eps = inputs
        ctx.save_for_backward(x, weight)

    def norm_backward(ctx, grad):  # y = w * x / rms(x): recomputed in PyTorch, differentiated there
        x, weight = ctx.saved_tensors
        with torch.enable_grad():
            x_, w_ = x.detach().requires_grad_(), weight.detach().requires_grad_()
            y = w_ * torch.nn.functional.rms_norm(x_, w_.shape, eps=ctx.eps)
            grad_x, grad_w = torch.autograd.grad(y, (x_, w_), grad)
        return grad_x, grad_w, None

    torch.library.register_autograd("tokenloop::rms_norm", norm_backward, setup_context=norm_setup)
