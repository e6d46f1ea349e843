"""Logits processors: the controls a request sets against error accumulation, applied over a step's rows as tensors.

Order, as vLLM documents it: allowed_token_ids → bad_words → min_tokens → logit_bias → repetition_penalty →
presence / frequency penalties → no_repeat_ngram_size → the structured-output mask; the sampler then takes the
greedy choice or samples (temperature → min-p → top-k → top-p). Each processor touches only the rows that use it;
the per-row loops (bad words, n-grams) run only over those rows, never over the vocabulary.

Semantics as users know them:
- repetition_penalty: transformers' rule over the prompt and the output, once per distinct token (a positive
  logit is divided by the penalty, a negative one multiplied);
- presence_penalty / frequency_penalty: OpenAI's rule over the output only (minus presence once a token has
  appeared, minus frequency times its count);
- no_repeat_ngram_size n: transformers' rule, prompt included (a token that would repeat an n-gram is banned);
- bad_words: vLLM's rule: each word tokenized with and without a leading space, and its last token banned
  when the output ends with the tokens before it;
- min_tokens: EOS and the stop token ids are banned until the output has that many tokens.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from tokenloop.sampling.params import SAMPLING_EPS, SamplingParams
from tokenloop.sampling.structured import GrammarCompiler, GrammarMatcher, apply_grammar_masks

# The largest logit a penalty leaves: half of what the smallest sampling temperature divides into float32's largest
# number, so the scaled logits stay finite.
LARGEST_LOGIT = torch.finfo(torch.float32).max * SAMPLING_EPS / 2


@dataclass(slots=True)
class TokenHistory:
    """What the penalties need of a sequence's tokens, kept up to date incrementally: `sync` reads only the
    tokens appended since its last call (a preempted sequence keeps its tokens, so this stays valid)."""

    num_prompt_tokens: int
    ngram_size: int = 0  # 0: no n-gram index
    output_counts: Counter = field(default_factory=Counter)
    prompt_ids: torch.Tensor | None = None  # distinct prompt token ids, built once
    ngrams: dict[tuple[int, ...], set[int]] = field(
        default_factory=dict
    )  # (n-1)-token prefix -> tokens that followed it
    synced: int = 0  # tokens read so far

    def sync(self, token_ids: list[int]) -> None:
        if self.prompt_ids is None:
            self.prompt_ids = torch.tensor(sorted(set(token_ids[: self.num_prompt_tokens])), dtype=torch.int64)
        n = self.ngram_size
        for i in range(self.synced, len(token_ids)):
            if i >= self.num_prompt_tokens:
                self.output_counts[token_ids[i]] += 1
            if n and i + 1 >= n:
                self.ngrams.setdefault(tuple(token_ids[i + 1 - n : i]), set()).add(token_ids[i])
        self.synced = len(token_ids)

    def banned_by_ngrams(self, token_ids: list[int]) -> set[int]:
        n = self.ngram_size
        if len(token_ids) + 1 < n:  # transformers: no n-gram can be completed yet
            return set()
        return self.ngrams.get(tuple(token_ids[len(token_ids) - n + 1 :]) if n > 1 else (), set())


@dataclass(slots=True)
class LogitControls:
    """A sequence's processor state: None on a sequence whose request uses no processor (the fast path)."""

    history: TokenHistory
    bad_words_ids: list[list[int]]  # token sequences, from params.bad_words (both spacings)
    min_tokens_stop_ids: list[int]  # banned while the output is shorter than params.min_tokens
    grammar: GrammarMatcher | None = None  # params.structured_outputs' matcher
    eos_token_id: int | None = None  # what a row whose grammar the bans left no token must choose
    # Positions (the row's token count) whose row had no token left this step: the request ends there, saying why.
    dead_ends: set[int] = field(default_factory=set)

    @classmethod
    def for_request(
        cls,
        params: SamplingParams,
        num_prompt_tokens: int,
        encode,
        eos_token_ids,
        grammars: GrammarCompiler | None = None,
    ) -> LogitControls | None:
        if not params.uses_processors:
            return None
        grammar = grammars.matcher(params.structured_outputs) if params.structured_outputs is not None else None
        bad_words_ids = []
        for word in params.bad_words:
            for text in (word, " " + word.lstrip()):  # as vLLM: with and without a leading space
                ids = encode(text)
                if ids and ids not in bad_words_ids:
                    bad_words_ids.append(ids)
        stop_ids = sorted(set(params.stop_token_ids) | set(eos_token_ids))
        eos = min(eos_token_ids) if eos_token_ids else None
        return cls(TokenHistory(num_prompt_tokens, params.no_repeat_ngram_size), bad_words_ids, stop_ids, grammar, eos)


