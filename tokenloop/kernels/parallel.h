// Work split among the step's threads in chunks that each thread takes as it comes free, instead of at::parallel_for's
// equal shares fixed up front. When another thread takes one of the cores for a while (the server's event loop
// writing a step's outputs, or another process), a fixed share makes the whole step wait for the thread that lost
// its core; here the threads still running take over its chunks. Serving 32 streams on 2 cores, that share was
// about a third of the decode throughput.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

// fn(begin, end) over [0, n) in chunks of `chunk` (the last one shorter), each chunk once, in parallel.
template <typename Fn>
inline void parallel_chunks(int64_t n, int64_t chunk, Fn&& fn) {
  if (n <= chunk || at::get_num_threads() == 1 || at::in_parallel_region()) {
    if (n > 0) fn(int64_t{0}, n);
    return;
  }
  std::atomic<int64_t> next{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    for (int64_t begin = next.fetch_add(chunk, std::memory_order_relaxed); begin < n; begin = next.fetch_add(chunk, std::memory_order_relaxed))
      fn(begin, std::min(n, begin + chunk));
  });
}

// A chunk size for n units of work: about `per_thread` chunks per thread (a late thread's share is that small a
// loss), and no fewer than `min_chunk` units (so a chunk is worth the atomic add and keeps its memory reads long).
inline int64_t chunk_size(int64_t n, int64_t min_chunk, int64_t per_thread = 8) {
  return std::max(min_chunk, n / (at::get_num_threads() * per_thread));
}
