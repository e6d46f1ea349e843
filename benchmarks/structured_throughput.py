"""32 concurrent JSON-schema requests against 32 unconstrained ones, offline, on the default model's fast path.

    python benchmarks/structured_throughput.py [--requests 32] [--max-tokens 128]

Both batches use the same prompts and sampling (temperature 0.8, seeded); the constrained one follows a JSON
schema through llguidance's masks. Prints output tokens/s of each, their ratio (goal: constrained >= 0.85x), the
mask time per token (p50 / p99: the matcher's mask and its application to the row), and how many constrained
outputs ended with `stop` and validate against the schema.
"""

from __future__ import annotations

import argparse
import json
import time

import jsonschema
import numpy as np

from tokenloop import LLM, SamplingParams
from tokenloop.sampling import structured
from tokenloop.sampling.structured import StructuredOutputsParams

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 30}, "maxItems": 4},
        "city": {"enum": ["Paris", "London", "Tokyo", "Lima"]},
    },
    "required": ["name", "age", "hobbies", "city"],
    "additionalProperties": False,
}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=128)
    args = p.parse_args()
    llm = LLM()
    prompts = [
        llm.chat_prompt(
            [
                {
                    "role": "user",
                    "content": f"Describe person number {i} as a JSON object with name, age, hobbies and city.",
                }
            ]
        )
        for i in range(args.requests)
    ]
    plain = [SamplingParams(temperature=0.8, seed=i, max_tokens=args.max_tokens) for i in range(args.requests)]
    spec = StructuredOutputsParams(json=SCHEMA)
    constrained = [
        SamplingParams(temperature=0.8, seed=i, max_tokens=args.max_tokens, structured_outputs=spec)
        for i in range(args.requests)
    ]
    llm.generate(prompts[:2], constrained[:2], use_tqdm=False)  # warm: the grammar tokenizer and the compiled step

    mask_s: list[float] = []
    allowed = structured.GrammarMatcher.allowed

    def timed_allowed(self):
        start = time.perf_counter()
        out = allowed(self)
        mask_s.append(time.perf_counter() - start)
        return out

    def rate(params) -> tuple[float, list]:
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start), outs

    free_tps, _ = rate(plain)
    structured.GrammarMatcher.allowed = timed_allowed
    json_tps, outs = rate(constrained)
    structured.GrammarMatcher.allowed = allowed
    stopped = [o.outputs[0] for o in outs if o.outputs[0].finish_reason == "stop"]
    valid = 0
    for c in stopped:
        try:
            jsonschema.validate(json.loads(c.text), SCHEMA)
            valid += 1
        except (json.JSONDecodeError, jsonschema.ValidationError):
            pass
    ms = np.array(mask_s) * 1e3
    print(
        f"structured output, {args.requests} concurrent x {args.max_tokens} tokens ({time.strftime('%Y-%m-%d %H:%M')})"
    )
    print(f"  unconstrained: {free_tps:7.1f} output tokens/s")
    print(f"  JSON schema:   {json_tps:7.1f} output tokens/s  ({json_tps / free_tps:.2f}x; goal >= 0.85x)")
    print(
        f"  mask per row and token: p50 {np.percentile(ms, 50):.3f} ms, p99 {np.percentile(ms, 99):.3f} ms "
        f"({len(ms)} masks)"
    )
    print(f"  finished with stop: {len(stopped)}/{len(outs)}; of those valid against the schema: {valid}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
