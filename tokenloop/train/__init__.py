"""Fine-tuning: `tokenloop train`'s data, LoRA training loop and export."""
