"""Differential tests: scheduling never changes a token, nor a logprob.

A request run alone is the reference. Inside a batch of up to 64 others arriving and finishing around it, with
prefix-cache hits or without, in prefill chunks of 1, 7 or 64, preempted and recomputed, forked (n > 1, beam
search), in the compiled decode step, in another process with another hash seed and thread count, and
prefilled by one worker process and decoded by another (disaggregation/), it gets the same token ids and the same
logprobs, to the last bit: greedy and seeded sampling, on the float32 path and
the fast path (dtype "auto": float16 KV cache, the quantized kernels), beside requests of other LoRA adapters (whose
own tokens are theirs alone, too), for a tiny Llama, a tiny Gemma 3 (window 8,
every prompt longer) and a tiny K-quant Gemma 3 GGUF; and for the real models, SmolLM2 and gemma3-270m.

The older tests (float32 greedy token ids, against the shared tiny engine) also cover speculative decoding, a
failing request beside others, logits processors, structured output and prompt logprobs."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest
import torch

from tests.helpers import build_disaggregated_engine, build_llm, last_outputs, model_config
from tests.lora_helpers import write_random_adapter
from tokenloop import LLM, BeamSearchParams, LoRARequest, SamplingParams
from tokenloop.engine.input_processor import Prompt
from tokenloop.outputs import Logprob, RequestOutput

SHARED = "Hello world! Hello tokenizers, hello templates. " * 3
PROMPTS = [SHARED + tail for tail in ("The quick brown fox", "def main():", "Numbers like 12345", "I'm sure")] + [
    "so are emoji 😀 and 中文.",
    "The quick brown fox jumps over the lazy dog." * 2,
]
PARAMS = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)

Request = tuple[Prompt, SamplingParams | BeamSearchParams]
Completion = tuple[list[int], list[dict[int, Logprob]] | None, float | None]

LONG = (
    "def main():\n    print('hi')\n    return 0\n" * 4 + "I'm sure they'll say it's fine, don't you think? " * 3
)  # 100 tokens
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=3)


def seeded(seed: int, **changes) -> SamplingParams:
    return SamplingParams(
        **(
            {"temperature": 0.8, "top_p": 0.95, "seed": seed, "max_tokens": 24, "ignore_eos": True, "logprobs": 3}
            | changes
        )
    )


# The requests each schedule is checked on: every prompt (10 to 100 tokens, four sharing a 27-token prefix) greedy
# and seeded, with the chosen token's logprob and the top 3 at every step; and one at temperature alone, whose
# whole vocabulary races: in a step with it the top-p rows race in place too, without it from their listed support.
REQUESTS: list[Request] = (
    [(p, GREEDY) for p in [*PROMPTS, LONG]]
    + [(p, seeded(100 + i)) for i, p in enumerate([*PROMPTS, LONG])]
    + [(PROMPTS[2], seeded(120, temperature=1.0, top_p=1.0))]
)
# Requests whose sequences fork and share blocks: n = 4 seeded completions of one prompt, and beam searches.
FORKED: list[Request] = [
    (PROMPTS[0], seeded(7, n=4, max_tokens=16)),
    (PROMPTS[1], BeamSearchParams(beam_width=4, max_tokens=12)),
    (PROMPTS[5], BeamSearchParams(beam_width=4, max_tokens=12, ignore_eos=True)),
]


def completions(out: RequestOutput) -> list[Completion]:
    """What a request keeps whatever its schedule: each completion's token ids, its logprobs (the chosen token's
    and the top ones', with their ranks and text) and their sum."""
    assert out.error is None, out.error
    return [(c.token_ids, c.logprobs, c.cumulative_logprob) for c in out.outputs]


def run(llm: LLM, requests: list[Request], arrivals: list[int] | None = None) -> list[list[Completion]]:
    """Every request's completions, in order. Request i is queued before step arrivals[i] (all before the first
    step by default): later ones start while the others decode."""
    engine = llm.llm_engine
    arrivals = arrivals or [0] * len(requests)
    waiting = sorted(range(len(requests)), key=arrivals.__getitem__)
    index: dict[str, int] = {}
    finished: dict[int, list[Completion]] = {}
    step = 0
    while waiting or engine.has_unfinished_requests():
        if not engine.has_unfinished_requests():
            step = max(step, arrivals[waiting[0]])
        while waiting and arrivals[waiting[0]] <= step:
            i = waiting.pop(0)
            index[engine.add_request(*requests[i])] = i
        for out in engine.step():
            if out.finished:
                finished[index[out.request_id]] = completions(out)
        step += 1
    return [finished[i] for i in range(len(requests))]


