"""Training with the causal mask: `tokenloop train`, full or LoRA, on the serving model's own modules."""

from tokenloop.train.config import TrainConfig
from tokenloop.train.trainer import TrainResult, train

__all__ = ["TrainConfig", "TrainResult", "train"]
