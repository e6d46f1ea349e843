"""The Sampler end to end: greedy, seeds, kept sets, logprobs, and the sampled distribution."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenloop import kernels
from tokenloop.sampling.params import SamplingParams
from tokenloop.sampling.sampler import (
    Sampler,
    SamplingBatch,
    apply_min_p,
    apply_top_k_top_p,
    argmax,
    exponential_race,
    race_exponentials,
    random_sample,
)

sampler = Sampler()


def make_batch(params: list[SamplingParams], vocab: int, device: torch.device, generators=None) -> SamplingBatch:
    if generators is None:
        generators = [None if p.seed is None else torch.Generator(device=device).manual_seed(p.seed) for p in params]
    return SamplingBatch.from_params(params, generators, vocab, device)


def random_logits(rows: int, vocab: int, device: torch.device, seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * scale).to(device)


def test_from_params_builds_off_values_and_flags(device):
    vocab = 10
    params = [
        SamplingParams(temperature=0.0, top_k=3, logprobs=2),
        SamplingParams(temperature=0.7, top_k=-1, top_p=0.9, min_p=0.0, logprobs=None),
        SamplingParams(temperature=1.0, top_k=50, min_p=0.2, logprobs=5),
    ]
    batch = make_batch(params, vocab, device)
    assert batch.temperature.tolist() == pytest.approx([0.0, 0.7, 1.0])
    assert batch.top_k.tolist() == [3, vocab, vocab]
    assert batch.top_k.dtype == torch.int64 and batch.temperature.dtype == torch.float32
    assert batch.top_k.device.type == device.type
    assert batch.max_num_logprobs == 5
    assert not batch.all_greedy and not batch.all_random
    # Row 0's top_k does not count: it is greedy.
    assert (batch.any_top_k, batch.any_top_p, batch.any_min_p) == (False, True, True)
    assert make_batch([SamplingParams()], vocab, device).max_num_logprobs == -1
    assert make_batch([SamplingParams(logprobs=0)], vocab, device).max_num_logprobs == 0


def test_temperature_zero_is_argmax_lowest_id_on_ties(device):
    logits = random_logits(6, 40, device)
    logits[0, [7, 3, 30]] = 10.0  # a three-way tie: token 3 wins
    batch = make_batch([SamplingParams(temperature=0.0, top_k=5, top_p=0.5)] * 6, 40, device)
    assert batch.all_greedy
    out = sampler(logits, batch)
    assert out.token_ids.dtype == torch.int64
    assert out.token_ids.tolist() == logits.argmax(-1).tolist()
    assert out.token_ids[0].item() == 3
    assert out.logprobs is None and out.logprob_token_ids is None and out.ranks is None


def test_tiny_temperature_with_separated_logits_is_argmax(device):
    vocab = 30
    # Distinct logits at least 1 apart, shuffled differently per row.
    logits = torch.stack([torch.randperm(vocab, generator=torch.Generator().manual_seed(r)) for r in range(8)])
    logits = logits.float().to(device)
    params = [SamplingParams(temperature=1e-4, seed=r if r % 2 else None) for r in range(4)]
    params += [SamplingParams(temperature=0.0), SamplingParams(temperature=1e-4, top_p=0.5)] * 2
    out = sampler(logits, make_batch(params, vocab, device))
    assert out.token_ids.tolist() == logits.argmax(-1).tolist()


def test_greedy_and_random_rows_mix(device):
    vocab = 25
    logits = random_logits(4, vocab, device, seed=3)
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(top_k=1),
        SamplingParams(temperature=0.0, seed=5),
        SamplingParams(top_p=1e-6),
    ]
    out = sampler(logits, make_batch(params, vocab, device))
    # top_k=1 and a tiny top_p leave only the top token; greedy rows take the argmax.
    assert out.token_ids.tolist() == logits.argmax(-1).tolist()


def test_same_seed_same_tokens_across_calls(device):
    vocab = 50
    logits = random_logits(1, vocab, device, seed=1, scale=0.5)  # flat: draws vary
    runs = []
    for _ in range(2):
        batch = make_batch([SamplingParams(seed=1234, top_k=20)], vocab, device)
        runs.append([sampler(logits, batch).token_ids.item() for _ in range(30)])
    assert runs[0] == runs[1]
    assert len(set(runs[0])) > 1  # the generator advances from call to call


def test_seeded_row_gives_the_same_tokens_alone_or_anywhere_in_a_batch(device):
    vocab = 64
    row = random_logits(1, vocab, device, seed=2, scale=0.5)
    seeded = SamplingParams(seed=42)
    others = [
        SamplingParams(),
        SamplingParams(seed=7, top_k=5),
        SamplingParams(temperature=0.0),
        SamplingParams(top_p=0.8, min_p=0.05, temperature=0.6),
    ]

    def tokens(position: int, with_others: bool) -> list[int]:
        params = list(others) if with_others else []
        params.insert(position, seeded)
        batch = make_batch(params, vocab, device)
        logits = random_logits(len(params), vocab, device, seed=9 + position)
        logits[position] = row
        return [sampler(logits, batch).token_ids[position].item() for _ in range(20)]

    alone = tokens(0, with_others=False)
    assert len(set(alone)) > 1
    for position in range(len(others) + 1):
        assert tokens(position, with_others=True) == alone


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_the_dense_race_draws_and_picks_as_the_listed_one(data):
    """random_sample races a row in place, exponential_race over its listed support: the same draws from each
    row's generator, the same winner, whether a row keeps every token or few."""
    rows, vocab = data.draw(st.integers(1, 6)), data.draw(st.integers(1, 300))
    probs = torch.rand(rows, vocab, generator=torch.Generator().manual_seed(data.draw(st.integers(0, 2**16))))
    for row in range(rows):
        cut = data.draw(st.sampled_from(["none", "some", "all but one", "uniform"]))
        if cut == "some":
            probs[row, torch.rand(vocab) < 0.7] = 0.0
        elif cut == "all but one":
            probs[row] = 0.0
            probs[row, data.draw(st.integers(0, vocab - 1))] = 1.0
        elif cut == "uniform":
            probs[row] = 0.5
    probs[:, 0] = torch.where(probs.sum(-1) == 0, 1.0, probs[:, 0])  # every row races at least one token
    seeds = data.draw(st.lists(st.integers(0, 2**31), min_size=rows, max_size=rows))

    def generators() -> list[torch.Generator]:
        return [torch.Generator().manual_seed(seed) for seed in seeds]

    dense, sparse = generators(), generators()
    for _ in range(3):  # and the generators stay in step draw after draw
        assert torch.equal(random_sample(probs, dense), exponential_race(probs, sparse)[0])


