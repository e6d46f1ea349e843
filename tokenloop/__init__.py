"""tokenloop: a readable autoregressive LLM inference engine on PyTorch."""

import os

# OpenMP threads that finish a parallel region spin for the next one, by default for about 300,000 iterations:
# between a step's kernels they keep the cores from the engine's and the server's own Python, and from other
# processes. 10,000 spins cover the gap between two kernels of a step and no more (a fifth more output tokens/s
# under `tokenloop bench serve` at 32 concurrent). Set before torch loads its OpenMP runtime (it reads the
# variable once); the caller's own setting wins.
os.environ.setdefault("GOMP_SPINCOUNT", "10000")

from tokenloop.engine.beam_search import BeamSearchParams  # noqa: E402
from tokenloop.engine.lora import LoRARequest  # noqa: E402
from tokenloop.llm import LLM  # noqa: E402
from tokenloop.outputs import CompletionOutput, Logprob, RequestOutput  # noqa: E402
from tokenloop.sampling.params import SamplingParams  # noqa: E402

__all__ = [
    "LLM",
    "SamplingParams",
    "BeamSearchParams",
    "LoRARequest",
    "RequestOutput",
    "CompletionOutput",
    "Logprob",
]
