"""EagleHead: an EAGLE-1 draft head over a target model's features, and its folder on disk.

Layout (EAGLE-1, Li et al. 2024, `model/cnets.py`): the head's row i reads the embedding of token i + 1 and the
target's feature at position i, its final hidden state after the final norm (the LM head's input, as transformers'
`last_hidden_state`, which EAGLE-1 takes): x = fc([embed, feature]), then one decoder layer of the target's own
type without its input norm (EAGLE-1's first layer has none: fc's output goes in as it is), and no final norm.
The output approximates the target's feature at position i + 1: the target's LM head, restricted to the rows of
the draft vocabulary (`d2t`: draft index -> target token id), turns it into the logits of token i + 2. Rows sit at
positions 0, 1, ... of the head's own KV cache (RoPE is relative: the shift by one changes nothing).

The target's embedding and LM head are shared and frozen: never parameters of the head, never in its file. A
drafter on disk is a folder: `config.json` (EagleConfig) and `model.safetensors` (fc, layer, d2t; tokenloop's
parameter names, qkv and gate/up packed as the serving model packs them).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from tokenloop.models.attention import AttentionMetadata, KVCacheAttention
from tokenloop.models.config import ModelConfig
from tokenloop.models.layers import Linear, RotaryEmbedding
from tokenloop.models.quant import Int8Embedding, low_precision_linear
from tokenloop.models.registry import model_class

CONFIG_FILE, WEIGHTS_FILE, PROVENANCE_FILE = "config.json", "model.safetensors", "provenance.json"
# Drafters that ship with tokenloop, one folder per known model (its name): config.json, model.safetensors and
# provenance.json (the command that trained it, the commit, the weights' sha256 and the training figures).
SHIPPED_DRAFTERS = Path(__file__).resolve().parent.parent / "drafters"


@dataclass(slots=True)
class EagleConfig:
    target_architecture: str  # the target's model class (its decoder layer is the head's)
    hidden_size: int  # the target's: features and embeddings are its width
    target_vocab_size: int  # d2t's values index this vocabulary
    draft_vocab_size: int  # rows of d2t
    intermediate_size: int  # the head's one layer
    num_heads: int
    num_kv_heads: int
    head_dim: int

    def __post_init__(self) -> None:
        if not 1 <= self.draft_vocab_size <= self.target_vocab_size:
            raise ValueError(
                f"eagle drafter: draft_vocab_size must be in [1, target_vocab_size={self.target_vocab_size}], "
                f"got {self.draft_vocab_size}"
            )

    @classmethod
    def for_target(cls, target: ModelConfig, draft_vocab_size: int) -> EagleConfig:
        """A head whose layer has the target's layer sizes."""
        return cls(
            target.architecture,
            target.hidden_size,
            target.vocab_size,
            draft_vocab_size,
            target.intermediate_size,
            target.num_heads,
            target.num_kv_heads,
            target.head_dim,
        )

    def check_fits(self, target: ModelConfig, where: str) -> None:
        """Refuse a head built for another target: both sizes named."""
        for name, ours, theirs in (
            ("hidden size", self.hidden_size, target.hidden_size),
            ("vocabulary", self.target_vocab_size, target.vocab_size),
        ):
            if ours != theirs:
                raise ValueError(
                    f"eagle drafter {where} was built for a target {name} of {ours}, the target's is {theirs}"
                )

    def layer_config(self, target: ModelConfig) -> ModelConfig:
        """The target's config for one full-attention layer of the head's sizes (RoPE: the target's global one)."""
        return dataclasses.replace(
            target,
            num_layers=1,
            intermediate_size=self.intermediate_size,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            sliding_window=None,
            layer_types=None,
        )


