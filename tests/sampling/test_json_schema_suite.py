"""The JSON-schema matcher against a vendored slice of the JSON Schema Test Suite (draft 2020-12, data/): the
token sequence of every invalid instance is refused; that of every valid one is accepted, but for the few cases
where llguidance is stricter than the schema (listed, each with its reason). A schema it cannot honour is a
ValueError naming the keyword (listed too): never a looser constraint."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tokenloop.sampling.structured import GrammarCompiler, StructuredOutputsParams

SUITE = Path(__file__).parent / "data" / "json_schema_test_suite"
FILES = sorted(p.name for p in SUITE.glob("*.json"))

# (file, group) -> the error's words: schemas refused at admission, a 400 / ValueError.
REFUSED = {
    ("additionalProperties.json", "additionalProperties with propertyNames"): 'Unimplemented keys: ["propertyNames"]',
    (
        "additionalProperties.json",
        "dependentSchemas with additionalProperties",
    ): 'Unimplemented keys: ["dependentSchemas"]',
    ("allOf.json", "allOf with boolean schemas, some false"): "Unsatisfiable schema",
    ("allOf.json", "allOf with boolean schemas, all false"): "Unsatisfiable schema",
    ("defs.json", "valid definition"): 'Unimplemented keys: ["$dynamicAnchor"]',
    ("defs.json", "invalid definition"): 'Unimplemented keys: ["$dynamicAnchor"]',
    ("maxLength.json", "maxLength validation with a decimal"): "Expected positive integer for 'maxLength'",
    ("minLength.json", "minLength validation with a decimal"): "Expected positive integer for 'minLength'",
    ("minProperties.json", "minProperties validation with a decimal"): "Expected positive integer for 'minProperties'",
}
# (file, group, test) of valid instances the grammar refuses, and why: stricter, never looser.
STRICTER = {
    ("allOf.json", "allOf", "allOf"): "properties come in the schema's order (bar before foo)",
    ("allOf.json", "allOf with base schema", "valid"): "properties come in the schema's order",
    (
        "type.json",
        "integer type matches integers",
        "a float with zero fractional part is an integer",
    ): "an integer is written without a fraction",
}


@pytest.fixture(scope="module")
def compiler(tiny_llm) -> GrammarCompiler:
    return tiny_llm.llm_engine.input_processor.grammars()


def accepts(compiler: GrammarCompiler, grammar: str, text: str, encode) -> bool:
    """Whether the matcher takes every token of `text` and may end there."""
    import llguidance

    matcher = llguidance.LLMatcher(compiler.tokenizer, grammar, log_level=0)
    return all(matcher.consume_token(t) for t in encode(text)) and matcher.is_accepting()


@pytest.mark.parametrize("name", FILES)
def test_the_matcher_refuses_every_invalid_instance_and_accepts_the_valid_ones(compiler, tiny_llm, name):
    encode = lambda text: tiny_llm.get_tokenizer().encode(text, add_special_tokens=False)  # noqa: E731
    checked = refused_groups = 0
    for group in json.loads((SUITE / name).read_text()):
        refused = REFUSED.get((name, group["description"]))
        if refused is not None:
            with pytest.raises(ValueError, match="structured_outputs.json: .*" + re.escape(refused)):
                compiler.grammar(StructuredOutputsParams(json=group["schema"]))
            refused_groups += 1
            continue
        grammar = compiler.grammar(StructuredOutputsParams(json=group["schema"]))
        for case in group["tests"]:
            expected = case["valid"] and (name, group["description"], case["description"]) not in STRICTER
            assert accepts(compiler, grammar, json.dumps(case["data"], ensure_ascii=False), encode) == expected, (
                group["description"],
                case,
            )
            checked += 1
    assert checked + refused_groups > 0
