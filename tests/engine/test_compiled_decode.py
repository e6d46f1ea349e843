"""The compiled decode step on a tiny Q4_1 GGUF with a Q8_0 token embedding, as SmolLM2's file is (the int4
and int8 kernels and the paged attention kernel inside the package): the same logits, to the last bit, and so the
same greedy tokens as eager, every decode step run by the one package, compiled once and loaded from the cache
after that. Compiled and eager steps call the same kernels (each has a fake implementation for the tracer): one
program."""

from __future__ import annotations

import subprocess
import sys
import zipfile

import pytest
import torch

from tests.gguf_files import Q, write_gguf
from tokenloop import kernels
from tokenloop.engine import compiled_decode
from tokenloop.engine.block_manager import BlockManager
from tokenloop.engine.config import EngineConfig
from tokenloop.engine.kv_groups import kv_cache_groups, kv_cache_windows
from tokenloop.engine.model_runner import ModelRunner
from tokenloop.engine.scheduler import ScheduledBatch
from tokenloop.engine.sequence import Sequence
from tokenloop.models.loader import load_model
from tokenloop.models.quant import Int8Embedding
from tokenloop.sampling.params import SamplingParams

pytestmark = pytest.mark.slow  # each test builds (or loads) a compiled package: 10 to 60 s on 2 cores

BLOCK_SIZE, NUM_BLOCKS = 16, 32
STEPS = 16
SINGLE = [[5, 9, 2, 44, 17]]
# One-token prompts: the first decode step attends 2 keys, as many as the model has KV heads (a size a
# tracer could mistake for the same number).
FIRST_BATCH = [[3], [60]]
BATCH = [[3, 7, 11], [60, 2, 2, 8, 31, 5, 90], [12, 40, 41, 13, 1]]


def runner_for(path, compile: bool) -> ModelRunner:
    loaded = load_model(path, torch.float32, torch.device("cpu"), load_tokenizer=False, keep_quantized=True)
    # The KV cache's dtype of the engine's fast path (bfloat16 or float16, by the CPU).
    kv_dtype = EngineConfig(device="cpu").kv_dtype
    num_blocks = NUM_BLOCKS * len(kv_cache_groups(loaded.config))  # NUM_BLOCKS for each KV cache group
    return ModelRunner(loaded.model, loaded.config, num_blocks, BLOCK_SIZE, kv_dtype, torch.device("cpu"), compile)


def blocks_for(runner: ModelRunner) -> BlockManager:
    """A block manager of the runner's pool, with a block table per KV cache group of its model."""
    num_blocks = runner.k_pools[0].shape[1] // BLOCK_SIZE
    return BlockManager(num_blocks, BLOCK_SIZE, enable_prefix_caching=False, windows=kv_cache_windows(runner.config))


def greedy(runner: ModelRunner, prompts: list[list[int]], steps: int = STEPS, forced: list[list[int]] | None = None):
    """Prefill every prompt in one step, then decode them together: one new token per sequence per step.
    Returns each sequence's tokens and logits; with `forced`, those tokens are appended instead of the sampled."""
    blocks = blocks_for(runner)
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


def assert_same_greedy_tokens(
    compiled: ModelRunner, eager: ModelRunner, prompts: list[list[int]], steps: int = STEPS
) -> None:
    tokens, logits = greedy(compiled, prompts, steps)
    eager_tokens, eager_logits = greedy(eager, prompts, steps)
    assert tokens == eager_tokens
    for got, expected in zip(logits, eager_logits):
        assert torch.equal(got, expected)


def assert_verify_step_runs_the_package_to_decode_logits(runner: ModelRunner, package) -> None:
    """A verify step (a sequence's last token and a draft of 3 after it, beside a plain decode) is a decode step to
    the package: one query row per token. Each row's logits are those of decoding its tokens one at a time."""
    from tokenloop.spec_decode.proposer import Draft

    prompt, draft = [5, 9, 2, 44, 17], [30, 31, 32]

    def prefilled(seq_id: str, blocks: BlockManager) -> Sequence:
        seq = Sequence(seq_id, list(prompt), len(prompt), SamplingParams(temperature=0))
        assert blocks.allocate(seq, len(prompt) - 1)
        runner.logits(runner.prepare(ScheduledBatch([seq], [len(prompt) - 1])))
        seq.num_computed_tokens = len(prompt) - 1
        return seq

    blocks = blocks_for(runner)
    one_by_one = prefilled("a", blocks)
    expected = []
    for token in [None, *draft]:
        if token is not None:
            one_by_one.token_ids.append(token)
        assert blocks.allocate(one_by_one, one_by_one.num_tokens)
        expected.append(runner.logits(runner.prepare(ScheduledBatch([one_by_one], [1])))[0])
        one_by_one.num_computed_tokens += 1
    verifying, plain = prefilled("b", blocks), prefilled("c", blocks)
    verifying.draft = Draft(draft)
    assert blocks.allocate(verifying, verifying.num_tokens + len(draft)) and blocks.allocate(plain, plain.num_tokens)
    calls = package.calls
    inp = runner.prepare(ScheduledBatch([verifying, plain], [1 + len(draft), 1]))
    assert inp.decode_only and [(s.count, s.num_draft) for s in inp.spans] == [(4, 3), (1, 0)]
    logits = runner.logits(inp)
    assert package.calls == calls + 1
    assert torch.equal(logits[:4], torch.stack(expected)) and torch.equal(logits[4], expected[0])