def first_difference(got: list[Completion], expected: list[Completion]) -> str | None:
    """Where a request's completions first part from its reference's, in words; None if they do not."""
    if len(got) != len(expected):
        return f"{len(got)} completions, alone {len(expected)}"
    for j, ((ids, logprobs, total), (ref_ids, ref_logprobs, ref_total)) in enumerate(zip(got, expected)):
        step = next((k for k, (a, b) in enumerate(zip(ids, ref_ids)) if a != b), None)
        if step is not None:
            return f"completion {j}: token {step} is {ids[step]}, alone {ref_ids[step]}"
        if len(ids) != len(ref_ids):
            return f"completion {j}: {len(ids)} tokens, alone {len(ref_ids)}"
        step = next((k for k, (a, b) in enumerate(zip(logprobs or [], ref_logprobs or [])) if a != b), None)
        if step is not None:
            a, b = logprobs[step], ref_logprobs[step]
            moved = max((abs(a[t].logprob - b[t].logprob) for t in a.keys() & b.keys()), default=float("nan"))
            return f"completion {j}: the same tokens, logprobs differ from token {step} on (there by up to {moved:.2g})"
        if (logprobs, total) != (ref_logprobs, ref_total):
            return (
                f"completion {j}: the same tokens, logprobs {'differ' if logprobs != ref_logprobs else 'the same'}, "
                f"sum {total} alone {ref_total}"
            )
    return None


def assert_same(got: list[list[Completion]], expected: list[list[Completion]]) -> None:
    """Every request's completions exactly its reference's; the message says where each one that is not parts."""
    differences = [
        f"request {i}: {d}" for i, (g, e) in enumerate(zip(got, expected, strict=True)) if (d := first_difference(g, e))
    ]
    assert got == expected, f"{len(differences)} of {len(got)} requests differ:\n" + "\n".join(differences)


class Case(NamedTuple):
    name: str
    path: Path
    dtype: str
    kv_cache_dtype: str

    @property
    def engine_args(self) -> dict[str, str]:
        return {"dtype": self.dtype, "kv_cache_dtype": self.kv_cache_dtype}


MODELS = {"llama": "tiny_model_folder", "gemma3": "tiny_gemma3_folder", "kquant": "kquant_gguf"}
# (model, dtype[, KV cache dtype]): the exact path, the fast path, and the fast path over an int8 KV cache.
CASES = [case for model in MODELS for case in ((model, "float32"), (model, "auto"), (model, "auto", "int8"))]


def case_id(case: tuple[str, ...]) -> str:
    return "-".join(case)


def case_of(request, param: tuple[str, ...]) -> Case:
    model, dtype, *kv = param
    return Case(case_id(param), request.getfixturevalue(MODELS[model]), dtype, *(kv or ["auto"]))


@pytest.fixture(scope="module", params=CASES, ids=case_id)
def case(request) -> Case:
    return case_of(request, request.param)


@pytest.fixture(scope="module")
def alone_llm(case) -> LLM:
    """The reference engine: nothing shared between requests (no prefix cache), prompts in one chunk."""
    return build_llm(case.path, **case.engine_args, enable_prefix_caching=False)


@pytest.fixture(scope="module")
def alone(alone_llm) -> list[list[Completion]]:
    """Each request of REQUESTS run alone."""
    return [run(alone_llm, [r])[0] for r in REQUESTS]


