"""The proposer an engine's speculative_config names, wrapped in the Speculator the engine talks to."""

from __future__ import annotations

from tokenloop.engine.config import EngineConfig, compile_spec
from tokenloop.spec_decode.draft_model import DraftModelProposer
from tokenloop.spec_decode.ngram import NgramProposer
from tokenloop.spec_decode.proposer import Proposer
from tokenloop.spec_decode.speculator import Speculator


def build_speculator(
    config: EngineConfig, vocab_size: int, max_model_len: int, stop_token_ids: set[int], num_blocks: int
) -> Speculator:
    spec = config.speculative_config
    proposer: Proposer
    if spec.method == "ngram":
        proposer = NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
    else:  # the draft model's own config: its dtype, the target's device, cache blocks and compile setting
        draft = EngineConfig(
            model=spec.model or config.model,
            dtype=spec.dtype,
            device=config.device,
            block_size=config.block_size,
            compile=config.compile,
            compile_in_background=config.compile_in_background,
        )
        proposer = DraftModelProposer.load(
            draft.model,
            draft.torch_dtype,
            draft.kv_cache_dtype,
            draft.dtype == "auto",
            draft.torch_device,
            vocab_size,
            num_blocks,
            config.block_size,
            draft.compile,
            (lambda path: compile_spec(draft, path)) if draft.compile and draft.compile_in_background else None,
        )
    return Speculator(spec, proposer, max_model_len, stop_token_ids)
