"""tokenloop: a readable autoregressive LLM inference engine on PyTorch."""

from tokenloop.llm import LLM
from tokenloop.outputs import CompletionOutput, Logprob, RequestOutput
from tokenloop.sampling.params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob"]