@pytest.mark.skipif(not kernels.cpu_kernels_available(), reason="no CPU kernels here")
def test_the_kernels_draws_follow_the_definition_the_torch_ops_give(monkeypatch):
    """Where the kernels do not run, torch ops compute the race's draws: the same hash, a log that may round the
    other way in the last bit, and the same winners."""
    generator = torch.Generator().manual_seed(0)
    seeds = torch.randint(0, 2**62, (40,), generator=generator)
    rows, ids = torch.randint(0, 40, (200_000,), generator=generator), torch.randint(0, 2**31 - 1, (200_000,))
    probs = torch.rand(40, 5000, generator=generator)
    probs[::3, ::2] = 0.0
    kernel_q = race_exponentials(seeds, rows, ids)
    kernel_winners = random_sample(probs, [torch.Generator().manual_seed(i) for i in range(40)])
    monkeypatch.setattr(kernels, "cpu_kernels_available", lambda: False)
    torch.testing.assert_close(race_exponentials(seeds, rows, ids), kernel_q, rtol=2.4e-7, atol=0)
    assert torch.equal(random_sample(probs, [torch.Generator().manual_seed(i) for i in range(40)]), kernel_winners)


def test_the_races_draws_are_exponential():
    """q = -log(u) of hashed uniforms: mean and variance 1, no correlation between neighbouring tokens or rows."""
    seeds = torch.randint(0, 2**62, (64,), generator=torch.Generator().manual_seed(3))
    rows = torch.arange(64).repeat_interleave(20_000)
    q = race_exponentials(seeds, rows, torch.arange(20_000).repeat(64)).view(64, 20_000).double()
    assert abs(q.mean() - 1) < 0.01 and abs(q.var() - 1) < 0.02
    assert abs(torch.corrcoef(torch.stack([q[:, :-1].flatten(), q[:, 1:].flatten()]))[0, 1]) < 0.01
    assert abs(torch.corrcoef(torch.stack([q[:-1].flatten(), q[1:].flatten()]))[0, 1]) < 0.01


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_sampled_tokens_lie_in_the_kept_set(data):
    vocab = data.draw(st.integers(2, 16))
    row = torch.tensor(data.draw(st.lists(st.floats(-4.0, 4.0, width=32), min_size=vocab, max_size=vocab)))
    params = SamplingParams(
        temperature=data.draw(st.floats(0.05, 2.0)),
        top_k=data.draw(st.integers(-1, vocab)),
        top_p=data.draw(st.floats(0.05, 1.0)),
        min_p=data.draw(st.floats(0.0, 0.9)),
    )
    repeats = 200
    batch = make_batch([params] * repeats, vocab, torch.device("cpu"))
    kept = torch.isfinite(
        apply_top_k_top_p(
            apply_min_p(row.unsqueeze(0) / batch.temperature[0], batch.min_p[:1]), batch.top_k[:1], batch.top_p[:1]
        )
    )[0]
    sampled = sampler(row.expand(repeats, vocab), batch).token_ids
    assert kept[sampled].all()