class EagleHead(nn.Module):
    def __init__(self, config: EagleConfig, target: ModelConfig) -> None:
        super().__init__()
        config.check_fits(target, "config")
        self.config = config
        layer_config = config.layer_config(target)
        d = config.hidden_size
        self.fc = Linear(2 * d, d, bias=True)
        self.layer = model_class(target.architecture).decoder_layer(layer_config)
        self.layer.input_layernorm = nn.Identity()  # EAGLE-1: fc's output enters attention unnormalised
        theta, scaling = layer_config.layer_rope(0)
        self.rotary = RotaryEmbedding(layer_config.head_dim, layer_config.max_position_embeddings, theta, scaling)
        self.register_buffer("d2t", torch.arange(config.draft_vocab_size, dtype=torch.int64))  # [Vd] target ids

    def forward(
        self, embeds: torch.Tensor, features: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """(T, d) embeddings of tokens i + 1 and (T, d) features of positions i → (T, d) features of i + 1."""
        x = self.fc(torch.cat([embeds, features], dim=-1))  # (T, 2d) -> (T, d)
        return self.layer(self.rotary.tables(positions), x, meta)

    def attention_layers(self) -> list[KVCacheAttention]:
        return [self.layer.self_attn.attn]


class DraftVocabHead:
    """The target's LM head on the draft vocabulary's rows only: logits [N, Vd] (draft index order), reading only
    those rows (an int8 head's as int8, through the same kernel)."""

    def __init__(self, target: nn.Module, d2t: torch.Tensor) -> None:
        lm_head = target.lm_head
        if isinstance(lm_head, Int8Embedding):
            self.product = lm_head.select_rows(d2t)
        else:
            self.product = functools.partial(low_precision_linear, weight=lm_head.weight.detach()[d2t])  # [Vd, d]

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.product(hidden)


def save_drafter(head: EagleHead, folder: str | os.PathLike) -> Path:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / CONFIG_FILE).write_text(json.dumps(asdict(head.config), indent=2))
    state = {name: t.detach().contiguous().cpu() for name, t in head.state_dict().items()}
    save_file(state, str(folder / WEIGHTS_FILE))
    return folder


def shipped_drafter(target: str | None) -> Path:
    """The drafter tokenloop ships for the target model `target` (a known model's name or its file; None: the
    default)."""
    from tokenloop.models.store import DEFAULT_MODEL, KNOWN_MODELS

    name = str(target or DEFAULT_MODEL)
    name = {m.filename: m.name for m in KNOWN_MODELS.values()}.get(Path(name).name, name)  # its pulled file too
    folder = SHIPPED_DRAFTERS / name
    if name not in KNOWN_MODELS or not (folder / CONFIG_FILE).is_file():
        shipped = ", ".join(sorted(p.name for p in SHIPPED_DRAFTERS.iterdir() if (p / CONFIG_FILE).is_file()))
        raise ValueError(
            f"speculative_config.model is required for method 'eagle' with target {target!r}: tokenloop ships "
            f"drafters for {shipped} only (train one with `tokenloop train-drafter --model ... --output DIR`)"
        )
    return folder


def read_config(folder: str | os.PathLike) -> EagleConfig:
    path = Path(folder) / CONFIG_FILE
    if not path.is_file():
        raise ValueError(f"eagle drafter {os.fspath(folder)!r} has no {CONFIG_FILE}")
    try:
        return EagleConfig(**json.loads(path.read_text()))
    except (TypeError, json.JSONDecodeError) as e:
        raise ValueError(
            f"eagle drafter {os.fspath(folder)!r}: {CONFIG_FILE} is not a drafter's config ({e})"
        ) from None


def load_drafter(
    folder: str | os.PathLike,
    target: ModelConfig,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> EagleHead:
    """The head in `folder`, for `target`; ValueError if it was built for another hidden size or vocabulary."""
    config = read_config(folder)
    config.check_fits(target, repr(os.fspath(folder)))
    head = EagleHead(config, target)
    state = load_file(str(Path(folder) / WEIGHTS_FILE))
    head.load_state_dict(state, strict=True)
    if int(head.d2t.min()) < 0 or int(head.d2t.max()) >= target.vocab_size:
        raise ValueError(f"eagle drafter {os.fspath(folder)!r}: d2t holds ids outside [0, {target.vocab_size})")
    head.to(device=device, dtype=dtype).eval()
    head.rotary.reset_tables()  # float32 tables, as the target's
    return head
