"""Test helpers: run a loaded model over a token sequence in chunks through the real KV cache path."""

from __future__ import annotations

import torch

from tokenloop.engine.block_manager import BlockManager
from tokenloop.engine.model_runner import ModelRunner
from tokenloop.engine.scheduler import ScheduledBatch
from tokenloop.engine.sequence import Sequence
from tokenloop.models.loader import LoadedModel
from tokenloop.sampling.params import SamplingParams


def forward_in_chunks(loaded: LoadedModel, token_ids: list[int], chunks: list[int], block_size: int = 4) -> torch.Tensor:
    """Logits [len(token_ids), vocab] computed `chunks[i]` tokens at a time against a KV cache of its own.

    The model's cache bindings are restored afterwards, so an engine sharing the model is left as it was.
    """
    assert sum(chunks) == len(token_ids)
    layers = loaded.model.attention_layers()
    saved = [(a.k_cache, a.v_cache) for a in layers]
    try:
        return _forward(loaded, token_ids, chunks, block_size)
    finally:
        for a, (k, v) in zip(layers, saved):
            a.k_cache, a.v_cache = k, v


def _forward(loaded: LoadedModel, token_ids: list[int], chunks: list[int], block_size: int) -> torch.Tensor:
    num_blocks = -(-len(token_ids) // block_size) + 1
    dtype = next(loaded.model.parameters()).dtype
    device = next(loaded.model.parameters()).device
    runner = ModelRunner(loaded.model, loaded.config, num_blocks, block_size, dtype, device)
    blocks = BlockManager(num_blocks, block_size, enable_prefix_caching=False)
    seq = Sequence("test", list(token_ids), len(token_ids), SamplingParams())
    logits = []
    with torch.inference_mode():
        for n in chunks:
            assert blocks.allocate(seq, seq.num_computed_tokens + n)
            inp = runner.prepare(ScheduledBatch([seq], [n]))
            logits.append(loaded.model.compute_logits(loaded.model(inp.input_ids, inp.positions, inp.meta)).float())
            seq.num_computed_tokens += n
    return torch.cat(logits)
