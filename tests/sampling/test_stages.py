"""distribution_stages shows the engine's own steps: its processors' stages end where apply_processors ends, and
its final stage keeps exactly the tokens Sampler.probs gives a probability, with the same probabilities."""

from __future__ import annotations

import pytest
import torch

from tokenloop.sampling.params import SamplingParams
from tokenloop.sampling.processors import LogitControls, apply_processors
from tokenloop.sampling.sampler import Sampler, SamplingBatch
from tokenloop.sampling.stages import distribution_stages, final_probs

VOCAB = 50
TOKENS = [3, 4, 5, 6, 7, 3, 4]  # prompt of 4, output of 3


def controls(params: SamplingParams) -> LogitControls | None:
    return LogitControls.for_request(params, 4, lambda text: [ord(text[-1]) % VOCAB], [1])


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.7, top_k=10, top_p=0.8, min_p=0.05, seed=1),
        SamplingParams(temperature=1.3, repetition_penalty=1.5, logit_bias={9: 5.0}, min_tokens=5, top_p=0.9),
        SamplingParams(temperature=0.9, no_repeat_ngram_size=2, bad_words=["x"], allowed_token_ids=list(range(30))),
        SamplingParams(temperature=0, presence_penalty=1.0, frequency_penalty=0.5),
    ],
)
def test_the_stages_end_where_the_engine_ends(params):
    torch.manual_seed(0)
    logits = torch.randn(VOCAB) * 3
    stages = distribution_stages(logits, params, TOKENS, controls(params))
    assert stages[0].name == "raw" and torch.equal(stages[0].logits, logits)
    names = [s.name for s in stages]
    processed = apply_processors(logits[None], [params], [TOKENS], [controls(params)])[0]
    last_processor = [s for s in stages if s.name not in ("temperature", "min_p", "top_k", "top_p", "final")][-1]
    assert torch.equal(last_processor.logits, processed)
    batch = SamplingBatch.from_params([params], [None], VOCAB, torch.device("cpu"))
    expected = Sampler.probs(processed[None], batch)[0]  # greedy: the processors' logits normalised (the argmax)
    assert names[-1] == "final"
    assert torch.equal(final_probs(stages), expected)  # the engine's floats, to the bit


def test_a_processor_that_changes_nothing_is_no_stage():
    params = SamplingParams(temperature=1.0, logit_bias={2: 1.0}, min_tokens=1)  # the output has 3 tokens already
    names = [s.name for s in distribution_stages(torch.zeros(VOCAB), params, TOKENS, controls(params))]
    assert names == ["raw", "logit_bias", "temperature", "final"]
