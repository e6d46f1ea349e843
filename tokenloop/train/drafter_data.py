"""Self-distilled data for a drafter: the target answers chat prompts through the engine, one teacher-forced forward
per group of conversations records its last hidden state at every position, and the draft vocabulary is the
tokens the target itself answers with most often (FR-Spec / EAGLE-3's d2t).

The features come from the model the engine serves with (the 4-bit fast path under dtype "auto"), so the drafter
learns the very states it will be given; the answers are the engine's own tokens, EOS included.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass

import torch
from torch import nn
from tqdm import tqdm

from tokenloop.llm import LLM
from tokenloop.models.attention import PackedSequences
from tokenloop.sampling.params import SamplingParams
from tokenloop.train.drafter_dataset import DrafterData
from tokenloop.train.drafter_prompts import SOURCE, write_prompts

HIDDEN_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


@dataclass(slots=True)
class DistillConfig:
    num_prompts: int = 256  # conversations to record (model-written prompts, unless `prompts` are given)
    max_tokens: int = 256  # answer tokens at most per conversation
    temperature: float = 0.0  # of the answers; 0 = greedy (the drafter learns the target's argmax path)
    seed: int = 0  # prompts (and answers when sampled) follow from it
    draft_vocab_size: int = 8192  # clipped to the target's vocabulary; EOS ids always in
    hidden_dtype: str = "float16"  # how the recorded hidden states are stored
    prompt_max_tokens: int = 64  # tokens the model may spend writing one prompt
    tokens_per_forward: int = 4096  # conversations packed into one feature forward, up to this many tokens
    prompts: tuple[str, ...] = ()  # user requests to answer instead of model-written ones (num_prompts then unused)

    def __post_init__(self) -> None:
        for name in ("num_prompts", "max_tokens", "draft_vocab_size", "prompt_max_tokens", "tokens_per_forward"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.seed < 0:
            raise ValueError(f"seed must be >= 0, got {self.seed}")
        if self.hidden_dtype not in HIDDEN_DTYPES:
            raise ValueError(f"hidden_dtype must be one of {', '.join(HIDDEN_DTYPES)}, got {self.hidden_dtype!r}")
        self.prompts = tuple(self.prompts)


def collect(llm: LLM, config: DistillConfig, progress: bool = True) -> DrafterData:
    """Prompts → the target's answers → its hidden states → the draft vocabulary, with timings in info."""
    engine = llm.llm_engine
    start = time.perf_counter()
    prompts, fallbacks = list(config.prompts), 0
    if not prompts:
        prompts, fallbacks = write_prompts(llm, config.num_prompts, config.seed, config.prompt_max_tokens, progress)
    prompt_s = time.perf_counter() - start

    start = time.perf_counter()
    sequences, answer_starts = answer(llm, prompts, config, progress)
    generate_s = time.perf_counter() - start
    num_answer = sum(len(s) - a for s, a in zip(sequences, answer_starts))

    start = time.perf_counter()
    model = engine.runner.model
    hidden = extract_hidden(model, sequences, config.tokens_per_forward, HIDDEN_DTYPES[config.hidden_dtype], progress)
    feature_s = time.perf_counter() - start
    num_tokens = sum(len(s) for s in sequences)

    vocab_size = engine.model_config.vocab_size
    eos_ids = engine.tokenizer.eos_token_ids
    answers = [s[a:] for s, a in zip(sequences, answer_starts)]
    counts = answer_token_counts(answers, vocab_size)
    vocab = choose_draft_vocab(counts, config.draft_vocab_size, eos_ids)
    info = {
        "model": str(engine.config.model or "default"),
        "engine_dtype": engine.config.dtype,
        "prompt_source": SOURCE if not config.prompts else "given by the caller",
        "prompt_fallbacks": fallbacks,
        "prompts": prompts,
        "config": asdict(config) | {"prompts": len(config.prompts)},
        "eos_token_ids": list(eos_ids),
        "draft_vocab_coverage": coverage(counts, vocab),
        "draft_vocab_held_out_coverage": held_out_coverage(answers, vocab_size, config.draft_vocab_size, eos_ids),
        "figures": {
            "prompt_s": prompt_s,
            "generate_s": generate_s,
            "feature_s": feature_s,
            "answer_tokens": num_answer,
            "tokens": num_tokens,
            "generate_tokens_per_s": num_answer / generate_s,
            "feature_tokens_per_s": num_tokens / feature_s,
            "answer_tokens_per_min": 60 * num_answer / (prompt_s + generate_s + feature_s),
        },
    }
    return DrafterData(
        token_ids=torch.tensor([t for s in sequences for t in s], dtype=torch.int32),
        hidden=torch.cat(hidden),
        lengths=torch.tensor([len(s) for s in sequences], dtype=torch.int64),
        answer_starts=torch.tensor(answer_starts, dtype=torch.int64),
        draft_vocab=vocab,
        vocab_size=vocab_size,
        info=info,
    )