def package_wrapper_source(path) -> str:
    """The C++ of a package's decode step (the .pt2 is a zip that keeps it)."""
    with zipfile.ZipFile(path) as package:
        (name,) = [n for n in package.namelist() if n.endswith("wrapper.cpp")]
        return package.read(name).decode()


class CountingPackage:
    """The loaded package, counting its calls."""

    def __init__(self, package) -> None:
        self.package, self.calls = package, 0

    def run(self, inputs):
        self.calls += 1
        return self.package.run(inputs)


@pytest.fixture
def builds(monkeypatch, tmp_path):
    """An empty package cache, and a count of the packages compiled into it."""
    monkeypatch.setenv("TOKENLOOP_HOME", str(tmp_path))
    built = []
    build = compiled_decode.build_package
    monkeypatch.setattr(compiled_decode, "build_package", lambda *args: built.append(args[-1]) or build(*args))
    return built


@pytest.fixture(scope="module")
def tiny_q4_1(tiny_model, tmp_path_factory):  # noqa: F811
    arch, model = tiny_model
    return write_gguf(model, arch, tmp_path_factory.mktemp("compiled") / f"{arch}.gguf", Q.Q4_1, embedding_qtype=Q.Q8_0)


def test_compiled_decode_gives_the_eager_greedy_tokens_from_one_package(tiny_q4_1, builds):
    eager, compiled = runner_for(tiny_q4_1, compile=False), runner_for(tiny_q4_1, compile=True)
    assert compiled.forward.compiled is not None and len(builds) == 1  # a failed build would have fallen back to eager
    model, kernels_run = compiled.model, kernels._unsupported_reason() is None
    tied = model.config.tie_word_embeddings  # qwen2's is: its Q8_0 embedding is the int8 LM head
    assert isinstance(model.lm_head, Int8Embedding) == tied
    assert model.lm_head.cpu_kernel == kernels_run if tied else True
    assert all(attn.cpu_kernel == kernels_run for attn in model.attention_layers())
    if kernels_run:  # the package calls the kernels' C functions, never through the proxy executor
        wrapper = package_wrapper_source(compiled.forward.path)
        assert "aoti_torch_cpu_q4_matmul(" in wrapper and "aoti_torch_cpu_paged_attention(" in wrapper
        assert "proxy_executor_call_function(" not in wrapper

    # One sequence and batches, prompt lengths, a longer context: every decode step runs the package.
    package = compiled.forward.compiled = CountingPackage(compiled.forward.compiled)
    cases = [
        (SINGLE, STEPS),
        (FIRST_BATCH, STEPS),
        (BATCH, STEPS),
        ([[8] * 9], 24),
        ([[i, i + 1, 2 * i] for i in range(3, 8)], STEPS),
    ]
    for prompts, steps in cases:
        assert_same_greedy_tokens(compiled, eager, prompts, steps)
    # All steps but each case's prefill; one-token prompts' first step is a decode step too.
    assert package.calls == sum(steps - 1 for _, steps in cases) + 1
    assert len(builds) == 1
    assert_verify_step_runs_the_package_to_decode_logits(compiled, package)

    # A second start of the same model loads the package: nothing is compiled again.
    again = runner_for(tiny_q4_1, compile=True)
    assert not again.forward.built and again.forward.compiled is not None and len(builds) == 1
    assert_same_greedy_tokens(again, eager, SINGLE)