def fillers(count: int, seed: int, vocab: int = 400) -> list[Request]:
    """Other requests to run beside the checked ones: 1 to 200 random prompt tokens, 1 to 40 new tokens (some
    may stop at EOS), greedy, seeded or unseeded sampling, with or without logprobs."""
    rng = random.Random(seed)
    return [
        (
            {"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(rng.choice([1, 3, 9, 17, 40, 90, 150, 200]))]},
            SamplingParams(
                temperature=rng.choice([0, 0.8, 1.0]),
                top_p=rng.choice([1.0, 0.9]),
                seed=rng.choice([None, 1000 + i]),
                max_tokens=rng.choice([1, 3, 8, 24, 40]),
                ignore_eos=rng.random() < 0.5,
                logprobs=rng.choice([None, 0, 5]),
            ),
        )
        for i in range(count)
    ]


def mixed(
    checked: list[Request], others: list[Request], seed: int, latest: int
) -> tuple[list[Request], list[int], list[int]]:
    """`checked` and `others` shuffled, each arriving at a random step up to `latest`: the batch, the arrivals and
    where each checked request landed."""
    rng = random.Random(seed)
    order = list(range(len(checked) + len(others)))
    rng.shuffle(order)
    everything = checked + others
    return (
        [everything[i] for i in order],
        [rng.randrange(latest + 1) for _ in order],
        [order.index(i) for i in range(len(checked))],
    )


def test_a_request_in_a_batch_of_64_arriving_and_finishing_around_it_gets_its_tokens_and_logprobs_alone(
    make_llm, case, alone
):
    llm = make_llm(case.path, **case.engine_args, kv_cache_gb=0.03)
    batch, arrivals, where = mixed(REQUESTS, fillers(64 - len(REQUESTS), seed=1), seed=2, latest=20)
    got = run(llm, batch, arrivals)
    assert_same([got[i] for i in where], alone)
    assert llm.llm_engine.scheduler.num_preemptions == 0  # preemption is a case of its own


def test_a_core_lent_to_input_work_every_other_step_changes_no_token_or_logprob(make_llm, case, alone, monkeypatch):
    """The server's step runs on one core fewer while input work is under way (engine/executor.py): a batch whose
    thread count changes from step to step gives each request its tokens (on one core the count stays 1)."""
    llm = make_llm(case.path, **case.engine_args, threads=None)  # the engine's own choice: it lends
    executor, step, counts = llm.llm_engine.executor, llm.llm_engine.step, []

    def lending_step():
        executor.lend_cores(len(counts) % 2)
        out = step()
        counts.append(torch.get_num_threads())
        return out

    monkeypatch.setattr(llm.llm_engine, "step", lending_step)
    assert_same(run(llm, REQUESTS), alone)
    assert len(set(counts)) == min(2, executor.threads)  # it did change, where there are cores to lend


def test_prefix_caching_off_changes_no_token_or_logprob(make_llm, case, alone):
    llm = make_llm(case.path, **case.engine_args, enable_prefix_caching=False)
    assert_same(run(llm, REQUESTS), alone)


def test_prefix_cache_hits_warm_change_no_token_or_logprob(make_llm, case, alone):
    """The batch fills the cache (each prompt comes twice, and four share a prefix: the later requests of one wait
    a step and take its blocks from the cache), then each request again, its whole prompt but the last token from
    the cache."""
    llm = make_llm(case.path, **case.engine_args)
    assert_same(run(llm, REQUESTS), alone)
    cold_hits = llm.llm_engine.block_manager.prefix_hit_tokens
    assert cold_hits > 0
    assert_same([run(llm, [r])[0] for r in REQUESTS], alone)
    assert llm.llm_engine.block_manager.prefix_hit_tokens > cold_hits


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_prefill_chunks_change_no_token_or_logprob(make_llm, case, alone, chunk):
    llm = make_llm(case.path, **case.engine_args, max_num_batched_tokens=chunk)
    assert_same(run(llm, REQUESTS), alone)


def test_preemption_changes_no_token_or_logprob(make_llm, case, alone):
    llm = make_llm(case.path, **case.engine_args, kv_blocks=10)
    assert_same(run(llm, REQUESTS), alone)
    assert llm.llm_engine.scheduler.num_preemptions > 0


def test_tracing_every_step_for_the_explorer_changes_no_token_or_logprob(make_llm, case, alone):
    """SamplingParams.trace (the explorer's record of each step's raw logits) on every request, in one batch."""
    llm = make_llm(case.path, **case.engine_args)
    traced = [(prompt, dataclasses.replace(params, trace=True)) for prompt, params in REQUESTS]
    assert_same(run(llm, traced), alone)


@pytest.mark.parametrize(
    "engine_args", [{}, {"max_num_batched_tokens": 7}, {"kv_blocks": 12}], ids=["batch", "chunked", "preempted"]
)
def test_forked_completions_and_beams_in_a_batch_get_their_tokens_and_logprobs_alone(
    make_llm, case, alone_llm, alone, engine_args
):
    """n = 4 completions and beams share their prompt's blocks (copy on write), beside the other requests."""
    expected = [run(alone_llm, [r])[0] for r in FORKED]
    llm = make_llm(case.path, **case.engine_args, **engine_args)
    batch, arrivals, where = mixed(FORKED + REQUESTS, [], seed=3, latest=6)
    got = run(llm, batch, arrivals)
    assert_same([got[i] for i in where], expected + alone)
    if "kv_blocks" in engine_args:
        assert llm.llm_engine.scheduler.num_preemptions > 0
    assert all(b.ref_count == 0 for b in llm.llm_engine.block_manager.blocks)


@pytest.fixture(scope="module")
def adapters(case, tmp_path_factory) -> list[LoRARequest]:
    """Two random LoRA adapters on the case's model, on every linear."""
    config = model_config(case.path)
    return [
        LoRARequest(name, str(write_random_adapter(tmp_path_factory.mktemp(f"lora_{case.name}_{name}"), config, seed)))
        for seed, name in enumerate(["a", "b"], start=1)
    ]


def test_base_and_adapter_requests_in_one_batch_with_prefix_caching_get_their_tokens_and_logprobs_alone(
    make_llm, case, alone, adapters
):
    """REQUESTS under the base model and under two adapters (the same prompts and shared prefixes, hashed apart by
    the adapter's identity), with others, in one batch: cold, then warm from the prefix cache. The base requests get
    an engine without adapters' tokens; each adapter's request gets its tokens alone."""
    with_adapters = [(prompt, params, None, False, lora) for lora in adapters for prompt, params in REQUESTS]
    alone_llm = make_llm(case.path, **case.engine_args, enable_prefix_caching=False, enable_lora=True)
    adapters_alone = [run(alone_llm, [r])[0] for r in with_adapters]
    for i in range(len(adapters)):  # each adapter changes tokens
        assert [c[0][0] for c in adapters_alone[i * len(REQUESTS) : (i + 1) * len(REQUESTS)]] != [
            c[0][0] for c in alone
        ]
    llm = make_llm(case.path, **case.engine_args, kv_cache_gb=0.03, enable_lora=True)
    batch, arrivals, where = mixed(REQUESTS + with_adapters, fillers(8, seed=4), seed=5, latest=10)
    for _ in ("cold", "warm"):
        got = run(llm, batch, arrivals)
        assert_same([got[i] for i in where], alone + adapters_alone)
    assert llm.llm_engine.block_manager.prefix_hit_tokens > 0


@pytest.mark.parametrize(
    "engine_args", [{"dtype": "float32"}, {"dtype": "auto"}, {"dtype": "auto", "kv_cache_dtype": "int8"}]
)
def test_a_context_past_one_attention_partition_gets_its_tokens_and_logprobs_alone(
    make_llm, long_context_model_folder, engine_args
):
    """Past 512 keys, attention takes a row's context in partitions and folds them: a sequence decoding alone on
    two threads gets one work item a partition, inside a batch (or on one thread) one item for all of a row's
    partitions. Greedy and seeded requests of 1,100 and 1,600 prompt tokens (three and four partitions: a fold of
    two is the same either way round): the same tokens and logprobs alone, in a batch of 24 arriving around them,
    and prefilled in chunks of 64 with the prefix cache on."""
    rng = random.Random(5)
    checked = [
        ({"prompt_token_ids": [rng.randrange(3, 400) for _ in range(n)]}, params)
        for n, params in ((1100, GREEDY), (1600, seeded(7)))
    ]
    alone_llm = make_llm(long_context_model_folder, **engine_args, kv_cache_gb=0.05, threads=2)
    alone = [run(alone_llm, [r])[0] for r in checked]
    batch, arrivals, at = mixed(checked, fillers(22, seed=5), seed=5, latest=20)
    in_batch = run(make_llm(long_context_model_folder, **engine_args, kv_cache_gb=0.05, threads=2), batch, arrivals)
    assert_same([in_batch[i] for i in at], alone)
    chunked = make_llm(long_context_model_folder, **engine_args, kv_cache_gb=0.05, max_num_batched_tokens=64)
    assert_same(run(chunked, checked), alone)


@pytest.mark.slow  # a first run builds each package (20 to 60 s on 2 cores); later ones load it from the cache
@pytest.mark.parametrize(
    "case", [("llama", "auto"), ("kquant", "auto"), ("llama", "auto", "int8")], ids=case_id, indirect=True
)
def test_the_compiled_decode_step_gives_eagers_tokens_and_logprobs_alone_and_in_a_batch(make_llm, case, alone):
    llm = make_llm(
        case.path, **case.engine_args, enable_prefix_caching=False, compile=True, compile_in_background=False
    )
    assert llm.llm_engine.runner.forward.compiled is not None
    assert_same([run(llm, [r])[0] for r in REQUESTS], alone)
    assert_same(run(llm, REQUESTS), alone)


@pytest.mark.parametrize(
    "case",
    [("llama", "float32"), ("llama", "auto"), ("gemma3", "auto"), ("llama", "auto", "int8")],
    ids=case_id,
    indirect=True,
)
def test_disaggregated_prefill_and_decode_workers_give_the_tokens_and_logprobs_alone(case, alone_llm, alone):
    """Every prompt computed by a prefill worker process, its blocks copied by a decode worker process that
    computes its last block and decodes: all at once, then again (the decode worker's prefix cache warm)."""
    expected = [run(alone_llm, [r])[0] for r in FORKED]
    engine = build_disaggregated_engine(case.path, **case.engine_args)
    try:
        for _ in range(2):
            got = asyncio.run(last_outputs(engine, FORKED + REQUESTS))
            assert_same([completions(out) for out in got], expected + alone)
        registry = engine.metrics.registry
        assert registry.get_sample_value("tokenloop_pd_blocks_copied_total") > 0
        assert registry.get_sample_value("tokenloop_pd_blocks_skipped_total") > 0  # the second time
    finally:
        engine.shutdown()


ROOT = Path(__file__).resolve().parents[2]
OTHER_PROCESS = """
import dataclasses, json, sys
from tests.engine.test_differential import REQUESTS, run
from tests.helpers import build_llm
cases = json.loads(sys.argv[1])
results = {name: run(build_llm(path, threads=1, **args), REQUESTS) for name, (path, args) in cases.items()}
print(json.dumps(results, default=dataclasses.astuple))
"""


@pytest.fixture(scope="module")
def other_process(request) -> dict[str, list]:
    """REQUESTS as one batch, per case, in a child process with another hash seed and one thread, as JSON."""
    cases = {c.name: (str(c.path), c.engine_args) for c in (case_of(request, param) for param in CASES)}
    hash_seed = "2" if os.environ.get("PYTHONHASHSEED") == "1" else "1"
    env = os.environ | {"PYTHONHASHSEED": hash_seed, "TOKENLOOP_COMPILE": "0"}
    proc = subprocess.run(
        [sys.executable, "-c", OTHER_PROCESS, json.dumps(cases)],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


def test_another_process_with_another_hash_seed_and_thread_count_gives_the_same_tokens_and_logprobs(
    make_llm, case, other_process
):
    """Here two threads and this process's hash seed; there one thread and PYTHONHASHSEED=1 (the same schedule)."""
    got = run(make_llm(case.path, **case.engine_args, threads=2), REQUESTS)
    assert json.loads(json.dumps(got, default=dataclasses.astuple)) == other_process[case.name]


# The real models, on their default path (dtype "auto"): a prompt of about 600 tokens, longer than gemma3-270m's
# 512-token sliding window, and a short one, each greedy and seeded with the top 5 logprobs.
REAL_LONG = " ".join(
    f"Item {i}: the {('red', 'green', 'blue')[i % 3]} box holds {i * 7 % 13} apples." for i in range(48)
)
REAL_PARAMS = [
    SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=5),
    SamplingParams(temperature=0.8, top_p=0.95, seed=11, max_tokens=24, ignore_eos=True, logprobs=5),
]
REAL_REQUESTS: list[Request] = [(p, sp) for p in (REAL_LONG, "Write a haiku about the sea.") for sp in REAL_PARAMS]
REAL_OTHERS: list[Request] = [
    (prompt, SamplingParams(temperature=t, seed=s, max_tokens=m, logprobs=lp))
    for prompt, t, s, m, lp in [
        ("Hi!", 0, None, 4, None),
        ("What is 2 + 2?", 0.8, 5, 16, 2),
        ("Name three colours.", 1.0, None, 32, None),
        ("The capital of France is", 0, None, 8, 0),
        ("Tell me a story about a fox.", 0.7, 9, 28, 5),
        ("Translate 'cat' to French.", 0, None, 12, None),
        (REAL_LONG[:900], 0.8, 13, 6, None),
        ("Count to five:", 0, None, 20, 1),
        ("Why is the sky blue?", 1.0, 17, 3, None),
        ("List two fruits.", 0, None, 24, None),
        ("Say hello in Spanish.", 0.9, None, 10, 3),
        ("Once upon a time", 0, None, 30, None),
    ]
]
REAL_MODELS = {"smollm2 default": None, "gemma3-270m": "gemma3-270m"}


@pytest.fixture(scope="module", params=list(REAL_MODELS))
def real_model(request) -> str | None:
    return REAL_MODELS[request.param]


@pytest.fixture(scope="module")
def real_llm(real_model) -> LLM:
    return build_llm(real_model, dtype="auto", device=None, kv_cache_gb=0.25, enable_prefix_caching=False)


@pytest.fixture(scope="module")
def real_alone(real_llm) -> list[list[Completion]]:
    return [run(real_llm, [r])[0] for r in REAL_REQUESTS]


@pytest.mark.real_model
def test_a_real_models_request_in_a_batch_of_16_gets_its_tokens_and_logprobs_alone(real_llm, real_alone):
    window = real_llm.llm_engine.model_config.sliding_window
    assert window is None or len(real_llm.get_tokenizer().encode(REAL_LONG)) > window  # gemma3-270m: 512
    batch, arrivals, where = mixed(REAL_REQUESTS, REAL_OTHERS, seed=4, latest=12)
    got = run(real_llm, batch, arrivals)
    assert_same([got[i] for i in where], real_alone)


@pytest.mark.real_model
def test_a_real_models_prefill_in_chunks_of_64_changes_no_token_or_logprob(make_llm, real_model, real_alone):
    llm = make_llm(
        real_model, dtype="auto", device=None, kv_cache_gb=0.25, enable_prefix_caching=False, max_num_batched_tokens=64
    )
    assert_same([run(llm, [r])[0] for r in REAL_REQUESTS], real_alone)


# The float32 greedy tests on the shared tiny engine: token ids.


@pytest.fixture(scope="module")
def reference(tiny_llm):
    return [o.outputs[0].token_ids for o in tiny_llm.generate(PROMPTS, PARAMS, use_tqdm=False)]


def test_prefix_caching_off_gives_the_same_tokens(make_llm, tiny_model_folder, reference):
    llm = make_llm(tiny_model_folder, enable_prefix_caching=False)
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)] == reference


