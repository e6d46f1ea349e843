"""The batched sampler: per-row sampling parameters as tensors, logits in, token ids (and logprobs) out.

Order as in vLLM v1: raw logprobs → logits processors (sampling/processors.py) → greedy argmax → temperature →
min-p → top-k → top-p → exponential race. Logprobs are of the raw model distribution (vLLM's default
`raw_logprobs`): what the model thinks of each token, before any control moved it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenloop import kernels
from tokenloop.sampling.params import SAMPLING_EPS, SamplingParams
from tokenloop.sampling.processors import LogitControls, apply_processors


@dataclass(slots=True)
class ProcessorInputs:
    """What the logits processors read of a batch's rows: their params, their sequences' tokens and states."""

    params: list[SamplingParams]
    token_ids: list[list[int]]
    controls: list[LogitControls | None]


@dataclass(slots=True)
class SamplingBatch:
    """Per-row sampling parameters of one batch as tensors (rows = sequences in the step)."""

    temperature: torch.Tensor  # [B] float32; 0 for greedy rows
    top_k: torch.Tensor  # [B] int64; vocab_size where off
    top_p: torch.Tensor  # [B] float32; 1.0 where off
    min_p: torch.Tensor  # [B] float32; 0.0 where off
    generators: list[torch.Generator | None]  # per row; None = use the default generator
    max_num_logprobs: int  # max over rows of params.logprobs (None -> 0); -1 if no row wants logprobs
    all_greedy: bool
    all_random: bool
    # Whether any random row uses the processor; greedy rows never count, their samples are discarded.
    any_top_k: bool
    any_top_p: bool
    any_min_p: bool
    processors: ProcessorInputs | None = None  # None when no row uses a logits processor

    @classmethod
    def from_params(
        cls,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
        vocab_size: int,
        device: torch.device,
        processors: ProcessorInputs | None = None,
        num_logprobs: list[int | None] | None = None,  # per row, if not params.logprobs (a beam's candidates)
    ) -> SamplingBatch:
        if len(generators) != len(params):
            raise ValueError(f"generators must have one entry per row, got {len(generators)} for {len(params)} rows")
        greedy = [p.greedy for p in params]
        random_rows = [p for p, g in zip(params, greedy) if not g]
        wanted = [k for k in (num_logprobs or [p.logprobs for p in params]) if k is not None]
        return cls(
            temperature=torch.tensor(
                [0.0 if g else p.temperature for p, g in zip(params, greedy)], dtype=torch.float32, device=device
            ),
            top_k=torch.tensor(
                [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params], dtype=torch.int64, device=device
            ),
            top_p=torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device),
            min_p=torch.tensor([p.min_p for p in params], dtype=torch.float32, device=device),
            generators=list(generators),
            max_num_logprobs=min(max(wanted), vocab_size) if wanted else -1,
            all_greedy=all(greedy),
            all_random=not any(greedy),
            any_top_k=any(0 < p.top_k < vocab_size for p in random_rows),
            any_top_p=any(p.top_p < 1.0 for p in random_rows),
            any_min_p=any(p.min_p > 0.0 for p in random_rows),
            processors=processors
            if processors is not None and any(c is not None for c in processors.controls)
            else None,
        )


@dataclass(slots=True)
class SamplerOutput:
    token_ids: torch.Tensor  # [B] int64, the chosen tokens
    # [B, 1 + K]: column 0 = the chosen token, then the top K (K = max_num_logprobs) sorted descending;
    # None when no row wants logprobs. Every row gets K columns; the engine slices per row.
    logprobs: torch.Tensor | None  # float32
    logprob_token_ids: torch.Tensor | None  # int64
    ranks: torch.Tensor | None  # [B] int64: 1-based rank of the chosen token in the raw distribution


@dataclass(slots=True)
class ScaledLogits:
    """Rows of logits [R, V] at their temperatures [R], and the distribution sampling draws from: their softmax,
    which top-k and top-p then cut and renormalise. One definition of its floats wherever they are read (a whole
    row, or only its most likely tokens, whatever the other rows): tokenloop's kernel on the CPU, which divides by
    the temperature, normalises and selects a row's candidates without writing a [R, V] tensor (those passes were
    most of a sampled step's sampling); PyTorch's division and softmax elsewhere."""

    logits: torch.Tensor  # [R, V] float32, contiguous
    temperature: torch.Tensor  # [R] float32, > 0
    normalizers: tuple[torch.Tensor, torch.Tensor] | None = None  # kernel: per row, the largest logit / t, the sum
    softmax: torch.Tensor | None = None  # PyTorch: the whole distribution [R, V]

    @classmethod
    def of(cls, logits: torch.Tensor, temperature: torch.Tensor | None = None) -> ScaledLogits:
        """`logits` at `temperature` (None: 1)."""
        logits = logits.float().contiguous()
        if temperature is None:
            temperature = torch.ones(len(logits), dtype=torch.float32, device=logits.device)
        dist = cls(logits, temperature.float().contiguous())
        if logits.device.type == "cpu" and kernels.cpu_kernels_available():
            dist.normalizers = torch.ops.tokenloop.softmax_normalizers(dist.logits, dist.temperature)
        else:
            dist.softmax = (logits / dist.temperature.unsqueeze(1)).softmax(dim=-1)
        return dist

    def probs(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The distribution of `rows` (None: all) [R', V]."""
        if self.normalizers is None:
            return self.softmax if rows is None else self.softmax[rows]
        return torch.ops.tokenloop.scaled_softmax(self.logits, self.temperature, *self.normalizers, self._rows(rows))

    def scaled(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The logits of `rows` at their temperatures [R', V]."""
        if rows is None:
            return self.logits / self.temperature.unsqueeze(1)
        return self.logits[rows] / self.temperature[rows].unsqueeze(1)

    def largest(self, rows: torch.Tensor | None, width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The `width` most likely tokens of `rows` in the stable descending order of their scaled logits (equal
        ones: the lower id first): their probabilities and ids [R', width], and the rows for which that is sure:
        the kernel selects them so; elsewhere topk does, whose order among ties is arbitrary, so a tie across the
        edge leaves the row to a wider pass."""
        if self.normalizers is not None:
            probs, index = torch.ops.tokenloop.top_candidates(
                self.logits, self.temperature, *self.normalizers, self._rows(rows), width
            )
            return probs, index, torch.ones(len(index), dtype=torch.bool, device=index.device)
        values, index = self.scaled(rows).topk(width + 1, dim=-1)  # [R', W + 1]; ties in no particular order
        # A tie across the edge (the first token left out equal to the last one taken) could leave a lower id out.
        settled = values[:, width - 1] != values[:, width]
        values, index = values[:, :width], index[:, :width]
        by_id = index.argsort(dim=-1)  # equal logits: the lower id first, as a stable sort of the row puts them
        values, index = values.gather(-1, by_id), index.gather(-1, by_id)
        index = index.gather(-1, values.argsort(dim=-1, descending=True, stable=True))
        return self.probs(rows).gather(-1, index), index, settled

    def _rows(self, rows: torch.Tensor | None) -> torch.Tensor:
        return torch.arange(len(self.logits), device=self.logits.device) if rows is None else rows


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask (to -inf) tokens whose probability is below min_p[row] × the row's top probability."""
    probs = logits.softmax(dim=-1)  # [B, V]
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)  # [B, 1]
    return logits.masked_fill(probs < threshold, float("-inf"))


# Partial selections tried, widest last, before a row falls back to sorting its whole vocabulary: most nuclei at
# top-p 0.95 end within a few dozen tokens, nearly all within a few hundred, and topk(k) of 49k logits costs a
# small fraction of a sort, growing with k.
CANDIDATES = (32, 256, 2048)


def apply_top_k_top_p(logits: torch.Tensor, k: torch.Tensor | None, p: torch.Tensor | None) -> torch.Tensor:
    """Mask (to -inf) tokens outside each row's top k, then outside the top-p nucleus of what is left (the rule:
    top_k_top_p; a token whose probability underflows to 0 cannot be drawn and counts as removed)."""
    if k is None and p is None:
        return logits
    return logits.masked_fill(top_k_top_p(logits, k, p) == 0, float("-inf"))


def top_k_top_p_support(
    logits: torch.Tensor | ScaledLogits, k: torch.Tensor | None, p: torch.Tensor | None
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """top_k_top_p's distribution by its support, found among the candidates, when top-k or top-p cuts every row:
    (None, the (row, id) pairs of nonzero probability [N, 2] as probs.nonzero() lists them, their probabilities
    [N]); else, when a row keeps its whole distribution, (the distribution [B, V], None, None)."""
    dist = _scaled(logits)
    out, kept = _top_k_top_p(dist, k, p, dense=False)
    if kept is None:
        return out, None, None
    return None, *_support(kept, dist.logits.shape[1])


def top_k_top_p(logits: torch.Tensor | ScaledLogits, k: torch.Tensor | None, p: torch.Tensor | None) -> torch.Tensor:
    """Each row's distribution [B, V] after top-k, then top-p (zeros where removed); `logits` at temperature 1 unless
    given as ScaledLogits.

    top-k keeps exactly k tokens; among equal logits the lower token id wins (as torch.argmax).
    top-p keeps the shortest prefix of the descending order (probabilities renormalised after top-k) whose mass
    reaches p: a token is dropped once the mass before it is at least p; the top token always stays.
    The probabilities are the row's softmax (ScaledLogits'), renormalised over what is kept. Each row is decided
    on its `CANDIDATES` most likely tokens when they settle it (its k is within them and its nucleus ends within
    them), else on its whole sorted row: the same rule either way, and a row's path depends on its own logits only.
    """
    return _top_k_top_p(_scaled(logits), k, p)[0]


def _scaled(logits: torch.Tensor | ScaledLogits) -> ScaledLogits:
    return logits if isinstance(logits, ScaledLogits) else ScaledLogits.of(logits)


def _top_k_top_p(
    dist: ScaledLogits, k: torch.Tensor | None, p: torch.Tensor | None, dense: bool = True
) -> tuple[torch.Tensor | None, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None]:
    """top_k_top_p's distribution (None when not `dense` and the candidates settle every row), and the candidates
    that settled each row (None when a row keeps its whole distribution)."""
    if k is None and p is None:
        return dist.probs(), None
    rows, vocab = dist.logits.shape
    device = dist.logits.device
    active = torch.zeros(rows, dtype=torch.bool, device=device)
    if k is not None:
        active |= k < vocab
    if p is not None:
        active |= p < 1.0
    every_row_active = bool(active.all())
    out = torch.zeros(rows, vocab, device=device) if dense or not every_row_active else None
    if not every_row_active:
        idle = (~active).nonzero().squeeze(1)
        out[idle] = dist.probs(idle)
    pending = active.nonzero().squeeze(1)
    kept = []  # (rows, their candidates' ids, their probabilities), as each width settles rows
    for width in (*(c for c in CANDIDATES if c < vocab), vocab):
        if len(pending) == 0:
            break
        whole = len(pending) == rows
        sub = (lambda t: t) if whole else (lambda t: t[pending] if t is not None else None)
        row_probs, index, settled = _nucleus(dist, None if whole else pending, sub(k), sub(p), width)
        if whole and settled.all():
            kept.append((pending, index, row_probs))
            if out is not None:
                out.scatter_(-1, index, row_probs)
            break
        kept.append((pending[settled], index[settled], row_probs[settled]))
        if out is not None:
            out[pending[settled].unsqueeze(1), index[settled]] = row_probs[settled]
        pending = pending[~settled]
    return out, kept if every_row_active else None


def _support(
    kept: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], vocab: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The (row, id) pairs of nonzero probability among the kept candidates, rows ascending, ids ascending, and
    their probabilities."""
    keys, values = [], []
    for rows, index, row_probs in kept:
        r, j = (row_probs > 0).nonzero(as_tuple=True)
        keys.append(rows[r] * vocab + index[r, j])
        values.append(row_probs[r, j])
    key, order = torch.cat(keys).sort()  # distinct keys: one order
    return torch.stack([key // vocab, key % vocab], dim=1), torch.cat(values)[order]


def _nucleus(
    dist: ScaledLogits,
    of_rows: torch.Tensor | None,
    k: torch.Tensor | None,
    p: torch.Tensor | None,
    width: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The rows' `width` most likely tokens in the stable descending order of their logits: their final
    probabilities (0 where top-k or top-p drop them), their ids, and which rows they settle (all, at full width).
    The rows are `of_rows` of `dist` (None: all)."""
    vocab = dist.logits.shape[1]
    if width < vocab:
        mass, index, settled = dist.largest(of_rows, width)
    else:
        index = dist.scaled(of_rows).argsort(dim=-1, descending=True, stable=True)
        mass = dist.probs(of_rows).gather(-1, index)
        settled = torch.ones(len(index), dtype=torch.bool, device=index.device)
    rows, device = len(index), index.device
    position = torch.arange(width, device=device)
    k_on = k < vocab if k is not None else torch.zeros(rows, dtype=torch.bool, device=device)
    within_k = k_on & (k <= width) if k is not None else k_on
    if k is not None:
        mass = mass.masked_fill(position >= k.unsqueeze(1), 0.0)
    reached = torch.zeros(rows, dtype=torch.bool, device=device)
    if p is not None:
        # Renormalised over what top-k left: known from the candidates only when k is among them.
        total = torch.where(within_k, mass.sum(dim=-1), 1.0).unsqueeze(1)
        drop = (mass.cumsum(dim=-1) - mass >= p.unsqueeze(1) * total) & (p.unsqueeze(1) < 1.0)
        drop[:, 0] = False
        mass = mass.masked_fill(drop, 0.0)
        reached = drop.any(dim=-1)  # the nucleus ended within the candidates
    if width < vocab:
        settled &= within_k | (~k_on & reached)
    return mass / mass.sum(dim=-1, keepdim=True), index, settled


def argmax(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(dim=-1) for float32 x [B, V]: the first of equal maxima, the first NaN, as torch's. On a CPU, by
    tokenloop's vectorised kernel (torch's compares a value at a time: over Gemma 3's 262k logits, a few percent of
    a decode step)."""
    if x.device.type == "cpu" and x.dtype == torch.float32 and kernels.cpu_kernels_available():
        return torch.ops.tokenloop.argmax(x.contiguous())
    return x.argmax(dim=-1)


def random_sample(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """Sample one token per row of probs [B, V] by the exponential race: argmax(probs / q), q ~ Exp(1), same law as
    multinomial, raced row by row in place (a row keeps its whole vocabulary at temperature alone). The same draws
    and winners as exponential_race over the row's listed support."""
    if _kernel_races(probs):
        probs = probs.contiguous()
        _checked(torch.ops.tokenloop.racing_rows(probs).tolist())
        return torch.ops.tokenloop.exponential_race(probs, race_seeds(generators, probs.device))
    racing = probs > 0  # a NaN is not a probability
    _checked(racing.any(dim=-1).tolist())
    seeds = race_seeds(generators, probs.device)
    rows, ids = torch.arange(probs.shape[0], device=probs.device), torch.arange(probs.shape[1], device=probs.device)
    q = race_exponentials(seeds, rows[:, None].expand_as(probs).reshape(-1), ids.repeat(probs.shape[0]))
    keys = torch.where(racing, probs / q.view_as(probs), -1.0)  # below every racing key (p / q >= 0)
    return argmax(keys)  # the first of equal keys: the lowest id, as exponential_race takes it


def _kernel_races(probs: torch.Tensor) -> bool:
    return probs.device.type == "cpu" and probs.dtype == torch.float32 and kernels.cpu_kernels_available()


def _checked(racing: list[bool]) -> None:
    """Refuses a row with no token to race, before any row draws."""
    if not all(racing):
        raise ValueError(
            f"row {racing.index(False)} has no token of nonzero probability to sample: its logits are all -inf or NaN"
        )


def race_seeds(generators: list[torch.Generator | None], device: torch.device) -> torch.Tensor:
    """[B] int64 on `device`: each row's seed for this step's race, one draw from its generator (None: the
    device's default one)."""
    return torch.stack([torch.empty((), dtype=torch.int64, device=device).random_(generator=g) for g in generators])


def race_exponentials(seeds: torch.Tensor, rows: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """q [N] of the listed tokens ids [N] of rows [N] (seeds [R] int64, race_seeds'): -log(u) for u the token's
    uniform in [0, 1), a hash of its id and its row's seed (kernels/exponential_race.cpp, whose definition this
    follows where the kernels do not run)."""
    if kernels.cpu_kernels_available() and ids.device.type == "cpu":
        return torch.ops.tokenloop.race_exponentials(seeds, rows, ids)
    a = _mix(seeds & _LOW)
    b = _mix((seeds >> 32) ^ a)
    h = _mix((_mix(ids ^ a[rows]) + b[rows]) & _LOW)
    return -torch.log((h >> 8).float() * 2.0**-24)


_LOW = 0xFFFFFFFF


def _mix(x: torch.Tensor) -> torch.Tensor:
    """The kernel's lowbias32 on int64 tensors holding 32-bit values."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _LOW
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _LOW
    return x ^ (x >> 16)


def exponential_race(
    probs: torch.Tensor | None,
    generators: list[torch.Generator | None],
    support: torch.Tensor | None = None,
    support_probs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows [B, V] race their tokens of nonzero probability only (top-k, top-p and min-p leave few), each token's q
    drawn from its id and its row's seed for the step (race_seeds: one draw from the row's own generator, or the
    default one): a row's tokens do not depend on the batch. `support`, `support_probs`: those tokens and their
    probabilities if known (top_k_top_p_support's; then `probs` may be None), else those of probs > 0. Returns the
    winners [B], and the racing tokens as (row, id) pairs [N, 2] with their q [N]."""
    if support is None:
        support = (probs > 0).nonzero()  # [N, 2]: row by row, ids ascending (a NaN is not a probability)
    rows, ids = support[:, 0], support[:, 1]
    if support_probs is None:
        support_probs = probs[rows, ids]
    num_rows = len(generators)
    _checked((torch.bincount(rows, minlength=num_rows) > 0).tolist())
    q = race_exponentials(race_seeds(generators, ids.device), rows, ids)
    keys = support_probs / q
    # Each row's largest key, the first (lowest id) of equal ones, as argmax takes it.
    best = torch.zeros(num_rows, dtype=keys.dtype, device=keys.device).scatter_reduce_(0, rows, keys, "amax")
    position = torch.arange(len(ids), device=ids.device)
    first = torch.full((num_rows,), len(ids), device=ids.device).scatter_reduce_(
        0, rows, torch.where(keys == best[rows], position, len(ids)), "amin"
    )
    return ids[first], support, q


class Sampler(torch.nn.Module):
    """Chooses one token per row from logits [B, V] (any float dtype; computed in float32)."""

    def forward(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        logits = logits.float()  # may alias the caller's tensor: nothing below writes into it
        # Logprobs are of the raw model distribution, before temperature and the processors.
        raw_logprobs = logits.log_softmax(dim=-1) if batch.max_num_logprobs >= 0 else None
        if batch.processors is not None:  # before the greedy choice: they can move the argmax
            inputs = batch.processors
            logits = apply_processors(logits, inputs.params, inputs.token_ids, inputs.controls)
        if batch.all_greedy:
            token_ids = argmax(logits)
        else:
            token_ids = self._sample(logits, batch)
        if raw_logprobs is None:
            return SamplerOutput(token_ids=token_ids, logprobs=None, logprob_token_ids=None, ranks=None)
        return gather_logprobs(raw_logprobs, token_ids, batch.max_num_logprobs)

    @staticmethod
    def _sample(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        probs, support, support_probs = top_k_top_p_support(Sampler.scaled(logits, batch), *Sampler.cuts(batch))
        if support is None:
            sampled = random_sample(probs, batch.generators)
        else:
            sampled = exponential_race(None, batch.generators, support, support_probs)[0]
        if batch.all_random:
            return sampled
        return torch.where(batch.temperature < SAMPLING_EPS, argmax(logits), sampled)

    @staticmethod
    def probs(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """[B, V]: the distribution each row samples from, after temperature, min-p, top-k and top-p (greedy rows:
        temperature 1; their draw is replaced by the argmax). Also what speculative decoding verifies against."""
        return top_k_top_p(Sampler.scaled(logits, batch), *Sampler.cuts(batch))

    @staticmethod
    def scaled(logits: torch.Tensor, batch: SamplingBatch) -> ScaledLogits:
        """The logits at each row's temperature (greedy rows: 1, no division by 0), min-p applied."""
        temperature = torch.where(batch.temperature < SAMPLING_EPS, 1.0, batch.temperature)
        if batch.any_min_p:
            return ScaledLogits.of(apply_min_p(logits / temperature.unsqueeze(1), batch.min_p))
        return ScaledLogits.of(logits, temperature)

    @staticmethod
    def cuts(batch: SamplingBatch) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Each row's top-k and top-p (None where no row cuts by it: both None, top_k_top_p is the softmax)."""
        return batch.top_k if batch.any_top_k else None, batch.top_p if batch.any_top_p else None


def gather_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor, num_logprobs: int) -> SamplerOutput:
    """Chosen token's logprob and rank, then the top num_logprobs, from logprobs [B, V]."""
    chosen_ids = token_ids.unsqueeze(1)  # [B, 1]
    chosen = logprobs.gather(-1, chosen_ids)  # [B, 1]
    # As vLLM: rank = number of tokens at least as likely as the chosen one (ties share the worst rank).
    ranks = (logprobs >= chosen).sum(dim=-1)
    top_values, top_ids = logprobs.topk(num_logprobs, dim=-1)  # [B, K], sorted descending
    return SamplerOutput(
        token_ids=token_ids,
        logprobs=torch.cat([chosen, top_values], dim=1),
        logprob_token_ids=torch.cat([chosen_ids, top_ids], dim=1),
        ranks=ranks,
    )