def _ban(logits: torch.Tensor, rows: list[int], ids: list[int]) -> None:
    if rows:
        logits[torch.tensor(rows, device=logits.device), torch.tensor(ids, device=logits.device)] = float("-inf")


@dataclass(slots=True)
class ProcessorRows:
    """One step's rows as the processors see them (rows: those with controls, their histories synced)."""

    params: list[SamplingParams]
    token_ids: list[list[int]]
    controls: list[LogitControls | None]
    rows: list[int]


def _allowed(out: torch.Tensor, b: ProcessorRows) -> None:
    if allowed := [i for i in b.rows if b.params[i].allowed_token_ids is not None]:
        mask = torch.full((len(allowed), out.shape[-1]), float("-inf"), device=out.device)
        for j, i in enumerate(allowed):
            mask[j, torch.tensor(b.params[i].allowed_token_ids, dtype=torch.int64, device=out.device)] = 0.0
        out[torch.tensor(allowed, device=out.device)] += mask


def _bad_words(out: torch.Tensor, b: ProcessorRows) -> None:
    ban_rows, ban_ids = [], []
    for i in b.rows:
        output = b.token_ids[i][b.controls[i].history.num_prompt_tokens :]
        for word in b.controls[i].bad_words_ids:
            prefix = word[:-1]
            if len(output) >= len(prefix) and output[len(output) - len(prefix) :] == prefix:
                ban_rows.append(i), ban_ids.append(word[-1])
    _ban(out, ban_rows, ban_ids)


def _min_tokens(out: torch.Tensor, b: ProcessorRows) -> None:
    ban_rows, ban_ids = [], []
    for i in b.rows:
        c = b.controls[i]
        if len(b.token_ids[i]) - c.history.num_prompt_tokens < b.params[i].min_tokens:
            ban_rows += [i] * len(c.min_tokens_stop_ids)
            ban_ids += c.min_tokens_stop_ids
    _ban(out, ban_rows, ban_ids)


def _logit_bias(out: torch.Tensor, b: ProcessorRows) -> None:
    bias_rows, bias_ids, bias_values = [], [], []
    for i in b.rows:
        for token, bias in (b.params[i].logit_bias or {}).items():
            bias_rows.append(i), bias_ids.append(token), bias_values.append(bias)
    if bias_rows:
        index = (torch.tensor(bias_rows, device=out.device), torch.tensor(bias_ids, device=out.device))
        out.index_put_(index, torch.tensor(bias_values, dtype=out.dtype, device=out.device), accumulate=True)


