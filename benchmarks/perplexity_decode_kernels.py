"""Perplexity of the fast path with every product on the int8-activation kernels, as in decode.

    python benchmarks/perplexity_decode_kernels.py [benchmarks/data/perplexity.txt]

`tokenloop perplexity` scores a text in prefill passes of hundreds of rows, whose linears run dense float32 on
the exact weights; only the LM head runs the kernel. A decode step runs every linear through the kernel, with
activations quantized to int8 per block of 32. This prints the perplexity of the float32 path, of the default
fast path, and of the fast path with the kernels' row limit lifted, so that the number covers decode's arithmetic.
"""

from __future__ import annotations

import sys

from tokenloop import LLM
from tokenloop.engine.perplexity import perplexity
from tokenloop.models import quant


def main() -> None:
    text = open(sys.argv[1] if len(sys.argv) > 1 else "benchmarks/data/perplexity.txt", encoding="utf-8").read()
    results = {}
    for label, dtype, kernel_rows in [("float32", "float32", None), ("auto", "auto", None), ("auto, every row on the kernels", "auto", 10**9)]:
        default_rows = quant.INT4_KERNEL_MAX_ROWS
        quant.INT4_KERNEL_MAX_ROWS = kernel_rows or default_rows  # read at every call of Int4Linear.forward
        try:
            results[label] = perplexity(LLM(dtype=dtype, enable_prefix_caching=False), text).perplexity
        finally:
            quant.INT4_KERNEL_MAX_ROWS = default_rows
    for label, ppl in results.items():
        print(f"{label:32s} perplexity {ppl:8.3f}   {100 * (ppl / results['float32'] - 1):+6.2f}% vs float32")


if __name__ == "__main__":
    main()
