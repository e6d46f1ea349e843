"""A Gemma 3 GGUF of K-quants through the engine's fast path (dtype "auto", the CPU kernels), its formats mixed
as gemma-3-270m's Q4_K_M file mixes them (that file's first six layers):
- every matrix stays in its file's integers, in the module and layout its format maps to, and holds the weights
  the float32 path dequantizes with gguf;
- the fast path's logprobs are as close to the float32 path's as a bfloat16 run of the same weights is, while a
  fast path that misread one format (the file changed as the misreading would read it) is outside that;
- scheduling (alone, a batch, prefix-cache hits, prefill chunks of 1, 7 and 64) gives greedy choices of the fast
  path itself, teacher-forced, and that pass's logprobs, both up to rounding, while a window one key too wide
  is far from them.

Why "up to rounding" and not the same tokens: the int8 activations turn a last-bit difference (SDPA over a
lone chunk or a padded batch sums in a different order) into a jump of one int8 step now and then, about 1e-3
of a product; on this random model such differences reach 0.1 within 16 decode steps and flip its near-ties
(tests/engine/test_compiled_decode.py compares compiled and eager steps the same way).

gguf-py cannot quantize to K-quants: the tensors are random blocks (tests/models/test_ggml_types.py), their
float16 scales sized so that each product keeps its activations near unit scale."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from tests.gguf_files import random_blocks
from tests.helpers import build_llm
from tokenloop import LLM, SamplingParams
from tokenloop.kernels import cpu_kernels_available
from tokenloop.models.quant import Int4Linear, Int5Linear, Int8Embedding, Int8Linear, QuantLayout
from tokenloop.outputs import CompletionOutput, Logprob

Q = gguf.GGMLQuantizationType
HIDDEN, HEADS, HEAD_DIM, FFN, WINDOW = 96, 4, 64, 256, 8  # K-quant rows need K % 256 == 0: o_proj (4 x 64), down
# gemma-3-270m-q4_k_m.gguf, layers 0-5: q, k, gate, up are Q5_0 (its 640 columns are no multiple of 256, nor
# are these 96), attn_output Q4_K; attn_v and ffn_down alternate as here. The token embedding is Q8_0, tied.
V_TYPES = [Q.Q8_0, Q.Q8_0, Q.Q5_0, Q.Q5_0, Q.Q8_0, Q.Q5_0]
DOWN_TYPES = [Q.Q6_K, Q.Q6_K, Q.Q4_K, Q.Q4_K, Q.Q6_K, Q.Q4_K]
# The float16 fields' range per type: weights of standard deviation about 1/sqrt(K) (K = 96, or 256 for the
# K-quants), as a trained model's, so that activations stay near unit scale through the six layers.
HALF_RANGE = {Q.Q5_0: 0.02, Q.Q8_0: 0.0025, Q.Q4_K: 0.0003, Q.Q6_K: 0.00008}
# With a tied head, a last hidden state made mostly of the token's own embedding picks that token again and
# again: a small embedding, and the layers' outputs scaled up by their post-norms, keep the continuations varied.
EMBEDDING_HALF_RANGE, POST_NORM = 0.001, 3.0
OUTPUT_NORM = 8.0  # logits of standard deviation about 3.3: a greedy token's logprob mostly -1.3 to 0


def misread_q4_k_mins(b: np.ndarray) -> None:
    b[..., 2:4] = 0  # dmin = 0: w = d sc q, as a loader that forgot the mins would compute


def misread_q6_k_scales(b: np.ndarray) -> None:
    b[..., 193:208:2] = b[..., 192:208:2]  # each scale of 16 weights also read for the next 16: one per 32


def misread_q5_0_high_bits(b: np.ndarray) -> None:
    b[..., 2:6] = 0  # no fifth bit


MISREADINGS = {Q.Q4_K: misread_q4_k_mins, Q.Q6_K: misread_q6_k_scales, Q.Q5_0: misread_q5_0_high_bits}


def write_kquant_gemma3(path: Path, tokenizer_folder: Path, misread: Q | None = None, window: int = WINDOW) -> Path:
    """A six-layer gemma3 GGUF (five sliding layers, one global) with the tiny tokenizer's vocabulary; with
    `misread`, that type's blocks are changed as MISREADINGS says (the file a wrong loader would see)."""
    bpe = json.loads((tokenizer_folder / "tokenizer.json").read_text())["model"]
    tokens = [t for t, _ in sorted(bpe["vocab"].items(), key=lambda kv: kv[1])]
    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_block_count(len(V_TYPES))
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(1)
    w.add_key_length(HEAD_DIM)
    w.add_value_length(HEAD_DIM)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(1_000_000.0)
    w.add_sliding_window(window)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in bpe["merges"]])
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
    rng, seeds = np.random.default_rng(0), itertools.count()

    def matrix(name: str, qtype: Q, rows: int, cols: int, half_range: float | None = None) -> None:
        data = random_blocks(qtype, rows, cols, next(seeds), half_range or HALF_RANGE[qtype])
        if qtype == misread:  # on a view of the rows as blocks
            MISREADINGS[qtype](data.reshape(rows, -1, gguf.GGML_QUANT_SIZES[qtype][1]))
        w.add_tensor(name, data, raw_dtype=qtype)

    def norm(name: str, size: int, base: float = 1.0) -> None:  # stored as 1 + w, as llama.cpp's converter does
        w.add_tensor(name, (base + rng.normal(0.0, 0.3, size)).astype(np.float32))

    matrix("token_embd.weight", Q.Q8_0, len(tokens), HIDDEN, EMBEDDING_HALF_RANGE)
    norm("output_norm.weight", HIDDEN, OUTPUT_NORM)
    for i, (v_type, down_type) in enumerate(zip(V_TYPES, DOWN_TYPES)):
        for part in ("attn_norm", "ffn_norm"):
            norm(f"blk.{i}.{part}.weight", HIDDEN)
        for part in ("post_attention_norm", "post_ffw_norm"):
            norm(f"blk.{i}.{part}.weight", HIDDEN, POST_NORM)
        norm(f"blk.{i}.attn_q_norm.weight", HEAD_DIM)
        norm(f"blk.{i}.attn_k_norm.weight", HEAD_DIM)
        matrix(f"blk.{i}.attn_q.weight", Q.Q5_0, HEADS * HEAD_DIM, HIDDEN)
        matrix(f"blk.{i}.attn_k.weight", Q.Q5_0, HEAD_DIM, HIDDEN)
        matrix(f"blk.{i}.attn_v.weight", v_type, HEAD_DIM, HIDDEN)
        matrix(f"blk.{i}.attn_output.weight", Q.Q4_K, HIDDEN, HEADS * HEAD_DIM)
        matrix(f"blk.{i}.ffn_gate.weight", Q.Q5_0, FFN, HIDDEN)
        matrix(f"blk.{i}.ffn_up.weight", Q.Q5_0, FFN, HIDDEN)
        matrix(f"blk.{i}.ffn_down.weight", down_type, HIDDEN, FFN)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


