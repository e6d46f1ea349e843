"""Test helpers: the test engines' arguments and the engines built from them; a loaded model run over a token
sequence in chunks through the real KV cache path; the tiny tokenizer and models; transformers' references."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer as RustTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from tokenloop import LLM
from tokenloop.engine.async_engine import AsyncEngine, AsyncEngineConfig
from tokenloop.engine.block_manager import BlockManager
from tokenloop.engine.config import EngineConfig
from tokenloop.engine.kv_groups import kv_bytes_per_block, kv_cache_groups, kv_cache_windows
from tokenloop.engine.model_runner import ModelRunner
from tokenloop.engine.scheduler import ScheduledBatch
from tokenloop.engine.sequence import Sequence
from tokenloop.models.config import ModelConfig
from tokenloop.models.loader import LoadedModel, load_config
from tokenloop.sampling.params import SamplingParams

# A test engine: on the CPU, the exact float32 path, a small KV pool, one thread (the same floats whatever else the
# machine runs, and no core taken from a neighbour), unless a test says otherwise.
TEST_ENGINE = {"dtype": "float32", "device": "cpu", "kv_cache_gb": 0.01, "threads": 1}


def model_config(model: str | os.PathLike | None) -> ModelConfig:
    """A model's config (a known name, a .gguf file or a Hugging Face folder), read without its weights."""
    return load_config(model)


def engine_args_for(model: str | os.PathLike | None, kv_blocks: int | None = None, **engine_args) -> dict[str, Any]:
    """EngineConfig's fields (but the model) for a test engine: TEST_ENGINE, overridden by `engine_args` (any field,
    speculative_config included). `kv_blocks`: a pool of that many KV blocks for each KV cache group of this model
    (engine/kv_groups.py: the blocks of every layer), in place of kv_cache_gb (too small for a batch: its sequences
    are preempted and recomputed)."""
    args = TEST_ENGINE | engine_args
    if kv_blocks is not None:
        if "kv_cache_gb" in engine_args:
            raise TypeError("kv_blocks or kv_cache_gb, not both")
        config = EngineConfig(model=None if model is None else os.fspath(model), **args)
        block_bytes = kv_bytes_per_block(model_config(model), config.block_size, config.kv_dtype)
        num_blocks = kv_blocks * len(kv_cache_groups(model_config(model)))
        args["kv_cache_gb"] = (num_blocks + 0.5) * block_bytes / 2**30
    return args


def build_llm(model: str | os.PathLike | None, kv_blocks: int | None = None, **engine_args) -> LLM:
    """A test engine (engine_args_for); the make_llm fixture builds its engines with this, and so may a module-scoped
    fixture or a child process."""
    return LLM(model, **engine_args_for(model, kv_blocks, **engine_args))


def build_async_engine(
    model: str | os.PathLike, limits: AsyncEngineConfig | None = None, kv_blocks: int | None = None, **engine_args
) -> AsyncEngine:
    """The same test engine behind an AsyncEngine (its step loop in a thread), with `limits` on its readers."""
    config = EngineConfig(model=os.fspath(model), **engine_args_for(model, kv_blocks, **engine_args))
    return AsyncEngine(config, config=limits)


def build_disaggregated_engine(model: str | os.PathLike, **engine_args):
    """The same test engine's config, run by a prefill and a decode worker process (one core each where there are
    two) behind a DisaggregatedEngine, every prompt longer than a block prefilled; shut it down after use."""
    from tokenloop.disaggregation.frontend import DisaggregatedEngine, DisaggregationConfig

    config = EngineConfig(model=os.fspath(model), **engine_args_for(model, **engine_args))
    return DisaggregatedEngine(config, DisaggregationConfig(min_prefill_tokens=1))


async def last_outputs(engine, requests: list[tuple[Any, Any]]) -> list:
    """Each request's last output, streamed from an AsyncEngine or DisaggregatedEngine, all at once."""
    import asyncio

    async def one(prompt, params):
        last = None
        async for last in engine.generate(prompt, params):
            pass
        return last

    return await asyncio.gather(*(one(*request) for request in requests))


def transformers_from_gguf(path: Path):
    """transformers loading a GGUF (dequantized to float32): the model and its tokenizer."""
    import pytest

    transformers = pytest.importorskip("transformers")
    folder, name = str(path.parent), path.name
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    return model, transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)


def forward_in_chunks(
    loaded: LoadedModel, token_ids: list[int], chunks: list[int], block_size: int = 16
) -> torch.Tensor:
    """Logits [len(token_ids), vocab] computed `chunks[i]` tokens at a time against a KV cache of its own.

    The model's cache bindings are restored afterwards, so an engine sharing the model is left as it was.
    """
    assert sum(chunks) == len(token_ids)
    layers = loaded.model.attention_layers()
    saved = [(a.k_cache, a.v_cache, a.kv_group, a.kv_pool) for a in layers]
    try:
        return _forward(loaded, token_ids, chunks, block_size)
    finally:
        for a, binding in zip(layers, saved):
            a.bind_cache(*binding)


