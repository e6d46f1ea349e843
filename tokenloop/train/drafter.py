"""Training an EAGLE-1 head on a target's recorded features (train/drafter_dataset.py), with the target's embedding and
LM head shared and frozen.

EAGLE-1's loss: SmoothL1 between the head's output and the target's next feature, plus 0.1 x the cross-entropy of
the token after it over the draft vocabulary (the target's LM head rows `d2t`). AdamW with warm-up and cosine decay,
clipping; the head's one decoder layer runs over whole conversations packed with the block-causal mask. The
printed `top1` is the share of rows whose draft argmax is the target's token: the first position's acceptance,
greedy, when the head is fed the target's own features.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from tokenloop.models.eagle import EagleConfig, EagleHead
from tokenloop.models.loader import LoadedModel
from tokenloop.train.drafter_dataset import DrafterBatch, DrafterData
from tokenloop.train.packing import IGNORE_INDEX
from tokenloop.train.step import learning_rate

CE_WEIGHT = 0.1  # EAGLE-1's weight of the token loss beside the feature loss


@dataclass(slots=True)
class DrafterTrainConfig:
    epochs: int = 4
    lr: float = 1e-3
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1
    max_grad_norm: float = 0.5
    max_rows: int = 2048  # head rows a step
    own_feature_passes: int = 0  # HASS-style passes in which the head reads its own features (0: EAGLE-1)
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("epochs", "max_rows"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.own_feature_passes < 0:
            raise ValueError(f"own_feature_passes must be >= 0, got {self.own_feature_passes}")
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")


def head_losses(
    head: EagleHead, target: nn.Module, rows: torch.Tensor, batch: DrafterBatch, own_feature_passes: int = 0
) -> dict[str, torch.Tensor]:
    """The feature and token losses of one batch, and its top-1 agreement (a tensor each), summed over the first pass
    (the target's features) and `own_feature_passes` more, each reading the pass before's outputs as the features of
    the positions they predict (HASS: at drafting, every token after the first is drafted from the head's own
    feature); a conversation's first row keeps the target's. top1 is the first pass's."""
    with torch.no_grad():
        embeds = target.embed(batch.input_ids)
    positions = batch.meta.positions()
    first_rows = (positions == 0).unsqueeze(-1)
    scored = batch.target_draft != IGNORE_INDEX
    labels = batch.target_draft[scored]
    features, passes = batch.hidden, []
    for _ in range(1 + own_feature_passes):
        out = head(embeds, features, positions, batch.meta)  # (T, d)
        logits = F.linear(out[scored], rows)  # (N, Vd)
        feature = F.smooth_l1_loss(out, batch.target_hidden)
        token = F.cross_entropy(logits, labels) if len(labels) else out.sum() * 0
        passes.append((feature, token, logits))
        if len(passes) <= own_feature_passes:  # the next pass's row t reads this one's row t - 1
            features = torch.where(first_rows, batch.hidden, torch.cat([batch.hidden[:1], out[:-1].detach()]))
    feature, token, logits = passes[0]
    top1 = (logits.argmax(-1) == labels).float().mean() if len(labels) else token.detach()
    loss = sum(f + CE_WEIGHT * t for f, t, _ in passes)
    return {"loss": loss, "feature": feature.detach(), "token": token.detach(), "top1": top1.detach()}


def train_head(
    target: LoadedModel, data: DrafterData, config: DrafterTrainConfig, progress: bool = True
) -> tuple[EagleHead, list[dict]]:
    """A head for `target` (its float32 weights) trained on `data`; the per-step metrics."""
    torch.manual_seed(config.seed)
    head = EagleHead(EagleConfig.for_target(target.config, len(data.draft_vocab)), target.config)
    head.d2t.copy_(data.draft_vocab)
    head.rotary.reset_tables()
    model = target.model.requires_grad_(False)
    rows = model.lm_head.weight.detach()[data.draft_vocab].float()  # (Vd, d): the draft vocabulary's LM head rows
    params = [p for p in head.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=config.lr, betas=(0.9, 0.95), weight_decay=0.0, fused=True)
    epochs = [data.batches(config.max_rows, config.seed, e) for e in range(config.epochs)]
    total = sum(len(b) for b in epochs)
    warmup = min(config.warmup_steps, total)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: learning_rate(step, total, warmup, config.min_lr_ratio)
    )
    metrics: list[dict] = []
    head.train()
    bar = tqdm(total=total, disable=not progress, unit="step")
    for epoch, batches in enumerate(epochs):
        for conversations in batches:
            start = time.perf_counter()
            batch = data.batch(conversations)
            losses = head_losses(head, model, rows, batch, config.own_feature_passes)
            losses["loss"].backward()
            torch.nn.utils.clip_grad_norm_(params, config.max_grad_norm)
            optimizer.step()
            schedule.step()
            optimizer.zero_grad(set_to_none=True)
            line = {name: value.detach().item() for name, value in losses.items()}
            rate = batch.num_rows / (time.perf_counter() - start)
            line |= {"step": len(metrics) + 1, "epoch": epoch, "rows_per_s": rate}
            metrics.append(line)
            bar.update(1)
            bar.set_postfix(loss=f"{line['loss']:.3f}", top1=f"{line['top1']:.3f}")
    bar.close()
    head.eval()
    return head, metrics


def mean_top1(metrics: list[dict], last: int = 10) -> float:
    tail = metrics[-last:]
    return sum(m["top1"] for m in tail) / len(tail) if tail else math.nan
