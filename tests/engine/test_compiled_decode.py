"""The compiled decode step on a tiny Q4_1 GGUF with a Q8_0 token embedding, as SmolLM2's file is (the int4
and int8 kernels and the paged decode-attention kernel inside the graph): the same greedy tokens as eager,
and no recompilation as batches and contexts change from step to step.

Compiled and eager round differently (inductor fuses the elementwise ops), and the kernel's int8 activations
turn a last-bit difference into a logit difference of about 1e-3 now and then. A random tiny model has
near-ties that small (its bfloat16 LM head even has exact ties), so the tokens are compared as greedy
choices: the compiled run's logits must be eager's on the same tokens, and each token it picked must be
eager's greedy choice up to that rounding."""

from __future__ import annotations

import pytest
import torch

from tests.models.test_gguf_loader import Q, tiny_model, write_gguf  # noqa: F401 (tiny_model is a fixture)
from tokenloop import kernels
from tokenloop.engine.block_manager import BlockManager
from tokenloop.engine.model_runner import ModelRunner
from tokenloop.engine.scheduler import ScheduledBatch
from tokenloop.engine.sequence import Sequence
from tokenloop.models.loader import load_model
from tokenloop.models.quant import Int8Embedding
from tokenloop.sampling.params import SamplingParams

BLOCK_SIZE, NUM_BLOCKS = 4, 64
STEPS = 16
SINGLE = [[5, 9, 2, 44, 17]]
# One-token prompts: the first decode step attends 2 keys, as many as the model has KV heads. Traced with
# duck shaping, that context length would be fused with the head count and compiled as a constant.
FIRST_BATCH = [[3], [60]]
BATCH = [[3, 7, 11], [60, 2, 2, 8, 31, 5, 90], [12, 40, 41, 13, 1]]


def runner_for(path, compile: bool) -> ModelRunner:
    loaded = load_model(path, torch.float32, torch.device("cpu"), load_tokenizer=False, keep_quantized=True)
    # A float16 KV cache, as the engine's fast path has (EngineConfig.kv_cache_dtype).
    return ModelRunner(loaded.model, loaded.config, NUM_BLOCKS, BLOCK_SIZE, torch.float16, torch.device("cpu"), compile)


def greedy(runner: ModelRunner, prompts: list[list[int]], steps: int = STEPS, forced: list[list[int]] | None = None):
    """Prefill every prompt in one step, then decode them together: one new token per sequence per step.
    Returns each sequence's tokens and logits; with `forced`, those tokens are appended instead of the sampled."""
    blocks = BlockManager(NUM_BLOCKS, BLOCK_SIZE, enable_prefix_caching=False)
    seqs = [Sequence(f"s{i}", list(p), len(p), SamplingParams(temperature=0)) for i, p in enumerate(prompts)]
    logits: list[list[torch.Tensor]] = [[] for _ in seqs]
    compute_logits = runner.model.compute_logits
    for step in range(steps):
        new = [s.num_tokens - s.num_computed_tokens for s in seqs]
        for seq, n in zip(seqs, new):
            assert blocks.allocate(seq, seq.num_computed_tokens + n)
        step_logits = []
        runner.model.compute_logits = lambda h: step_logits.append(compute_logits(h)) or step_logits[-1]
        try:
            sampled, samples = runner.execute(ScheduledBatch(list(seqs), new))
        finally:
            runner.model.compute_logits = compute_logits
        for seq, n in zip(seqs, new):
            seq.num_computed_tokens += n
        for row, i in enumerate(sampled):
            logits[i].append(step_logits[0][row])
            seqs[i].token_ids.append(forced[i][step] if forced else samples.token_ids[row])
    return [s.output_token_ids for s in seqs], [torch.stack(rows) for rows in logits]


def assert_same_greedy_tokens(compiled: ModelRunner, eager: ModelRunner, prompts: list[list[int]], steps: int = STEPS) -> None:
    tokens, logits = greedy(compiled, prompts, steps)
    _, eager_logits = greedy(eager, prompts, steps, forced=tokens)
    for seq_tokens, got, expected in zip(tokens, logits, eager_logits):
        torch.testing.assert_close(got, expected, atol=0.02, rtol=0)  # logits of about 0.5
        chosen = expected.gather(1, torch.tensor(seq_tokens)[:, None])[:, 0]
        assert (expected.max(1).values - chosen).max() <= 0.02, "a compiled greedy token is not eager's choice"


@pytest.fixture(scope="module")
def tiny_q4_1(tiny_model, tmp_path_factory):  # noqa: F811
    arch, model = tiny_model
    return write_gguf(model, arch, tmp_path_factory.mktemp("compiled") / f"{arch}.gguf", Q.Q4_1, embedding_qtype=Q.Q8_0)


def test_compiled_decode_gives_the_eager_greedy_tokens_and_never_recompiles(tiny_q4_1):
    eager, compiled = runner_for(tiny_q4_1, compile=False), runner_for(tiny_q4_1, compile=True)
    model, kernels_run = compiled.model, kernels._unsupported_reason() is None
    tied = model.config.tie_word_embeddings  # qwen2's is: its Q8_0 embedding is the int8 LM head
    assert isinstance(model.lm_head, Int8Embedding) == tied
    assert model.lm_head.cpu_kernel == kernels_run if tied else True
    assert all(attn.cpu_kernel == kernels_run for attn in model.attention_layers())
    graphs = torch._dynamo.utils.counters["stats"]
    before = graphs["unique_graphs"]
    assert_same_greedy_tokens(compiled, eager, SINGLE)
    assert_same_greedy_tokens(compiled, eager, FIRST_BATCH)
    assert compiled.forward.compiled is not None  # a failed compile would have fallen back to eager
    assert graphs["unique_graphs"] - before == 2  # one sequence; a batch of several

    # Other prompt lengths, batch sizes and a longer context: the same two graphs, nothing compiled again.
    with torch.compiler.set_stance("fail_on_recompile"):
        assert_same_greedy_tokens(compiled, eager, BATCH)
        assert_same_greedy_tokens(compiled, eager, [[8] * 9], steps=24)
        assert_same_greedy_tokens(compiled, eager, [[i, i + 1, 2 * i] for i in range(3, 8)])
    assert graphs["unique_graphs"] - before == 2


def test_an_engine_with_compile_builds_both_graphs_while_starting(tiny_model_folder, tiny_llm):
    from tokenloop import LLM

    llm = LLM(tiny_model_folder, dtype="float32", device="cpu", kv_cache_gb=0.01, compile=True)
    assert llm.llm_engine.runner.forward.compiled is not None
    assert not llm.llm_engine.requests and llm.llm_engine.block_manager.num_used_blocks == 0  # the warm-up left nothing
    assert llm.llm_engine.runner.forward.guards_frozen  # only the guards that tell the two graphs apart run now
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = ["Hello world", "The quick brown fox", "def main():"]
    graphs = torch._dynamo.utils.counters["stats"]
    before = graphs["unique_graphs"]
    batch = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    single = llm.generate(prompts[1], params, use_tqdm=False)[0].outputs[0].token_ids
    assert graphs["unique_graphs"] == before  # one sequence and a batch: both built while starting
    eager = [o.outputs[0].token_ids for o in tiny_llm.generate(prompts, params, use_tqdm=False)]
    assert batch == eager and single == eager[1]