def test_prefix_caching_on_with_shared_prefixes_gives_the_same_tokens(make_llm, tiny_model_folder, reference):
    llm = make_llm(tiny_model_folder)
    for prompt, expected in zip(PROMPTS, reference):  # one by one, so later prompts hit the shared prefix
        out = llm.generate(prompt, PARAMS, use_tqdm=False)[0]
        assert out.outputs[0].token_ids == expected
    assert llm.llm_engine.block_manager.prefix_hit_tokens > 0


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_chunked_prefill_gives_the_same_tokens(make_llm, tiny_model_folder, reference, chunk):
    llm = make_llm(tiny_model_folder, max_num_batched_tokens=chunk)
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)] == reference


@pytest.mark.parametrize("method", ["ngram", "draft", "eagle"])
@pytest.mark.parametrize("prefix_caching", [True, False], ids=["prefix cache", "no prefix cache"])
def test_speculative_decoding_gives_the_same_tokens(
    make_llm, tiny_model_folder, tiny_drafter_folder, reference, method, prefix_caching
):
    # Drafts every step (adaptive off); the draft model is the tiny model itself in bfloat16 (close, not equal); the
    # EAGLE head drafts the last token again.
    spec = (
        {"method": method, "num_speculative_tokens": 3, "adaptive": False}
        | ({"model": str(tiny_model_folder), "dtype": "bfloat16"} if method == "draft" else {})
        | ({"model": str(tiny_drafter_folder)} if method == "eagle" else {})
    )
    llm = make_llm(tiny_model_folder, enable_prefix_caching=prefix_caching, speculative_config=spec)
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)] == reference
    stats = llm.llm_engine.speculator.stats
    # These prompts' continuations repeat no token: the echoing head's drafts are all rejected (test_eagle.py's
    # prompts have them accepted).
    assert stats.num_accepted_tokens > 0 if method != "eagle" else stats.num_draft_tokens > 0


