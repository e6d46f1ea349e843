"""The background compile of the decode step: `python -m tokenloop.engine.compile_worker SPEC_JSON TARGET`.

A child of an engine that found no package for its model (engine/compiled_decode.py): it loads the same model,
builds the package into the path the parent expects (under the build lock, so that of two processes that
start together one builds and the other finds it built), and exits. Its log says which.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from tokenloop.engine.compiled_decode import CompileSpec, build_package, package_path
from tokenloop.engine.config import DTYPES
from tokenloop.engine.model_runner import ModelRunner
from tokenloop.models.loader import load_model


def main(argv: list[str]) -> int:
    spec, target = CompileSpec(**json.loads(argv[0])), argv[1]  # target: the package path the parent expects
    device = torch.device(spec.device)
    loaded = load_model(
        spec.model, DTYPES[spec.dtype], device, load_tokenizer=False, keep_quantized=spec.keep_quantized
    )
    # A runner of 4 blocks binds the caches as the engine's does (the slot count is dynamic in the package).
    kv_dtype = getattr(torch, spec.kv_dtype)
    caches = ModelRunner(loaded.model, loaded.config, 4, spec.block_size, kv_dtype, device).forward.caches
    computed = package_path(loaded.model, caches, spec.block_size)
    if str(computed) != target:  # the parent would never load what this process builds
        print(f"package key mismatch: the parent expects {target}, this process computes {computed}", flush=True)
        return 1
    start = time.perf_counter()
    built = build_package(loaded.model, caches, spec.block_size, Path(target))
    print(
        f"{'built' if built else 'found (built by another process)'} {target} in {time.perf_counter() - start:.0f} s",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