@pytest.mark.parametrize(
    ("params", "processed"),
    [
        (SamplingParams(), lambda x: x),
        (SamplingParams(temperature=0.5), lambda x: x / 0.5),
        (SamplingParams(top_k=3), lambda x: apply_top_k_top_p(x, torch.tensor([3]), None)),
        (SamplingParams(top_p=0.7), lambda x: apply_top_k_top_p(x, None, torch.tensor([0.7]))),
        (SamplingParams(min_p=0.2), lambda x: apply_min_p(x, torch.tensor([0.2]))),
    ],
)
def test_empirical_frequencies_match_the_processed_softmax(params, processed):
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.3, 0.0, -1.0]])
    expected = processed(logits)[0].softmax(-1)
    draws = 20_000
    batch = make_batch([params] * draws, logits.shape[1], torch.device("cpu"))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        tokens = sampler(logits.expand(draws, -1), batch).token_ids
    frequencies = torch.bincount(tokens, minlength=logits.shape[1]).float() / draws
    assert (frequencies - expected).abs().max() < 0.015  # ~4 standard deviations at p = 0.5
    assert frequencies[expected == 0].sum() == 0


def test_logprobs_are_raw_with_top_k_columns_and_ranks(device):
    vocab = 40
    logits = random_logits(4, vocab, device, seed=5, scale=2.0)
    params = [
        SamplingParams(temperature=0.0, logprobs=3),
        SamplingParams(temperature=0.5, top_k=4, logprobs=None),
        SamplingParams(top_p=0.6, min_p=0.1, logprobs=0, seed=3),
        SamplingParams(temperature=1.3, logprobs=5),
    ]
    out = sampler(logits, make_batch(params, vocab, device))
    raw = logits.float().log_softmax(-1)
    assert out.logprobs.shape == (4, 6) and out.logprob_token_ids.shape == (4, 6)
    assert out.logprobs.dtype == torch.float32 and out.logprob_token_ids.dtype == torch.int64
    assert torch.equal(out.logprob_token_ids[:, 0], out.token_ids)
    torch.testing.assert_close(out.logprobs[:, 0], raw.gather(-1, out.token_ids.unsqueeze(1))[:, 0])
    top = raw.topk(5, dim=-1)
    torch.testing.assert_close(out.logprobs[:, 1:], top.values)
    assert (out.logprobs[:, 1:].diff(dim=-1) <= 0).all()
    torch.testing.assert_close(raw.gather(-1, out.logprob_token_ids[:, 1:]), out.logprobs[:, 1:])
    expected_ranks = [1 + sorted(r.tolist(), reverse=True).index(r[t].item()) for r, t in zip(raw, out.token_ids)]
    assert out.ranks.tolist() == expected_ranks
    assert out.ranks[0].item() == 1  # greedy