@pytest.mark.parametrize("method", ["ngram", "eagle"])
def test_speculative_decoding_over_an_int8_kv_cache_gives_its_tokens(
    make_llm, tiny_model_folder, tiny_drafter_folder, method
):
    """Drafts verified over an int8 cache (the EAGLE head's own cache int8 too): the tokens of the int8 cache alone."""
    spec = {"method": method, "num_speculative_tokens": 3, "adaptive": False} | (
        {"model": str(tiny_drafter_folder)} if method == "eagle" else {}
    )
    alone = make_llm(tiny_model_folder, dtype="auto", kv_cache_dtype="int8")
    llm = make_llm(tiny_model_folder, dtype="auto", kv_cache_dtype="int8", speculative_config=spec)
    expected = [o.outputs[0].token_ids for o in alone.generate(PROMPTS, PARAMS, use_tqdm=False)]
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)] == expected
    assert llm.llm_engine.speculator.stats.num_draft_tokens > 0


@pytest.mark.parametrize("chunk", [7, 64])
def test_an_eagle_drafter_in_a_batch_of_32_with_chunked_prefill_changes_no_token(
    make_llm, tiny_model_folder, tiny_drafter_folder, reference, chunk
):
    spec = {"method": "eagle", "model": str(tiny_drafter_folder), "num_speculative_tokens": 3}
    llm = make_llm(tiny_model_folder, max_num_batched_tokens=chunk, speculative_config=spec)
    batch = (PROMPTS * 6)[:32]
    assert [o.outputs[0].token_ids for o in llm.generate(batch, PARAMS, use_tqdm=False)] == (reference * 6)[:32]