def test_compiled_decode_of_gemma3_honours_each_layers_window(tiny_gemma3_folder, builds, tmp_path):
    """Gemma 3's sliding (window 8) and global layers in the package, their masks computed inside the step, with
    a GELU-gated int4 MLP: eager's greedy tokens while the contexts grow from 3-7 tokens to 3 windows."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_gemma3_folder, dtype=torch.float32)
    path = write_gguf(model, "gemma3", tmp_path / "gemma3.gguf", Q.Q4_1, embedding_qtype=Q.Q8_0)
    eager, compiled = runner_for(path, compile=False), runner_for(path, compile=True)
    assert compiled.forward.compiled is not None and len(builds) == 1
    package = compiled.forward.compiled = CountingPackage(compiled.forward.compiled)
    assert_same_greedy_tokens(compiled, eager, BATCH, 24)
    assert package.calls == 23


def test_pull_compiles_the_package_that_an_engine_then_runs_to_eager_tokens_and_a_later_start_never_imports_the_compiler(  # noqa: E501
    tiny_model_folder, builds, tmp_path, monkeypatch, capsys
):
    from tokenloop import LLM, cli
    from tokenloop.models import store

    monkeypatch.setattr(store, "pull", lambda name: tiny_model_folder)  # the fetch: a known model's file is a download
    assert cli.main(["pull", "tiny", "--compile"]) == 0 and len(builds) == 1  # (the suite's default is eager)
    assert capsys.readouterr().out.strip() == str(tiny_model_folder)
    llm = LLM(tiny_model_folder, device="cpu", kv_cache_gb=0.01, compile=True)  # the defaults pull compiled for
    forward = llm.llm_engine.runner.forward
    assert forward.compiled is not None and not forward.built and len(builds) == 1
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = ["Hello world", "The quick brown fox", "def main():"]
    batch = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    single = llm.generate(prompts[1], params, use_tqdm=False)[0].outputs[0].token_ids
    eager_llm = LLM(tiny_model_folder, device="cpu", kv_cache_gb=0.01, compile=False)
    eager = [o.outputs[0].token_ids for o in eager_llm.generate(prompts, params, use_tqdm=False)]
    assert batch == eager and single == eager[1]
    # Forked completions (their block copies done before a step, outside the package) and beams: the same tokens.
    from tokenloop import BeamSearchParams

    forked = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, n=2)
    assert [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, forked, use_tqdm=False)] == [
        [e, e] for e in eager
    ]
    beams = BeamSearchParams(beam_width=3, max_tokens=10)
    compiled_beams, eager_beams = (
        [[c.token_ids for c in o.outputs] for o in engine.beam_search(prompts, beams, use_tqdm=False)]
        for engine in (llm, eager_llm)
    )
    assert compiled_beams == eager_beams

    # A fresh process with the package cached: it loads the package and runs it, without torch's compiler.
    script = f"""
import sys
from tokenloop import LLM, SamplingParams
llm = LLM({str(tiny_model_folder)!r}, device="cpu", kv_cache_gb=0.01, compile=True)
forward = llm.llm_engine.runner.forward
out = llm.generate({prompts[1]!r}, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
print(forward.built, forward.compiled is not None, "torch._dynamo" in sys.modules, "torch._inductor" in sys.modules)
print(out[0].outputs[0].token_ids)
"""
    proc = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        env={**__import__("os").environ, "TOKENLOOP_HOME": str(tmp_path)},
    )
    assert proc.returncode == 0, proc.stderr
    flags, tokens = proc.stdout.strip().splitlines()[-2:]
    assert flags == "False True False False"  # loaded, not built; compiled; dynamo and inductor never imported
    assert tokens == str(single)


def test_a_first_start_runs_eager_while_one_child_compiles_then_switches_between_steps_to_the_same_tokens(
    tiny_model_folder, tiny_llm, tmp_path, monkeypatch
):
    """Two processes start on an empty cache: each runs at once, one background build happens (the other
    finds the package built), and a batch running meanwhile switches to the package between two steps."""
    from tokenloop import LLM

    monkeypatch.setenv("TOKENLOOP_HOME", str(tmp_path))
    other = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"""
from tokenloop import LLM
llm = LLM({str(tiny_model_folder)!r}, dtype="float32", device="cpu", kv_cache_gb=0.01, compile=True)
worker = llm.llm_engine.runner.forward.worker
print("started", worker is not None, flush=True)
worker.wait()
""",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    # This process starts once the other has: on a busy machine it could otherwise find the package built already.
    assert other.stdout.readline().split() == ["started", "True"]
    llm = LLM(tiny_model_folder, dtype="float32", device="cpu", kv_cache_gb=0.01, compile=True)
    forward = llm.llm_engine.runner.forward
    assert forward.worker is not None and forward.compiled is None  # eager at once, the build in a child
    threads = llm.llm_engine.executor.threads  # 1: the engine had one core to start with
    assert torch.get_num_threads() == max(1, threads - 1)  # a core left to the build meanwhile
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = ["Hello world", "The quick brown fox", "def main():"]
    engine = llm.llm_engine
    ids = [engine.add_request(p, params) for p in prompts]
    last, steps, steps_eager = {}, 0, 0
    while engine.has_unfinished_requests():
        if steps == 4:
            assert forward.worker.wait(timeout=300) == 0 and forward.compiled is None  # built, not yet switched to
        steps += 1
        for out in engine.step():
            last[out.request_id] = out
        steps_eager += forward.compiled is None
    assert forward.compiled is not None and steps_eager == 4  # the first step after the build ended ran the package
    assert torch.get_num_threads() == threads  # and the core is back
    eager = [o.outputs[0].token_ids for o in tiny_llm.generate(prompts, params, use_tqdm=False)]
    assert [last[i].outputs[0].token_ids for i in ids] == eager
    assert other.wait(timeout=300) == 0
    (log,) = (tmp_path / "compiled").glob("*.log")
    lines = log.read_text().splitlines()
    assert (
        sum(line.startswith("built ") for line in lines) == 1 and sum(line.startswith("found ") for line in lines) == 1
    ), lines
