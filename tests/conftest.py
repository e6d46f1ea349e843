"""Session-wide fixtures: the default model (pulled into the model store once), its transformers reference,
and a tiny random Llama with a tiny tokenizer saved as a Hugging Face folder for fast tests; LoRA adapters on them
with their merged models; the factories of test engines (make_llm, make_async_engine), which leave nothing behind."""

from __future__ import annotations

import os
from pathlib import Path

# Eager by default in tests (and the servers they start), so that no test starts a background compile it does
# not wait for; the compiled step's tests ask for compile=True.
os.environ["TOKENLOOP_COMPILE"] = "0"

import pytest
import torch

from tests.helpers import build_async_engine, build_llm, write_tiny_tokenizer

# A test that uses one of these needs a known GGUF model (pulled into the model store on first use): it is marked
# real_model, and runs in the slow tier.
REAL_MODEL_FIXTURES = frozenset({"default_model_path", "gemma3_path", "real_model"})


def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        if REAL_MODEL_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.real_model)


@pytest.fixture
def make_llm():
    """make_llm(model, kv_blocks=None, **engine_args) -> LLM: a test engine (tests.helpers.build_llm: on the CPU,
    float32, a small KV pool, one thread, unless engine_args say otherwise; kv_blocks=N: a pool of N blocks;
    speculative_config=...: drafts). After the test, every KV block of every engine it made, and of their draft
    models, is free again, and the engines are let go."""
    made = []

    def make(model, kv_blocks: int | None = None, **engine_args):
        made.append(build_llm(model, kv_blocks, **engine_args))
        return made[-1]

    yield make
    for llm in made:
        engine = llm.llm_engine
        pools = [("the engine", engine.block_manager)]
        if engine.speculator is not None and hasattr(engine.speculator.proposer, "block_manager"):
            pools.append(("its draft model", engine.speculator.proposer.block_manager))
        for name, pool in pools:
            assert not [b.block_id for b in pool.blocks if b.ref_count], f"{name} of {engine.config.model} held blocks"
    made.clear()


@pytest.fixture
def make_async_engine():
    """make_async_engine(model, limits: AsyncEngineConfig | None = None, **engine_args) -> AsyncEngine: make_llm's
    test engine (the same arguments) behind an AsyncEngine, its step loop in a thread; shut down after the test."""
    made = []

    def make(model, limits=None, **engine_args):
        made.append(build_async_engine(model, limits, **engine_args))
        return made[-1]

    yield make
    for engine in made:
        engine.shutdown()


@pytest.fixture(scope="session")
def default_model_path() -> Path:
    from tokenloop.models.store import resolve

    return resolve(None)


@pytest.fixture(scope="session")
def gemma3_path() -> Path:
    from tokenloop.models.store import resolve

    return resolve("gemma3-270m")


@pytest.fixture(scope="session")
def llm_fp32(default_model_path):
    """tokenloop on the default GGUF, exact float32 path, on the CPU like the reference."""
    from tokenloop import LLM

    return LLM(default_model_path, dtype="float32", device="cpu")


@pytest.fixture(scope="session")
def hf_reference(default_model_path):
    """transformers loading the same GGUF (dequantized to float32): the model and its tokenizer."""
    from tests.helpers import transformers_from_gguf

    return transformers_from_gguf(default_model_path)


@pytest.fixture(scope="session")
def tiny_model_folder(tmp_path_factory) -> Path:
    transformers = pytest.importorskip("transformers")
    folder = write_tiny_tokenizer(tmp_path_factory.mktemp("tiny_llama"))
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=400,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=1,
    )
    model = transformers.LlamaForCausalLM(config)
    # Sharper logits than the random init gives, so that greedy choices are not near-ties.
    with torch.no_grad():
        model.lm_head.weight.mul_(20)
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_llm(tiny_model_folder):
    from tokenloop import LLM

    return LLM(tiny_model_folder, dtype="float32", device="cpu", kv_cache_gb=0.01)


@pytest.fixture(scope="session")
def tiny_lora(tiny_model_folder, tmp_path_factory) -> tuple[Path, Path]:
    """A random LoRA (r 8, alpha 16, all seven linears) on the tiny model, in PEFT's layout, and the tiny model with
    it merged in, as Hugging Face folders: (adapter, merged)."""
    from tests.lora_helpers import make_adapter

    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_folder, dtype=torch.float32).eval()
    return make_adapter(model, tiny_model_folder, tmp_path_factory.mktemp("tiny_lora"), seed=1)


@pytest.fixture(scope="session")
def real_lora(default_model_path, tmp_path_factory) -> tuple[Path, Path]:
    """The same kind of adapter on the default model (transformers loading its GGUF in float32): (adapter, merged)."""
    from tests.helpers import transformers_from_gguf
    from tests.lora_helpers import make_adapter

    model, tokenizer = transformers_from_gguf(default_model_path)
    return make_adapter(model, tokenizer, tmp_path_factory.mktemp("real_lora"), seed=1, b_scale=0.25)


@pytest.fixture(scope="session")
def tiny_drafter_folder(tiny_model_folder, tmp_path_factory) -> Path:
    """An EAGLE drafter for the tiny model: 300 of its 400 tokens, a head that drafts the last token again (its
    greedy drafts are accepted where the model repeats a token, rejected elsewhere)."""
    from tests.eagle_helpers import write_random_drafter

    return write_random_drafter(tmp_path_factory.mktemp("tiny_drafter"), tiny_model_folder, 300, seed=0, echo=True)


@pytest.fixture(scope="session")
def long_context_model_folder(tiny_model_folder, tmp_path_factory) -> Path:
    """The tiny model with a 4,096-token context: long prompts, and streams that outgrow the socket buffers."""
    import json
    import shutil

    folder = tmp_path_factory.mktemp("tiny_long")
    for f in tiny_model_folder.iterdir():
        shutil.copy(f, folder / f.name)
    config = json.loads((folder / "config.json").read_text())
    config["max_position_embeddings"] = 4096
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="session")
def tiny_gemma3_folder(tmp_path_factory) -> Path:
    """A tiny random Gemma 3 (transformers' Gemma3ForCausalLM) with the tiny tokenizer: 6 layers, five sliding
    (window 8) then one global, as the real model's pattern; norms random, so that their (1 + w) form matters."""
    transformers = pytest.importorskip("transformers")
    folder = write_tiny_tokenizer(tmp_path_factory.mktemp("tiny_gemma3"))
    torch.manual_seed(0)
    config = transformers.Gemma3TextConfig(
        vocab_size=400,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        query_pre_attn_scalar=16,
        sliding_window=8,
        max_position_embeddings=256,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
    )
    model = transformers.Gemma3ForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.normal_(0.0, 0.3)
        model.model.norm.weight.add_(3.0)  # sharper logits (x4), so that greedy choices are not near-ties
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def tiny_model(request):
    """A tiny random Llama (untied) or Qwen2 (tied) checkpoint in transformers, to be written as GGUF files."""
    transformers = pytest.importorskip("transformers")
    from tests.gguf_files import TINY

    torch.manual_seed(0)
    if request.param == "llama":
        config = transformers.LlamaConfig(**TINY, tie_word_embeddings=False)
    else:
        config = transformers.Qwen2Config(**TINY, tie_word_embeddings=True)
    return request.param, transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
