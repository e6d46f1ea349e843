"""What a finished run leaves in its folder: a full fine-tune as a Hugging Face folder, LoRA as a PEFT adapter (and
with --merge the merged folder), and with --export-gguf a GGUF in the base file's own types."""

from __future__ import annotations

from pathlib import Path

from tokenloop.models.loader import LoadedModel
from tokenloop.train.config import TrainConfig
from tokenloop.train.export import merge_lora, save_hf_folder, save_peft_adapter
from tokenloop.train.gguf_export import export_gguf
from tokenloop.train.lora import lora_state


def write_outputs(config: TrainConfig, loaded: LoadedModel, output: Path) -> None:
    if config.max_steps == 0:  # evaluation only
        return
    model = loaded.model
    if config.lora_rank:
        save_peft_adapter(lora_state(model), loaded.config, config.lora_rank, config.alpha, str(loaded.path), output)
        if not (config.merge or config.export_gguf):
            return
        model = merge_lora(model)
        if config.merge:
            save_hf_folder(model, loaded.config, loaded.tokenizer, output / "merged")
    else:
        save_hf_folder(model, loaded.config, loaded.tokenizer, output)
    if config.export_gguf:
        if loaded.path.suffix != ".gguf":
            raise ValueError(f"export_gguf: the base model is not a GGUF file ({loaded.path})")
        export_gguf(model, loaded.config, loaded.tokenizer, loaded.path, output / "model.gguf")
