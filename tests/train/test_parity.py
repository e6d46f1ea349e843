"""Training is parallel, inference is serial, and they agree (float32, on the real models): the training forward's
logits at every position of packed examples equal the engine's when it decodes each sequence token by token through
the paged KV cache, and the step-0 eval loss is transformers' loss of the same model on the same tokens."""

from __future__ import annotations

import json

import pytest
import torch

from tests.helpers import forward_in_chunks
from tokenloop.models.attention import PackedSequences
from tokenloop.models.loader import load_model
from tokenloop.train.config import TrainConfig
from tokenloop.train.trainer import train

pytestmark = pytest.mark.real_model

TEXTS = [
    "The quick brown fox jumps over the lazy dog. It was a sunny day in the park, and the dog did not mind.",
    "Photosynthesis turns light into sugar.",
    "def add(a, b):\n    return a + b\n",
]


@pytest.fixture(params=["default_model_path", "gemma3_path"])
def model_path(request):
    return request.getfixturevalue(request.param)


def test_teacher_forcing_equals_serial_decoding(model_path):
    loaded = load_model(model_path, torch.float32, torch.device("cpu"))
    sequences = [loaded.tokenizer.encode(t) for t in TEXTS]
    meta = PackedSequences.of([len(s) for s in sequences])
    with torch.no_grad():
        hidden = loaded.model(torch.tensor([t for s in sequences for t in s]), meta.positions(), meta)
        parallel = loaded.model.compute_logits(hidden)
    serial = torch.cat([forward_in_chunks(loaded, s, [1] * len(s)) for s in sequences])
    torch.testing.assert_close(parallel, serial, atol=1e-4, rtol=0)


def test_step_zero_eval_loss_is_transformers_loss(default_model_path, tmp_path):
    from tests.helpers import transformers_from_gguf  # transformers on the same GGUF, float32

    data = tmp_path / "data.jsonl"
    rows = [{"prompt": "Question: what is 2 + 2?\nAnswer:", "completion": " 4"}, {"text": TEXTS[0]}, {"text": TEXTS[2]}]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = train(TrainConfig(data=str(data), output=str(tmp_path / "out"), max_steps=0), progress=False)

    from tokenloop.train.data import load_examples

    tokenizer = load_model(default_model_path, torch.float32, torch.device("cpu")).tokenizer
    hf_model, _ = transformers_from_gguf(default_model_path)
    total, count = 0.0, 0
    for example in load_examples(str(data), tokenizer, 1024):
        ids = torch.tensor([example.token_ids])
        labels = torch.tensor([t if s else -100 for t, s in zip(example.token_ids, example.scored)])
        with torch.no_grad():
            logits = hf_model(ids).logits[0, :-1].float()
        nll = torch.nn.functional.cross_entropy(logits, labels[1:], ignore_index=-100, reduction="sum")
        total, count = total + float(nll), count + int((labels[1:] != -100).sum())
    expected = total / count
    print(f"step-0 eval loss: tokenloop {result.first_eval_loss:.8f}, transformers {expected:.8f}")
    assert result.first_eval_loss == pytest.approx(expected, rel=1e-4)