_ids = torch.randint(3, 400, (60,), generator=torch.Generator().manual_seed(2)).tolist()
# 40-token prompts sharing their first 32 tokens (two blocks of 16, what prefix caching can share), a longer one,
# and one shorter than the window.
PROMPTS = [_ids[:32] + _ids[32 + i : 40 + i] for i in range(3)] + [_ids, _ids[:5]]
GREEDY = SamplingParams(temperature=0, max_tokens=16, logprobs=0, ignore_eos=True)
# What rounding may move a logprob by between two schedules of the fast path (logits of standard deviation 3.3):
# up to 0.13 was measured here over six sets of random weights; a window one key too wide moves them by 5 to 15.
ROUNDING = 0.25


# The fast path (dtype "auto"); prefix caching off but where a test turns it on.
FAST = {"dtype": "auto", "enable_prefix_caching": False}


@pytest.fixture(scope="module")
def fast(kquant_gguf) -> LLM:
    return build_llm(kquant_gguf, **FAST)


@pytest.fixture(scope="module")
def exact(kquant_gguf) -> LLM:
    return build_llm(kquant_gguf, dtype="float32", enable_prefix_caching=False)


@pytest.fixture(scope="module")
def alone(fast) -> list[CompletionOutput]:
    """The fast path's greedy completions, each prompt alone."""
    return [fast.generate({"prompt_token_ids": p}, GREEDY, use_tqdm=False)[0].outputs[0] for p in PROMPTS]