def test_a_request_alone_equals_it_inside_a_batch_of_32(tiny_llm):
    batch = (PROMPTS * 6)[:32]
    together = tiny_llm.generate(batch, PARAMS, use_tqdm=False)
    alone = {p: tiny_llm.generate(p, PARAMS, use_tqdm=False)[0].outputs[0].token_ids for p in PROMPTS}
    assert [o.outputs[0].token_ids for o in together] == [alone[p] for p in batch]


@pytest.mark.parametrize(
    "engine_args",
    [{"enable_prefix_caching": False}, {"max_num_batched_tokens": 7}, {}],
    ids=["no prefix cache", "chunked", "default"],
)
def test_a_request_failing_beside_the_others_changes_none_of_their_tokens(
    make_llm, tiny_model_folder, tiny_llm, reference, engine_args
):
    tokenizer = tiny_llm.get_tokenizer()
    marker = max(set(range(400)) - {t for p in PROMPTS for t in tokenizer.encode(p)})  # in no prompt but the victim's
    llm = make_llm(tiny_model_folder, inject_faults=(f"sample:{marker}",), **engine_args)
    engine = llm.llm_engine
    ids = [engine.add_request(p, PARAMS) for p in PROMPTS]
    victim = engine.add_request([5, marker, 6], PARAMS)
    last = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            last[out.request_id] = out
    assert last[victim].error is not None
    assert [last[i].outputs[0].token_ids for i in ids] == reference