def _forward(loaded: LoadedModel, token_ids: list[int], chunks: list[int], block_size: int) -> torch.Tensor:
    windows = kv_cache_windows(loaded.config)
    num_blocks = (-(-len(token_ids) // block_size) + 1) * len(windows)
    dtype = loaded.model.norm.weight.dtype  # the activation dtype (a fast-path embedding may be bfloat16)
    device = next(loaded.model.parameters()).device
    runner = ModelRunner(loaded.model, loaded.config, num_blocks, block_size, dtype, device)
    blocks = BlockManager(num_blocks, block_size, enable_prefix_caching=False, windows=windows)
    # A sequence that scores its prompt asks the runner for the logits of every position (the seam that
    # prompt logprobs, perplexity and speculative verification use).
    seq = Sequence("test", list(token_ids), len(token_ids), SamplingParams(prompt_logprobs=0), score_prompt=True)
    logits = []
    with torch.inference_mode():
        for n in chunks:
            assert blocks.allocate(seq, seq.num_computed_tokens + n)
            inp = runner.prepare(ScheduledBatch([seq], [n]))
            logits.append(runner.logits(inp))
            seq.num_computed_tokens += n
    return torch.cat(logits)


CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world! Hello tokenizers, hello templates.",
    "def main():\n    print('hi')\n    return 0\n",
    "Numbers like 12345 and 3.14 are common; so are emoji 😀 and 中文.",
    "I'm sure they'll say it's fine, don't you think?",
]
TINY_SPECIAL = ["<s>", "</s>", "<|user|>", "<|assistant|>"]
TINY_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'system' %}{{ m['content'] }}\n"
    "{% else %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def write_tiny_tokenizer(folder: Path) -> Path:
    """A byte-level BPE that adds <s> through its post-processor, with a chat template and extra eos ids."""
    tok = RustTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=TINY_SPECIAL, initial_alphabet=alphabet, show_progress=False
    )
    tok.train_from_iterator(CORPUS * 5, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    tok.save(str(folder / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": {"__type": "AddedToken", "content": "</s>", "special": True},  # the older, serialized form
        "chat_template": TINY_TEMPLATE,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 3]}))
    return folder


def small_vocab_model(folder: Path, vocab: int, seed: int):
    """A tiny random Llama of `vocab` tokens with the tiny tokenizer, saved in folder: small enough to enumerate
    every two-token continuation."""
    import transformers

    write_tiny_tokenizer(folder)
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=1,
    )
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(4)  # distributions with peaks and tails, not near-uniform
    model.save_pretrained(folder)
    return model.eval()


def quantized_activations(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """A kernel's int8 activations, in float64: int8 per block of the last dimension with scale max|x| / 127, times
    that scale (blocks of 32: the quantized products'; a head: the int8 KV cache's attention queries)."""
    *m, k = x.shape
    blocks = x.reshape(*m, k // block, block)
    amax = blocks.abs().amax(-1)
    q = torch.round(blocks * torch.where(amax > 0, 127 / amax, 0)[..., None])
    return (q.double() * (amax.double() / 127)[..., None]).view(*m, k)


def reference_greedy(model, prompt_ids: list[int], steps: int) -> tuple[list[int], list[torch.Tensor]]:
    """transformers' model decoded greedily with its own KV cache; per-step log-probabilities of the raw logits."""
    tokens, logprobs = [], []
    ids, past = torch.tensor([prompt_ids]), None
    with torch.no_grad():
        for _ in range(steps):
            out = model(input_ids=ids, past_key_values=past, use_cache=True)
            past = out.past_key_values
            lp = out.logits[0, -1].float().log_softmax(-1)
            token = int(lp.argmax())
            tokens.append(token)
            logprobs.append(lp)
            ids = torch.tensor([[token]])
    return tokens, logprobs


def through_eos(ids: list[int], eos: set[int]) -> list[int]:
    """transformers pads a beam that ended: its tokens up to and with the EOS."""
    out = []
    for t in ids:
        out.append(t)
        if t in eos:
            break
    return out


def hf_beams(model, prompt_ids: list[int], eos: list[int], width: int, new_tokens: int, **kw) -> list[list[int]]:
    """transformers' generate(num_beams=width): its `width` beams, best first, each through its EOS."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt_ids]),
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            num_beams=width,
            num_return_sequences=width,
            max_new_tokens=new_tokens,
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=eos[0],
            **kw,
        )
    return [through_eos(row[len(prompt_ids) :].tolist(), set(eos)) for row in out]
