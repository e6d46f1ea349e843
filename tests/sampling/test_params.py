"""SamplingParams rejects out-of-range fields with a ValueError that names the field."""

import pytest

from tokenloop.sampling.params import SamplingParams


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -0.1),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -2),
        ("min_p", -0.1),
        ("min_p", 1.1),
        ("max_tokens", 0),
        ("logprobs", 21),
        ("logprobs", -1),
    ],
)
def test_out_of_range_field_raises_naming_it(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_defaults_and_edges_are_accepted():
    SamplingParams()
    SamplingParams(temperature=0.0, top_p=1.0, top_k=0, min_p=1.0, max_tokens=1, logprobs=20)
    SamplingParams(top_k=-1, max_tokens=None, logprobs=0)


def test_stop_string_becomes_a_list():
    assert SamplingParams(stop="###").stop == ["###"]


def test_temperature_zero_is_greedy():
    assert SamplingParams(temperature=0.0).greedy
    assert not SamplingParams(temperature=0.5).greedy
