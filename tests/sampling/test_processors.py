"""Property tests of the masking functions: top-k, top-p, min-p, alone and combined."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenloop.sampling.sampler import apply_min_p, apply_top_k_top_p

# Floating boundaries (cumulative mass == p, prob == min_p × max) are decided by float32 rounding;
# the properties below hold up to this slack.
TOL = 1e-5

# Small integers make ties common; floats cover the rest.
logit_values = st.one_of(st.integers(-3, 3).map(float), st.floats(-8.0, 8.0, width=32))


@st.composite
def logits_rows(draw, max_vocab: int = 12) -> torch.Tensor:
    rows = draw(st.integers(1, 4))
    vocab = draw(st.integers(1, max_vocab))
    values = draw(st.lists(st.lists(logit_values, min_size=vocab, max_size=vocab), min_size=rows, max_size=rows))
    return torch.tensor(values, dtype=torch.float32)  # [B, V]


def per_row(logits: torch.Tensor, strategy) -> st.SearchStrategy:
    return st.lists(strategy, min_size=logits.shape[0], max_size=logits.shape[0])


def stable_descending_order(row: torch.Tensor) -> list[int]:
    """Token ids by logit, highest first; equal logits by lower id first."""
    return sorted(range(len(row)), key=lambda i: (-row[i].item(), i))


def assert_is_nucleus(probs: torch.Tensor, kept: torch.Tensor, p: float) -> None:
    """kept is a most-likely-first prefix whose mass reaches p, and dropping its least likely token would not."""
    kept_probs, dropped_probs = probs[kept], probs[~kept]
    assert kept.any()
    if dropped_probs.numel():
        assert kept_probs.min() >= dropped_probs.max()
    mass = kept_probs.sum().item()
    assert mass >= p - TOL
    assert mass - kept_probs.min().item() < p + TOL


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_top_k_keeps_exactly_the_k_largest_lowest_id_first_on_ties(data):
    logits = data.draw(logits_rows())
    vocab = logits.shape[1]
    ks = data.draw(per_row(logits, st.integers(1, vocab)))
    out = apply_top_k_top_p(logits, torch.tensor(ks), None)
    for row, k, masked in zip(logits, ks, out):
        kept = torch.isfinite(masked)
        assert sorted(kept.nonzero().flatten().tolist()) == sorted(stable_descending_order(row)[:k])
        assert torch.equal(masked[kept], row[kept])


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_top_p_keeps_the_minimal_most_likely_prefix_reaching_p(data):
    logits = data.draw(logits_rows())
    ps = data.draw(per_row(logits, st.floats(0.01, 1.0)))
    out = apply_top_k_top_p(logits, None, torch.tensor(ps))
    for row, p, masked in zip(logits, ps, out):
        kept = torch.isfinite(masked)
        assert_is_nucleus(row.double().softmax(-1), kept, p)
        assert kept[row.argmax()]
        assert torch.equal(masked[kept], row[kept])


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_min_p_keeps_tokens_at_least_min_p_times_the_top_probability(data):
    logits = data.draw(logits_rows())
    min_ps = data.draw(per_row(logits, st.floats(0.0, 1.0)))
    out = apply_min_p(logits, torch.tensor(min_ps))
    for row, min_p, masked in zip(logits, min_ps, out):
        probs = row.double().softmax(-1)
        threshold = min_p * probs.max()
        kept = torch.isfinite(masked)
        assert kept[probs >= threshold * (1 + TOL)].all()
        assert not kept[probs < threshold * (1 - TOL)].any()
        assert kept[row.argmax()]
        assert torch.equal(masked[kept], row[kept])


@settings(max_examples=100, deadline=None)
@given(data=st.data())
def test_min_p_then_top_k_then_top_p_compose(data):
    logits = data.draw(logits_rows())
    vocab = logits.shape[1]
    ks = data.draw(per_row(logits, st.integers(1, vocab)))
    ps = data.draw(per_row(logits, st.floats(0.01, 1.0)))
    min_ps = data.draw(per_row(logits, st.floats(0.0, 1.0)))
    after_min_p = apply_min_p(logits, torch.tensor(min_ps))
    out = apply_top_k_top_p(after_min_p, torch.tensor(ks), torch.tensor(ps))
    for row, k, p, masked_min_p, masked in zip(logits, ks, ps, after_min_p, out):
        kept = torch.isfinite(masked)
        # The survivors of top-k: the first k of min-p's survivors in stable descending order.
        survivors = [i for i in stable_descending_order(row) if torch.isfinite(masked_min_p[i])][:k]
        assert set(kept.nonzero().flatten().tolist()) <= set(survivors)
        # top-p applies to the distribution renormalised over those survivors.
        renormalised = torch.full_like(row, float("-inf"))
        renormalised[survivors] = row[survivors]
        assert_is_nucleus(renormalised.double().softmax(-1), kept, p)


def test_processors_set_to_off_change_nothing():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    vocab = logits.shape[1]
    off_k, off_p = torch.full((3,), vocab), torch.ones(3)
    assert torch.equal(apply_top_k_top_p(logits, off_k, off_p), logits)
    assert torch.equal(apply_top_k_top_p(logits, None, None), logits)
    assert torch.equal(apply_min_p(logits, torch.zeros(3)), logits)


def test_masking_leaves_the_input_untouched():
    logits = torch.randn(2, 20, generator=torch.Generator().manual_seed(1))
    before = logits.clone()
    apply_top_k_top_p(logits, torch.tensor([3, 5]), torch.tensor([0.5, 0.9]))
    apply_min_p(logits, torch.tensor([0.5, 0.1]))
    assert torch.equal(logits, before)


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_top_k_and_top_p_on_a_rows_few_largest_logits_equal_a_full_sort(data):
    """A row is settled on its CANDIDATES largest logits when they hold its top k and its nucleus, else on its
    whole sorted row: the same masks (ties across the candidates' edge, k beyond them, p = 1 beside top-p rows),
    whether tokenloop's kernel or torch.topk selects the candidates."""
    import tokenloop.sampling.sampler as sampler
    from tokenloop import kernels

    logits = data.draw(logits_rows(max_vocab=16))
    vocab = logits.shape[1]
    ks = data.draw(per_row(logits, st.integers(1, vocab + 2)))
    ps = data.draw(per_row(logits, st.one_of(st.just(1.0), st.floats(0.01, 1.0))))
    k, p = torch.tensor(ks).clamp(max=vocab), torch.tensor(ps)
    use_k, use_p = data.draw(st.booleans()), data.draw(st.booleans())
    k, p = (k if use_k else None), (p if use_p else None)
    full, original, available = None, sampler.CANDIDATES, kernels.cpu_kernels_available
    try:
        if data.draw(st.booleans()):
            kernels.cpu_kernels_available = lambda: False  # PyTorch's softmax and torch.topk's candidates
        sampler.CANDIDATES = ()
        full = apply_top_k_top_p(logits, k, p)
        sampler.CANDIDATES = data.draw(st.sampled_from([(1,), (2, 5), (3,), (4, 8)]))
        partial = apply_top_k_top_p(logits, k, p)
    finally:
        sampler.CANDIDATES, kernels.cpu_kernels_available = original, available
    assert torch.equal(partial, full)


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_the_support_found_among_the_candidates_is_the_distributions_nonzero(data):
    """What the exponential race runs over when top-k or top-p leaves few tokens: probs.nonzero() exactly, with
    probs' own values."""
    from tokenloop.sampling.sampler import top_k_top_p, top_k_top_p_support

    logits = data.draw(logits_rows(max_vocab=16))
    vocab = logits.shape[1]
    k = torch.tensor(data.draw(per_row(logits, st.integers(1, vocab))))
    p = torch.tensor(data.draw(per_row(logits, st.one_of(st.just(1.0), st.floats(0.01, 0.99)))))
    k, p = (k, None) if data.draw(st.booleans()) else (None if data.draw(st.booleans()) else k, p)
    dense = top_k_top_p(logits, k, p)
    probs, support, support_probs = top_k_top_p_support(logits, k, p)
    active = (k < vocab if k is not None else False) | (p < 1.0 if p is not None else False)
    if bool(torch.as_tensor(active).all()):
        assert probs is None and torch.equal(support, dense.nonzero())
        assert torch.equal(support_probs, dense[support[:, 0], support[:, 1]])  # the same floats
    else:
        assert support is None and support_probs is None and torch.equal(probs, dense)


def test_a_peaked_row_of_a_real_vocabulary_is_settled_without_a_sort(monkeypatch):
    import tokenloop.sampling.sampler as sampler

    torch.manual_seed(0)
    logits = torch.randn(8, 49152) * 2
    logits[:, :5] += 16.0  # most of the mass on a few tokens, as a language model's rows
    k, p = torch.tensor([40, 49152, 49152, 3, 100, 49152, 3000, 49152]), torch.full((8,), 0.95)
    expected = apply_top_k_top_p(logits, k, p)
    sorts = []  # sorts of whole rows
    argsort = torch.Tensor.argsort
    monkeypatch.setattr(
        torch.Tensor,
        "argsort",
        lambda self, *a, **kw: (
            sorts.append(len(self)) or argsort(self, *a, **kw) if self.shape[-1] == 49152 else argsort(self, *a, **kw)
        ),
    )
    got = apply_top_k_top_p(logits, k, p)
    assert torch.equal(got, expected)
    assert sorts == [1]  # the row whose k (3,000) is beyond the candidates, alone
    monkeypatch.setattr(sampler, "CANDIDATES", ())
    assert torch.equal(apply_top_k_top_p(logits, k, p), expected)