def _penalties(out: torch.Tensor, b: ProcessorRows) -> None:
    params, device, vocab = b.params, out.device, out.shape[-1]
    penalized = [
        i
        for i in b.rows
        if params[i].repetition_penalty != 1.0 or params[i].presence_penalty or params[i].frequency_penalty
    ]
    if not penalized:
        return
    counts = torch.zeros(len(penalized), vocab, device=device)
    for j, i in enumerate(penalized):
        history = b.controls[i].history
        if history.output_counts:
            ids = torch.tensor(list(history.output_counts), device=device)
            counts[j, ids] = torch.tensor(list(history.output_counts.values()), dtype=torch.float32, device=device)
    index = torch.tensor(penalized, device=device)
    sub = out[index]
    # A penalty outside float32's range would be 0 or inf there (a masked -inf times 0, or a 0 times inf, is NaN):
    # it stays within float32's. Dividing by one near 0 can pass float32's largest number, here or at the
    # temperature's division after (+inf makes the row's softmax NaN): a logit stays at LARGEST_LOGIT.
    floats = torch.finfo(sub.dtype)
    repetition = torch.tensor([params[i].repetition_penalty for i in penalized], device=device).unsqueeze(1)
    repetition.clamp_(min=floats.tiny, max=floats.max)
    seen = counts > 0
    for j, i in enumerate(penalized):
        seen[j, b.controls[i].history.prompt_ids.to(device)] = True
    divided = (sub / repetition).clamp_(max=LARGEST_LOGIT)
    sub = torch.where(seen, torch.where(sub > 0, divided, sub * repetition), sub)
    presence = torch.tensor([params[i].presence_penalty for i in penalized], device=device).unsqueeze(1)
    frequency = torch.tensor([params[i].frequency_penalty for i in penalized], device=device).unsqueeze(1)
    out[index] = sub - frequency * counts - presence * (counts > 0)


def _ngrams(out: torch.Tensor, b: ProcessorRows) -> None:
    ngram_rows, ngram_ids = [], []
    for i in b.rows:
        if b.params[i].no_repeat_ngram_size:
            banned = b.controls[i].history.banned_by_ngrams(b.token_ids[i])
            ngram_rows += [i] * len(banned)
            ngram_ids += sorted(banned)
    _ban(out, ngram_rows, ngram_ids)


def _grammar(out: torch.Tensor, b: ProcessorRows) -> None:
    controls = b.controls
    grammar_rows = [i for i in b.rows if controls[i].grammar is not None]
    for i in grammar_rows:
        controls[i].grammar.sync(b.token_ids[i][controls[i].history.num_prompt_tokens :])
        controls[i].dead_ends.clear()
    apply_grammar_masks(out, grammar_rows, [controls[i].grammar.allowed() for i in grammar_rows])
    if grammar_rows:  # the grammar's tokens and the bans intersected: where nothing is left, the request ends
        empty = torch.isneginf(out[torch.tensor(grammar_rows, device=out.device)]).all(dim=1).tolist()
        for i in (i for i, none_left in zip(grammar_rows, empty) if none_left and controls[i].eos_token_id is not None):
            controls[i].dead_ends.add(len(b.token_ids[i]))
            out[i, controls[i].eos_token_id] = 0.0


# The processors in the order they apply, each by the name a stage of the explorer shows (explorer/): one list, so
# that sampling and showing what each step did cannot drift apart.
PROCESSORS = (
    ("allowed_token_ids", _allowed),
    ("bad_words", _bad_words),
    ("min_tokens", _min_tokens),
    ("logit_bias", _logit_bias),
    ("penalties", _penalties),
    ("no_repeat_ngram", _ngrams),
    ("grammar", _grammar),
)


def apply_processors(
    logits: torch.Tensor,
    params: list[SamplingParams],
    token_ids: list[list[int]],
    controls: list[LogitControls | None],
    after_each: Callable[[str, torch.Tensor], None] | None = None,
) -> torch.Tensor:
    """Logits [B, V] (float32, not written) after every processor the rows ask for, in the documented order.
    token_ids[i] and controls[i] are row i's sequence tokens and state. `after_each(name, logits)`: called after
    each processor with the logits so far (the explorer's stages; not to be written)."""
    out = logits.clone()
    rows = [i for i, c in enumerate(controls) if c is not None]
    for i in rows:
        controls[i].history.sync(token_ids[i])
    batch = ProcessorRows(params, token_ids, controls, rows)
    for name, processor in PROCESSORS:
        processor(out, batch)
        if after_each is not None:
            after_each(name, out)
    return out