PENALIZED = SamplingParams(
    temperature=0,
    max_tokens=24,
    ignore_eos=True,
    repetition_penalty=1.3,
    frequency_penalty=0.5,
    presence_penalty=0.3,
    no_repeat_ngram_size=2,
    logit_bias={7: 2.0},
    bad_words=["hello"],
)


@pytest.fixture(scope="module")
def penalized_reference(tiny_llm):
    return [o.outputs[0].token_ids for o in tiny_llm.generate(PROMPTS, PENALIZED, use_tqdm=False)]


@pytest.mark.parametrize(
    "engine_args",
    [{"enable_prefix_caching": False}, {"max_num_batched_tokens": 7}, {"kv_blocks": 8}],
    ids=["no prefix cache", "chunked", "preempted"],
)
def test_logits_processors_give_the_same_tokens_whatever_the_scheduling(
    make_llm, tiny_model_folder, penalized_reference, engine_args
):
    llm = make_llm(tiny_model_folder, **engine_args)
    outs = llm.generate(PROMPTS, PENALIZED, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == penalized_reference
    if "kv_blocks" in engine_args:
        assert llm.llm_engine.scheduler.num_preemptions > 0


def test_logits_processors_alone_equal_them_inside_a_batch_of_32_with_plain_rows(
    tiny_llm, penalized_reference, reference
):
    batch = (PROMPTS * 6)[:32]
    params = [PENALIZED if i % 2 else PARAMS for i in range(32)]
    together = [o.outputs[0].token_ids for o in tiny_llm.generate(batch, params, use_tqdm=False)]
    index = {p: i for i, p in enumerate(PROMPTS)}
    expected = [(penalized_reference if i % 2 else reference)[index[p]] for i, p in enumerate(batch)]
    assert together == expected and penalized_reference != reference


def test_a_penalty_below_float32s_range_samples_the_same_tokens_alone_batched_and_chunked(
    tiny_llm, make_llm, tiny_model_folder
):
    """repetition_penalty 1e-40 (float32 rounds it past its range: issue 37's schemathesis case) on seeded top-p
    rows: alone, every other row of a batch of 32 beside plain seeded rows, and chunked without prefix caching."""
    tiny = seeded(5, max_tokens=16, repetition_penalty=1e-40, logprobs=None)
    alone = [o.outputs[0].token_ids for o in tiny_llm.generate(PROMPTS, tiny, use_tqdm=False)]
    batch = (PROMPTS * 6)[:32]
    params = [tiny if i % 2 else seeded(i, max_tokens=16, logprobs=None) for i in range(32)]
    together = [o.outputs[0].token_ids for o in tiny_llm.generate(batch, params, use_tqdm=False)]
    index = {p: i for i, p in enumerate(PROMPTS)}
    assert [together[i] for i in range(1, 32, 2)] == [alone[index[batch[i]]] for i in range(1, 32, 2)]
    chunked = make_llm(tiny_model_folder, max_num_batched_tokens=7, enable_prefix_caching=False)
    assert [o.outputs[0].token_ids for o in chunked.generate(PROMPTS, tiny, use_tqdm=False)] == alone


@pytest.mark.parametrize(
    "engine_args",
    [{"enable_prefix_caching": False}, {"max_num_batched_tokens": 7}, {}],
    ids=["no prefix cache", "chunked", "default"],
)
def test_structured_output_gives_the_same_tokens_whatever_the_scheduling(
    make_llm, tiny_model_folder, tiny_llm, engine_args
):
    from tokenloop.sampling.structured import StructuredOutputsParams

    params = SamplingParams(
        temperature=0.9, seed=4, max_tokens=24, structured_outputs=StructuredOutputsParams(regex=r"[a-z]{4,12}\.")
    )
    expected = [o.outputs[0].token_ids for o in tiny_llm.generate(PROMPTS, params, use_tqdm=False)]
    outs = make_llm(tiny_model_folder, **engine_args).generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert all(o.outputs[0].finish_reason == "stop" for o in outs)


SCORED = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, prompt_logprobs=3)


@pytest.fixture(scope="module")
def teacher_forced(tiny_model_folder, tiny_llm):
    """Per prompt: log P(token i | tokens before it), from one forward over the whole prompt."""
    import torch

    from tests.helpers import forward_in_chunks
    from tokenloop.models.loader import load_model

    loaded = load_model(tiny_model_folder, torch.float32, torch.device("cpu"), load_tokenizer=False)
    tokenizer = tiny_llm.get_tokenizer()
    expected = []
    for prompt in PROMPTS:
        ids = tokenizer.encode(prompt)
        logprobs = forward_in_chunks(loaded, ids, [len(ids)]).log_softmax(-1)
        expected.append([logprobs[i - 1, t].item() for i, t in enumerate(ids) if i])
    return expected


