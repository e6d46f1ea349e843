"""Bad speculative configurations are errors at start-up, naming the field: an unknown method or key, a draft
length out of [1, 16], lookup bounds out of order, a draft model whose vocabulary is not the target's."""

from __future__ import annotations

import pytest

from tests.helpers import small_vocab_model
from tokenloop import LLM
from tokenloop.spec_decode.config import SpeculativeConfig


@pytest.mark.parametrize(
    "config, message",
    [
        ({"method": "medusa"}, "method must be one of ngram, draft, eagle, got 'medusa'"),
        ({}, "method is required"),
        (
            {"method": "ngram", "num_speculative_tokens": 0},
            r"num_speculative_tokens must be an integer in \[1, 16\], got 0",
        ),
        (
            {"method": "ngram", "num_speculative_tokens": 17},
            r"num_speculative_tokens must be an integer in \[1, 16\], got 17",
        ),
        ({"method": "ngram", "num_speculative_tokens": 2.5}, "num_speculative_tokens must be an integer"),
        (
            {"method": "ngram", "prompt_lookup_min": 3, "prompt_lookup_max": 2},
            r"prompt_lookup_min \(3\) must not exceed prompt_lookup_max \(2\)",
        ),
        ({"method": "ngram", "prompt_lookup_min": 0}, "prompt_lookup_min must be an integer >= 1"),
        ({"method": "ngram", "num_lookahead": 3}, r"unknown keys \['num_lookahead'\]"),
        ({"method": "ngram", "model": "x"}, "model is for method 'draft'"),
        ({"method": "draft", "adaptive": "yes"}, "adaptive must be true or false"),
    ],
)
def test_a_bad_config_is_a_value_error_naming_the_field(tiny_model_folder, config, message):
    with pytest.raises(ValueError, match=f"speculative_config.*{message}"):
        LLM(tiny_model_folder, dtype="float32", kv_cache_gb=0.01, speculative_config=config)


def test_a_draft_model_with_another_vocabulary_names_both_sizes(tiny_model_folder, tmp_path):
    small_vocab_model(tmp_path, 8, seed=0)
    with pytest.raises(ValueError, match="vocabulary of 8 tokens, the target's has 400"):
        LLM(
            tiny_model_folder,
            dtype="float32",
            kv_cache_gb=0.01,
            speculative_config={"method": "draft", "model": str(tmp_path)},
        )


def test_the_dict_and_the_dataclass_are_one_config():
    config = SpeculativeConfig.of({"method": "draft", "model": "m", "num_speculative_tokens": 8})
    assert SpeculativeConfig.of(config) is config and config.dtype == "auto" and config.adaptive
