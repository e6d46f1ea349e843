"""EAGLE drafters for tests: random heads, seeded, saved as a drafter folder for a target (exactness does not
depend on their quality)."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from tests.helpers import model_config
from tokenloop.models.eagle import EagleConfig, EagleHead, save_drafter


def write_random_drafter(
    folder: Path, target: str | os.PathLike, draft_vocab_size: int, seed: int = 0, echo: bool = False, **changes
) -> Path:
    """A head for `target` with random weights and a seeded random draft vocabulary of `draft_vocab_size` ids
    (sorted); `changes` override its EagleConfig fields (a misfit drafter). `echo`: the head's output is its input
    feature (fc passes the feature through; attention and MLP add nothing), so it drafts the target's own choice for
    the last token again, k times: greedy drafts are accepted wherever the target repeats a token (in the draft
    vocabulary), rejected elsewhere."""
    target_config = model_config(target)
    generator = torch.Generator().manual_seed(seed)
    config = EagleConfig.for_target(target_config, draft_vocab_size)
    head = EagleHead(config, target_config)
    with torch.no_grad():
        for param in head.parameters():
            if param.dim() > 1:
                param.copy_(torch.randn(param.shape, generator=generator) * param.shape[1] ** -0.5)
        if echo:
            d = config.hidden_size
            head.fc.weight.zero_()[:, d:].copy_(torch.eye(d))
            head.fc.bias.zero_()
            head.layer.self_attn.o_proj.weight.zero_()
            head.layer.mlp.down_proj.weight.zero_()
        head.d2t.copy_(torch.randperm(target_config.vocab_size, generator=generator)[:draft_vocab_size].sort().values)
    if changes:  # written as it is, unchecked: what a drafter for another target would hold
        for name, value in changes.items():
            setattr(config, name, value)
    return save_drafter(head, folder)