def answer(
    llm: LLM, prompts: Sequence[str], config: DistillConfig, progress: bool
) -> tuple[list[list[int]], list[int]]:
    """Each prompt as a user turn through the chat template, answered by the engine (all batched): the token ids of
    prompt and answer as the engine produced them (the EOS that stopped it included), and where each answer starts."""
    params = [
        SamplingParams(
            temperature=config.temperature,
            max_tokens=config.max_tokens,
            seed=None if config.temperature == 0 else config.seed * 1_000_003 + i,
        )
        for i in range(len(prompts))
    ]
    outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params, use_tqdm=progress)
    sequences = [list(out.prompt_token_ids) + list(out.outputs[0].token_ids) for out in outputs]
    return sequences, [len(out.prompt_token_ids) for out in outputs]


@torch.inference_mode()
def extract_hidden(
    model: nn.Module,
    sequences: Sequence[Sequence[int]],
    tokens_per_forward: int,
    dtype: torch.dtype = torch.float16,
    progress: bool = False,
) -> list[torch.Tensor]:
    """Each sequence's final hidden states (L, d) in `dtype` on the CPU, teacher-forced: sequences of like length
    packed into forwards of up to tokens_per_forward tokens (a longer one runs alone), each attending to itself."""
    device = next(model.parameters()).device
    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]))  # like lengths together: little padding
    groups: list[list[int]] = []
    used = tokens_per_forward
    for i in order:
        if used + len(sequences[i]) > tokens_per_forward:
            groups.append([])
            used = 0
        groups[-1].append(i)
        used += len(sequences[i])
    hidden: list[torch.Tensor | None] = [None] * len(sequences)
    total = sum(len(s) for s in sequences)
    with tqdm(total=total, desc="hidden states", unit="tok", disable=not progress) as bar:
        for group in groups:
            ids = torch.tensor([t for i in group for t in sequences[i]], dtype=torch.int64, device=device)
            meta = PackedSequences.of([len(sequences[i]) for i in group], device)
            out = model(ids, meta.positions(), meta).to("cpu", dtype)  # (T, d)
            for i, rows in zip(group, out.split([len(sequences[i]) for i in group])):
                hidden[i] = rows.clone()
            bar.update(len(ids))
    return hidden  # type: ignore[return-value]


def answer_token_counts(answers: Iterable[Sequence[int]], vocab_size: int) -> torch.Tensor:
    """(vocab_size,) int64: how often each token occurs in the answers."""
    tokens = [torch.as_tensor(list(a), dtype=torch.int64) for a in answers]
    flat = torch.cat(tokens) if tokens else torch.zeros(0, dtype=torch.int64)
    return torch.bincount(flat, minlength=vocab_size)


def choose_draft_vocab(counts: torch.Tensor, size: int, eos_ids: Sequence[int]) -> torch.Tensor:
    """The draft vocabulary, ascending: the EOS ids, then the most frequent other tokens (ties to the lower id) up to
    `size` ids in all (clipped to the vocabulary); never a token the answers do not hold, but for the EOS ids."""
    eos = sorted(set(eos_ids))
    size = min(size, len(counts))
    if size < len(eos):
        raise ValueError(f"draft_vocab_size ({size}) must hold the {len(eos)} EOS ids at least")
    by_count = torch.sort(-counts, stable=True).indices  # most frequent first, ties in id order
    seen = by_count[counts[by_count] > 0]
    others = seen[~torch.isin(seen, torch.tensor(eos, dtype=torch.int64))][: size - len(eos)]
    return torch.cat([torch.tensor(eos, dtype=torch.int64), others]).sort().values


def coverage(counts: torch.Tensor, vocab: torch.Tensor) -> float:
    """The fraction of answer tokens inside the draft vocabulary: a bound on the drafter's acceptance."""
    total = int(counts.sum())
    return int(counts[vocab].sum()) / total if total else 0.0


def held_out_coverage(
    answers: Sequence[Sequence[int]], vocab_size: int, size: int, eos_ids: Sequence[int]
) -> float | None:
    """Coverage on answers the vocabulary was not chosen from: chosen from all but every fourth answer, measured on
    those (in-sample coverage is 1 whenever the answers hold fewer distinct tokens than `size`); None under 4."""
    if len(answers) < 4:
        return None
    fit = answer_token_counts((a for i, a in enumerate(answers) if i % 4 != 3), vocab_size)
    held_out = answer_token_counts((a for i, a in enumerate(answers) if i % 4 == 3), vocab_size)
    return coverage(held_out, choose_draft_vocab(fit, size, eos_ids))