def test_every_matrix_stays_in_its_files_integers_with_the_float32_paths_weights(fast, exact):
    q5_0, q8_0 = (Int5Linear, QuantLayout(5, torch.float16)), (Int8Linear, QuantLayout(8, torch.float16))
    q4_k, q6_k = QuantLayout(4, torch.uint8), QuantLayout(8, torch.int8, group=16)  # the file's integer scales
    model, reference = fast.llm_engine.runner.model, exact.llm_engine.runner.model
    for i, (layer, expected) in enumerate(zip(model.layers, reference.layers, strict=True)):
        modules = {
            # Q5_0 q and k with a Q5_0 v stay 5-bit; with a Q8_0 v they widen to int8 together (exact)
            "self_attn.qkv_proj": q5_0 if V_TYPES[i] == Q.Q5_0 else q8_0,
            "self_attn.o_proj": (Int4Linear, q4_k),
            "mlp.gate_up_proj": q5_0,
            "mlp.down_proj": (Int8Linear, q6_k) if DOWN_TYPES[i] == Q.Q6_K else (Int4Linear, q4_k),
        }
        for name, (cls, layout) in modules.items():
            module = layer.get_submodule(name)
            assert type(module) is cls and module.layout == layout, f"layer {i} {name}: {module}"
            assert module.cpu_kernel == cpu_kernels_available()
            weight = module.weight_int4() if cls is Int4Linear else module.weight_int8()
            assert torch.equal(weight.dequantize(), expected.get_submodule(name).weight), f"layer {i} {name}"
    assert type(model.embed_tokens) is Int8Embedding and model.lm_head is model.embed_tokens  # Q8_0, tied
    assert torch.equal(model.embed_tokens.weight_int8().dequantize(), reference.embed_tokens.weight)


def scored(llm: LLM, sequences: list[list[int]], top: int) -> list[list[dict[int, Logprob]]]:
    """Teacher-forced, in one pass: each sequence's prompt logprobs (its token's and the top `top`) at positions
    1 onwards."""
    params = SamplingParams(max_tokens=1, prompt_logprobs=top)
    return [
        out.prompt_logprobs[1:]
        for out in llm.generate([{"prompt_token_ids": s} for s in sequences], params, use_tqdm=False)
    ]


def token_logprobs(llm: LLM, sequences: list[list[int]]) -> torch.Tensor:
    """The logprob of every token of `sequences` after their first, teacher-forced, in one flat tensor."""
    return torch.tensor(
        [step[t].logprob for s, steps in zip(sequences, scored(llm, sequences, 0)) for step, t in zip(steps, s[1:])]
    )


def rms(x: torch.Tensor) -> float:
    return float(x.square().mean().sqrt())


@pytest.fixture(scope="module")
def sequences(alone) -> list[list[int]]:
    """The prompts and the fast path's greedy continuations: tokens a generation visits, not only random ones."""
    return [p + out.token_ids for p, out in zip(PROMPTS, alone)]


@pytest.fixture(scope="module")
def float32_logprobs(exact, sequences) -> torch.Tensor:
    return token_logprobs(exact, sequences)


@pytest.fixture(scope="module")
def tolerance(kquant_gguf, sequences, float32_logprobs) -> float:
    """Three times the distance (RMS over the positions) from float32 of a bfloat16 run of the same weights. Its
    8-bit mantissas round each weight and activation by up to 2^-9; the int8 activations round each by up to
    1/254 of its block's largest value: errors of one order. Measured over six sets of random weights, the fast
    path was 0.6 to 1.7 times bfloat16's distance."""
    bfloat16 = build_llm(kquant_gguf, dtype="bfloat16", enable_prefix_caching=False)
    return 3 * rms(token_logprobs(bfloat16, sequences) - float32_logprobs)


