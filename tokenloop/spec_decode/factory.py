"""The proposer an engine's speculative_config names, wrapped in the Speculator the engine talks to."""

from __future__ import annotations

from tokenloop.engine.config import EngineConfig, compile_spec
from tokenloop.engine.model_runner import ModelRunner
from tokenloop.models.eagle import shipped_drafter
from tokenloop.spec_decode.draft_model import DraftModelProposer
from tokenloop.spec_decode.eagle import EagleProposer
from tokenloop.spec_decode.ngram import NgramProposer
from tokenloop.spec_decode.proposer import Proposer
from tokenloop.spec_decode.speculator import Speculator


def build_speculator(
    config: EngineConfig,
    target: ModelRunner,
    max_model_len: int,
    stop_token_ids: set[int],
    num_blocks: int,
) -> Speculator:
    """`target`: the engine's runner (its model's vocabulary; an EAGLE head shares its embedding and LM head)."""
    spec = config.speculative_config
    vocab_size = target.config.vocab_size
    proposer: Proposer
    if spec.method == "ngram":
        proposer = NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
    elif spec.method == "eagle":  # the target's dtype and KV dtype, its device and block size
        proposer = EagleProposer.load(
            spec.model or shipped_drafter(config.model),
            target.model,
            target.config,
            config.torch_dtype,
            config.kv_dtype,
            config.torch_device,
            num_blocks,
            config.block_size,
        )
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
            draft.kv_dtype,
            draft.dtype == "auto",
            draft.torch_device,
            vocab_size,
            num_blocks,
            config.block_size,
            draft.compile,
            (lambda path: compile_spec(draft, path)) if draft.compile and draft.compile_in_background else None,
        )
    return Speculator(spec, proposer, max_model_len, stop_token_ids)
