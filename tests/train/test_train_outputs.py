"""What `tokenloop train` leaves, on the default model: a full fine-tune's folder loads in transformers and in
tokenloop with the same logits; a LoRA run's adapter loads in peft with the logits of its merged folder, and its
GGUF export serves on the fast path."""

from __future__ import annotations

import json

import pytest
import torch

from tests.helpers import transformers_from_gguf
from tokenloop import LLM, SamplingParams
from tokenloop.models.attention import PackedSequences
from tokenloop.models.loader import load_model
from tokenloop.train import TrainConfig, train

pytestmark = pytest.mark.real_model
ROWS = [{"prompt": f"What is {i} plus {i}?", "completion": f" {2 * i}."} for i in range(12)]
PROBE = "What is 7 plus 7?"


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "sums.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return path


def our_logits(folder_or_file, text: str) -> torch.Tensor:
    loaded = load_model(folder_or_file, torch.float32, torch.device("cpu"))
    ids = loaded.tokenizer.encode(text)
    meta = PackedSequences.of([len(ids)])
    with torch.no_grad():
        return loaded.model.compute_logits(loaded.model(torch.tensor(ids), meta.positions(), meta))


def test_a_full_fine_tune_loads_in_transformers_and_tokenloop(data, tmp_path):
    import transformers

    out = tmp_path / "full"
    result = train(TrainConfig(data=str(data), output=str(out), max_steps=4, lr=1e-4, batch_size=2), progress=False)
    assert result.last_eval_loss < result.first_eval_loss
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = transformers.AutoTokenizer.from_pretrained(out)(PROBE, return_tensors="pt").input_ids
    with torch.no_grad():
        theirs = hf(ids).logits[0]
    torch.testing.assert_close(our_logits(out, PROBE), theirs, atol=1e-4, rtol=0)
    LLM(str(out), dtype="float32").generate([PROBE], SamplingParams(temperature=0, max_tokens=4))


def test_a_lora_adapter_loads_in_peft_and_its_gguf_serves(data, tmp_path, default_model_path):
    import peft

    out = tmp_path / "lora"
    config = TrainConfig(
        data=str(data), output=str(out), max_steps=4, lr=1e-3, batch_size=2, lora_rank=8, merge=True, export_gguf=True
    )
    result = train(config, progress=False)
    assert result.last_eval_loss < result.first_eval_loss
    assert {"adapter_config.json", "adapter_model.safetensors", "merged", "model.gguf"} <= {
        p.name for p in out.iterdir()
    }
    base, tokenizer = transformers_from_gguf(default_model_path)
    tuned = peft.PeftModel.from_pretrained(base, out).eval()
    with torch.no_grad():
        theirs = tuned(tokenizer(PROBE, return_tensors="pt").input_ids).logits[0]
    torch.testing.assert_close(our_logits(out / "merged", PROBE), theirs, atol=1e-4, rtol=0)
    llm = LLM(str(out / "model.gguf"))  # the fast path, in the base file's own types
    assert llm.generate([PROBE], SamplingParams(temperature=0, max_tokens=4))[0].outputs[0].token_ids