def test_the_fast_paths_logprobs_are_as_close_to_float32_as_bfloat16s(fast, sequences, float32_logprobs, tolerance):
    assert rms(token_logprobs(fast, sequences) - float32_logprobs) <= tolerance


@pytest.mark.parametrize("qtype", list(MISREADINGS), ids=lambda q: q.name)
def test_a_fast_path_that_misread_one_format_would_be_outside_that_tolerance(
    make_llm, kquant_folder, sequences, float32_logprobs, tolerance, qtype
):
    """The check above can fail: each misreading of MISREADINGS, the fast path run on the file as it would read
    it, is 1.8 to 25 times the tolerance away (the Q4_K mins, the smallest part of their weights, the least)."""
    misread = make_llm(
        write_kquant_gemma3(kquant_folder / f"misread_{qtype.name}.gguf", kquant_folder, misread=qtype), **FAST
    )
    assert rms(token_logprobs(misread, sequences) - float32_logprobs) > tolerance


def distance_from_greedy(llm: LLM, prompts: list[list[int]], completions: list[CompletionOutput]) -> float:
    """The most by which a completion's token falls short of `llm`'s greedy choice, teacher-forced on the same
    tokens in one pass, or by which its logprob differs from that pass's."""
    forced = scored(llm, [p + c.token_ids for p, c in zip(prompts, completions)], top=1)
    distance = 0.0
    for prompt, completion, steps in zip(prompts, completions, forced, strict=True):
        for token, step, got in zip(completion.token_ids, steps[len(prompt) - 1 :], completion.logprobs, strict=True):
            best = max(lp.logprob for lp in step.values())
            distance = max(distance, best - step[token].logprob, abs(got[token].logprob - step[token].logprob))
    return distance


@pytest.mark.parametrize(
    "schedule", ["alone", "batch of 16", "prefix cache hits", "chunks of 1", "chunks of 7", "chunks of 64"]
)
def test_scheduling_gives_the_fast_paths_greedy_choices(make_llm, kquant_gguf, fast, alone, schedule):
    """Alone: decode steps (the paged decode kernel) against the teacher-forced prefill (SDPA). The others with
    prefix caching on, but the batch's."""
    requests, prompts = [{"prompt_token_ids": p} for p in PROMPTS], PROMPTS
    if schedule == "alone":
        completions = alone
    elif schedule == "batch of 16":
        prompts = (PROMPTS * 4)[:16]
        completions = [
            out.outputs[0] for out in fast.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
        ]
    elif schedule == "prefix cache hits":  # one by one: the later prompts start from the first one's two blocks
        llm = make_llm(kquant_gguf, dtype="auto")  # prefix caching on, as by default
        completions = [llm.generate(r, GREEDY, use_tqdm=False)[0].outputs[0] for r in requests]
        assert llm.llm_engine.block_manager.prefix_hit_tokens > 0
    else:  # all prompts at once: their chunks share steps with the decodes of those done
        llm = make_llm(kquant_gguf, dtype="auto", max_num_batched_tokens=int(schedule.split()[-1]))
        completions = [out.outputs[0] for out in llm.generate(requests, GREEDY, use_tqdm=False)]
    assert distance_from_greedy(fast, prompts, completions) <= ROUNDING


def test_a_window_one_key_too_wide_would_be_far_from_those_choices(make_llm, kquant_folder, alone):
    """The check above can fail: the same weights with every sliding layer attending one more key."""
    wider = make_llm(write_kquant_gemma3(kquant_folder / "wider_window.gguf", kquant_folder, window=WINDOW + 1), **FAST)
    assert distance_from_greedy(wider, PROMPTS, alone) > 10 * ROUNDING