@pytest.mark.parametrize(
    "engine_args",
    [
        {"enable_prefix_caching": False},
        {"max_num_batched_tokens": 7},
        {"kv_blocks": 8, "max_num_batched_tokens": 16},
        {},
    ],
    ids=["no prefix cache", "chunked", "preempted", "prefix cache warm"],
)
def test_prompt_logprobs_are_the_teacher_forced_ones_whatever_the_scheduling(
    make_llm, tiny_model_folder, reference, teacher_forced, engine_args
):
    llm = make_llm(tiny_model_folder, **engine_args)
    if not engine_args:  # every prompt already in the prefix cache: scoring must still compute each position
        llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    batch = (PROMPTS * 6)[:32] if not engine_args else PROMPTS
    params = [SCORED if i % 2 == 0 else PARAMS for i in range(len(batch))]
    outs = llm.generate(batch, params, use_tqdm=False)
    for i, (prompt, out) in enumerate(zip(batch, outs)):
        k = PROMPTS.index(prompt)
        assert out.outputs[0].token_ids == reference[k][: len(out.outputs[0].token_ids)]
        if i % 2:
            assert out.prompt_logprobs is None
            continue
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(out.prompt_token_ids)
        got = [entries[t].logprob for entries, t in zip(out.prompt_logprobs[1:], out.prompt_token_ids[1:])]
        assert got == pytest.approx(teacher_forced[k], abs=1e-4)
        assert all(3 <= len(entries) <= 4 for entries in out.prompt_logprobs[1:])
    if "kv_blocks" in engine_args:
        assert llm.llm_engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize(
    "engine_args",
    [{"enable_prefix_caching": False}, {"max_num_batched_tokens": 7}, {"kv_blocks": 10}],
    ids=["no prefix cache", "chunked", "preempted"],
)
def test_forked_completions_and_beams_are_the_same_whatever_the_scheduling(
    make_llm, tiny_model_folder, tiny_llm, engine_args
):
    forked = SamplingParams(temperature=1.0, seed=5, max_tokens=16, ignore_eos=True, n=4)
    beams = BeamSearchParams(beam_width=4, max_tokens=12)
    expected = (
        [[c.token_ids for c in o.outputs] for o in tiny_llm.generate(PROMPTS[:3], forked, use_tqdm=False)],
        [[c.token_ids for c in o.outputs] for o in tiny_llm.beam_search(PROMPTS[:3], beams, use_tqdm=False)],
    )
    llm = make_llm(tiny_model_folder, **engine_args)
    got = (
        [[c.token_ids for c in o.outputs] for o in llm.generate(PROMPTS[:3], forked, use_tqdm=False)],
        [[c.token_ids for c in o.outputs] for o in llm.beam_search(PROMPTS[:3], beams, use_tqdm=False)],
    )
    assert got == expected
    if "kv_blocks" in engine_args:
        assert llm.llm_engine.scheduler.num_preemptions > 0
    assert all(b.ref_count == 0 for b in llm.llm_engine.block_manager.blocks)


@pytest.mark.parametrize("prefix_caching", [True, False], ids=["prefix cache", "no prefix cache"])
@pytest.mark.parametrize(
    "engine_args", [{}, {"kv_blocks": 6, "max_num_batched_tokens": 16}], ids=["roomy pool", "blocks given back"]
)
def test_sliding_window_layers_give_a_request_alone_the_tokens_it_gets_inside_a_batch_of_32(
    make_llm, tiny_gemma3_folder, prefix_caching, engine_args
):
    """Gemma 3's per-layer windows (8 tokens, the prompts cross several): batch composition, shared prefixes
    and long prompt chunks (attended in window pieces) change no token; nor does a pool that holds the sequences
    only because the sliding layers' KV cache groups give back the blocks behind their windows (preempting)."""
    llm = make_llm(tiny_gemma3_folder, enable_prefix_caching=prefix_caching, **engine_args)
    batch = (PROMPTS * 6)[:32]
    together = llm.generate(batch, PARAMS, use_tqdm=False)
    alone = {p: llm.generate(p, PARAMS, use_tqdm=False)[0].outputs[0].token_ids for p in PROMPTS}
    assert [o.outputs[0].token_ids for o in together] == [alone[p] for p in batch]
    window = llm.llm_engine.model_config.sliding_window
    assert min(len(o.prompt_token_ids) for o in together) > window  # every prompt's prefill attends in window pieces
    assert (
        min(len(o.prompt_token_ids) + len(o.outputs[0].token_ids) for o in together) > 2 * window
    )  # decodes cross windows
    assert llm.llm_engine.block_manager.num_released_blocks > 0
