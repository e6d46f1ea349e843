"""tokenloop's attention kernel reads the paged KV cache in place: it must give softmax(q k^T * scale) v over each
query's causal (and windowed) context, with grouped-query heads, and give each query row the same floats whatever
else is in the call: how its sequence's rows are split into entries, which entries are beside it, the thread count."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import quantized_activations
from tokenloop import kernels
from tokenloop.models import kv_layout

pytestmark = pytest.mark.skipif(kernels._unsupported_reason() is not None, reason=str(kernels._unsupported_reason()))


@pytest.fixture(scope="module", autouse=True)
def built():
    assert kernels.cpu_kernels_available()


def skip_unless_supported(cache_dtype: torch.dtype, head_dim: int) -> None:
    if not kernels.attention_kernel_supports(cache_dtype, head_dim):
        pytest.skip(f"no kernel for a {cache_dtype} cache of head_dim {head_dim} on this CPU")


class Cache:
    """A paged cache with random contents, in the kernel's block layout (its rows, as stored, kept for the
    reference) and, per sequence, a block table of scattered blocks."""

    def __init__(self, gen, kv_heads, head_dim, dtype, block_size, lengths):
        self.block_size = block_size
        blocks_each = [-(-n // block_size) for n in lengths]
        order = torch.randperm(sum(blocks_each) + 3, generator=gen).tolist()  # scattered, some blocks unused
        self.tables, i = [], 0
        for n in blocks_each:
            self.tables.append(order[i : i + n])
            i += n
        slots = (sum(blocks_each) + 3) * block_size
        k_rows, v_rows = (torch.randn(kv_heads, slots, head_dim, generator=gen) for _ in range(2))
        self.k, self.v = kv_layout.from_rows(k_rows, v_rows, block_size, dtype)
        self.k_rows, self.v_rows = kv_layout.rows(self.k, self.v, block_size)  # int8: dequantized

    def slots(self, seq: int, n: int) -> torch.Tensor:
        bs = self.block_size
        return torch.tensor([self.tables[seq][p // bs] * bs + p % bs for p in range(n)])

    def block_tables(self, seqs: list[int]) -> torch.Tensor:
        width = max(len(self.tables[s]) for s in seqs)
        return torch.tensor([self.tables[s] + [0] * (width - len(self.tables[s])) for s in seqs], dtype=torch.int64)


def attend(q, cache, entries, window=0, scale=0.125):
    """entries: (sequence, first position, count), their query rows in order in q."""
    starts = torch.tensor([0] + [c for _, _, c in entries]).cumsum(0)[:-1]
    return torch.ops.tokenloop.paged_attention(
        q,
        cache.k,
        cache.v,
        cache.block_tables([s for s, _, _ in entries]),
        cache.block_size,
        starts,
        torch.tensor([c for _, _, c in entries]),
        torch.tensor([f for _, f, _ in entries]),
        window,
        scale,
    )


def reference(q_rows, cache, seq, first, window, scale):
    """Float64 attention of one sequence's rows at positions first, first + 1, ..."""
    q_heads, kv_heads = q_rows.shape[1], cache.k.shape[0]
    out = []
    for i, q in enumerate(q_rows):
        pos = first + i
        lo = max(pos - window + 1, 0) if window else 0
        slots = cache.slots(seq, pos + 1)[lo:]
        keys = (
            cache.k_rows[:, slots].double().transpose(0, 1).repeat_interleave(q_heads // kv_heads, dim=1)
        )  # [n, q_heads, D]
        values = cache.v_rows[:, slots].double().transpose(0, 1).repeat_interleave(q_heads // kv_heads, dim=1)
        weights = torch.softmax(torch.einsum("hd,nhd->hn", q.double(), keys) * scale, dim=-1)
        out.append(torch.einsum("hn,nhd->hd", weights, values).flatten())
    return torch.stack(out)


CASES = [(9, 3, 64, 0), (4, 4, 16, 0), (8, 1, 256, 0), (4, 2, 40, 0), (4, 1, 256, 20), (4, 2, 16, 8)]
CACHE_DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.int8]


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
@pytest.mark.parametrize("q_heads,kv_heads,head_dim,window", CASES)
def test_each_query_attends_to_its_causal_window_of_the_paged_cache(cache_dtype, q_heads, kv_heads, head_dim, window):
    skip_unless_supported(cache_dtype, head_dim)
    gen = torch.Generator().manual_seed(q_heads * head_dim + window)
    lengths = [70, 1, 130, 33]
    cache = Cache(gen, kv_heads, head_dim, cache_dtype, 16, lengths)
    # a whole prompt, a first token, a chunk after cached tokens, a decode
    entries = [(0, 0, 70), (1, 0, 1), (2, 90, 40), (3, 32, 1)]
    q = torch.randn(sum(c for _, _, c in entries), q_heads, head_dim, generator=gen) * 2
    scale = head_dim**-0.5
    out = attend(q, cache, entries, window, scale)
    expected = torch.cat(
        [reference(q[r : r + c], cache, s, f, window, scale) for (s, f, c), r in zip(entries, [0, 70, 71, 111])]
    )
    error = (out.double() - expected).abs().mean() / expected.abs().mean()
    if cache_dtype == torch.bfloat16:  # bfloat16 products: 8 bits of mantissa on q, k, p and v
        assert error < 0.01
    elif cache_dtype == torch.int8:  # int8 queries (as bfloat16's products), int16 probabilities
        assert error < 0.01
        # The queries as the kernel rounds them (a scale per row, max |q| / 127), against the dequantized cache:
        # what remains is the probabilities' int16 rounding.
        rounded = quantized_activations(q, block=head_dim)
        expected = torch.cat(
            [
                reference(rounded[r : r + c], cache, s, f, window, scale)
                for (s, f, c), r in zip(entries, [0, 70, 71, 111])
            ]
        )
        assert (out.double() - expected).abs().mean() / expected.abs().mean() < 2e-4
    else:
        torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
@pytest.mark.parametrize("q_heads,kv_heads,head_dim,window", CASES)
def test_a_query_row_gets_the_same_floats_however_its_sequence_is_split_and_whatever_is_beside_it(
    cache_dtype, q_heads, kv_heads, head_dim, window
):
    skip_unless_supported(cache_dtype, head_dim)
    gen = torch.Generator().manual_seed(7 + head_dim)
    cache = Cache(gen, kv_heads, head_dim, cache_dtype, 16, [300, 50, 9])
    q = torch.randn(300, q_heads, head_dim, generator=gen)
    whole = attend(q, cache, [(0, 0, 300)], window)
    # Chunks of 1, 7 and 64 rows, each its own call, as chunked prefill and decode compute them.
    for chunk in (1, 7, 64):
        parts = [attend(q[a : a + chunk], cache, [(0, a, min(chunk, 300 - a))], window) for a in range(0, 300, chunk)]
        assert torch.equal(torch.cat(parts), whole), f"chunks of {chunk}"
    # Beside other sequences' rows, in another order, split into entries of one row and of many.
    other = torch.randn(59, q_heads, head_dim, generator=gen)
    mixed = attend(
        torch.cat([other[:50], q[200:], other[50:], q[:200]]),
        cache,
        [(1, 0, 50), (0, 200, 100), (2, 0, 9), *[(0, p, 1) for p in range(200)]],
        window,
    )
    assert torch.equal(mixed[50:150], whole[200:]) and torch.equal(mixed[159:], whole[:200])
    # With one thread and with two.
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(attend(q, cache, [(0, 0, 300)], window), whole)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
@pytest.mark.parametrize("window", [0, 700])
def test_a_long_context_gives_a_row_the_same_floats_in_one_work_item_or_one_a_partition(cache_dtype, window):
    """Past 512 keys a row's context is attended in partitions of 512 keys, folded in order: many rows (a prompt)
    take one work item for all of a row's partitions, a few (a decode) one item a partition, so that the threads
    share a long context. Either way, the same floats; and still the reference's attention."""
    skip_unless_supported(cache_dtype, 64)
    gen = torch.Generator().manual_seed(11)
    n = 1300
    cache = Cache(gen, 3, 64, cache_dtype, 16, [n])
    q = torch.randn(n, 9, 64, generator=gen)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)  # a row alone is split among threads only where there are several
        whole = attend(q, cache, [(0, 0, n)], window)
        for pos in (n - 1, 1100, 1024, 1023, 600, 512, 511, 40):
            assert torch.equal(attend(q[pos : pos + 1], cache, [(0, pos, 1)], window), whole[pos : pos + 1]), pos
        torch.set_num_threads(1)
        assert torch.equal(attend(q[n - 1 :], cache, [(0, n - 1, 1)], window), whole[n - 1 :])
    finally:
        torch.set_num_threads(threads)
    rows = [0, 511, 512, 1100, n - 1]
    expected = torch.cat([reference(q[p : p + 1], cache, 0, p, window, 0.125) for p in rows])
    error = (whole[rows].double() - expected).abs().mean() / expected.abs().mean()
    assert error < (0.01 if cache_dtype in (torch.bfloat16, torch.int8) else 1e-5)


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
def test_the_block_size_changes_no_float(cache_dtype):
    skip_unless_supported(cache_dtype, 64)
    gen = torch.Generator().manual_seed(3)
    keys, values = (torch.randn(3, 320, 64, generator=gen) for _ in range(2))
    q = torch.randn(300, 9, 64, generator=gen)
    outs = []
    for block_size in (16, 32, 64):
        k, v = kv_layout.from_rows(keys, values, block_size, cache_dtype)
        table = torch.arange(320 // block_size).unsqueeze(0)
        one = torch.tensor([1])
        outs.append(
            torch.cat(
                [
                    torch.ops.tokenloop.paged_attention(
                        q[a : a + 1], k, v, table, block_size, torch.tensor([0]), one, torch.tensor([a]), 0, 0.125
                    )
                    for a in range(0, 300, 37)
                ]
                + [
                    torch.ops.tokenloop.paged_attention(
                        q, k, v, table, block_size, torch.tensor([0]), torch.tensor([300]), torch.tensor([0]), 0, 0.125
                    )
                ]
            )
        )
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def test_bad_inputs_raise_a_clear_error():
    cache = Cache(torch.Generator().manual_seed(0), 2, 16, torch.float32, 16, [8])
    q = torch.randn(8, 4, 16)
    with pytest.raises(RuntimeError, match="cover q's 8 rows"):
        attend(q, cache, [(0, 0, 7)])
    with pytest.raises(RuntimeError, match="longer than its block table"):
        attend(q[:1], cache, [(0, 16, 1)])
    with pytest.raises(RuntimeError, match="block_size must be a multiple of 16"):
        cache.block_size = 8
        attend(q, cache, [(0, 0, 8)])
    cache.block_size = 16
    with pytest.raises(RuntimeError, match="multiple of the cache's KV heads"):
        attend(torch.randn(8, 3, 16), cache, [(0, 0, 8)])
    with pytest.raises(RuntimeError, match="bfloat16, float16, float32 or int8"):
        cache.k, cache.v = cache.k.double(), cache.v.double()
        attend(q, cache, [(0, 0, 8)])