def test_rank_counts_every_token_at_least_as_likely(device):
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0, 2.0]], device=device)
    batch = make_batch([SamplingParams(temperature=0.0, logprobs=0)], 5, device)
    out = sampler(logits, batch)
    assert out.token_ids.item() == 1 and out.ranks.item() == 2  # tied with token 2
    assert out.logprobs.shape == (1, 1)


def test_low_precision_logits_are_sampled_in_float32(device):
    vocab = 32
    logits = random_logits(3, vocab, device, seed=8).to(torch.bfloat16)
    params = [
        SamplingParams(temperature=0.0, logprobs=2),
        SamplingParams(top_k=5, logprobs=1),
        SamplingParams(top_p=0.9),
    ]
    out = sampler(logits, make_batch(params, vocab, device))
    assert out.logprobs.dtype == torch.float32 and out.logprobs.shape == (3, 3)
    assert out.token_ids[0].item() == logits[0].float().argmax().item()
    raw = logits.float().log_softmax(-1)
    torch.testing.assert_close(out.logprobs[:, 0], raw.gather(-1, out.token_ids[:, None])[:, 0])


def test_logprobs_are_clamped_to_the_vocab(device):
    batch = make_batch([SamplingParams(logprobs=20)], 4, device)
    out = sampler(random_logits(1, 4, device), batch)
    assert out.logprobs.shape == (1, 5)


def test_sampler_leaves_the_logits_untouched(device):
    logits = random_logits(3, 20, device, seed=4)
    before = logits.clone()
    params = [
        SamplingParams(temperature=0.7, top_k=3, top_p=0.8, min_p=0.1, logprobs=2),
        SamplingParams(temperature=0.0),
        SamplingParams(seed=1),
    ]
    sampler(logits, make_batch(params, 20, device))
    assert torch.equal(logits, before)


@pytest.mark.parametrize("vocab", [500, 8 * 1024, 49152, 262144, 262144 + 77])
def test_argmax_is_torchs_first_index_of_the_maximum(vocab):
    """The vectorised argmax gives torch's index: the first of equal maxima wherever they fall (within a vector,
    across vectors, in the tail past the last whole vector), the first NaN, and 0 for a row of -inf."""
    gen = torch.Generator().manual_seed(vocab)
    x = torch.randn(9, vocab, generator=gen)
    x[1, [vocab // 3, vocab // 2, vocab - 1]] = 10.0  # equal maxima in different blocks: the first
    x[2, [5, 6]] = 10.0  # within one block
    x[3, vocab - 1] = 10.0  # the last logit (the tail where vocab is no multiple of the block)
    x[4, -70] = x[4, 7] = 10.0  # a tie between the first block and the tail
    x[5, [vocab // 2, 3]] = float("nan")  # NaN: the first one, above any number
    x[6] = float("-inf")
    x[7, vocab // 2] = float("inf")
    x[8, -5] = float("nan")
    assert torch.equal(argmax(x), x.argmax(dim=-1))
    assert torch.equal(argmax(x[4:5]), x[4:5].argmax(dim=-1))
    assert torch.equal(argmax(x[:, 1:]), x[:, 1:].argmax(dim=-1))  # not contiguous


@pytest.mark.parametrize("top_p", [1.0, 0.9])
@pytest.mark.parametrize("bad", [float("-inf"), float("nan")])
def test_a_row_with_no_token_to_sample_is_a_clear_error(device, top_p, bad):
    """A row whose logits are all -inf or NaN (no processor makes one: this is the sampler's last guard) fails with
    a ValueError naming the row, on the dense path and on top-p's support, instead of an index out of range."""
    logits = random_logits(3, 50, device)
    logits[1] = bad
    params = [SamplingParams(temperature=0.8, top_p=top_p, seed=s) for s in range(3)]
    with pytest.raises(ValueError, match="row 1 has no token of nonzero probability"):
        sampler(logits, make_batch(params, 50, device))
