"""SamplingParams: vLLM defaults, normalization, and validation errors that quote the value."""

import pytest

from k3serve.engine.sampling_params import SamplingParams


def test_defaults_match_vllm():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert (p.max_tokens, p.min_tokens, p.seed, p.logprobs, p.prompt_logprobs) == (16, 0, None, None, None)
    assert p.stop == [] and p.stop_token_ids == [] and p.logit_bias is None
    assert p.skip_special_tokens and not p.include_stop_str_in_output and not p.ignore_eos
    assert not p.is_greedy and not p.has_penalties


def test_stop_is_normalized_to_a_list():
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=("a", "bc")).stop == ["a", "bc"]
    assert SamplingParams(stop_token_ids=(3, 4)).stop_token_ids == [3, 4]


def test_greedy_below_eps_and_filters_reset():
    p = SamplingParams(temperature=0.0, top_p=0.5, top_k=5, min_p=0.2)
    assert p.is_greedy
    assert (p.top_p, p.top_k, p.min_p) == (1.0, 0, 0.0)
    assert SamplingParams(temperature=1e-6).is_greedy
    assert not SamplingParams(temperature=1e-4).is_greedy


def test_top_k_minus_one_means_off():
    assert SamplingParams(top_k=-1).top_k == 0


@pytest.mark.parametrize(
    "kwargs, quoted",
    [
        (dict(n=2), "n=2"),
        (dict(temperature=-0.5), "temperature=-0.5"),
        (dict(temperature=float("nan")), "temperature=nan"),
        (dict(top_p=0.0), "top_p=0.0"),
        (dict(top_p=1.5), "top_p=1.5"),
        (dict(top_k=-2), "top_k=-2"),
        (dict(min_p=1.5), "min_p=1.5"),
        (dict(presence_penalty=3.0), "presence_penalty=3.0"),
        (dict(frequency_penalty=-2.5), "frequency_penalty=-2.5"),
        (dict(repetition_penalty=0.0), "repetition_penalty=0.0"),
        (dict(max_tokens=-1), "max_tokens=-1"),
        (dict(max_tokens=0), "max_tokens=0"),
        (dict(min_tokens=-1), "min_tokens=-1"),
        (dict(min_tokens=8, max_tokens=4), "min_tokens=8, max_tokens=4"),
        (dict(logprobs=-1), "logprobs=-1"),
        (dict(prompt_logprobs=-3), "prompt_logprobs=-3"),
        (dict(seed="7"), "seed='7'"),
        (dict(stop=["ok", ""]), "''"),
        (dict(stop_token_ids=[1, -5]), "-5"),
        (dict(keep_special_token_ids=[True]), "keep_special_token_ids"),
        (dict(logit_bias={-1: 1.0}), "key -1"),
        (dict(logit_bias={"5": 1.0}), "key '5'"),
        (dict(logit_bias={True: 1.0}), "key True"),
        (dict(logit_bias={5: 200}), "got 200 for token 5"),
        (dict(logit_bias={5: -100.5}), "got -100.5 for token 5"),
        (dict(logit_bias={5: float("nan")}), "got nan for token 5"),
        (dict(logit_bias={5: float("inf")}), "got inf for token 5"),
        (dict(logit_bias={5: "1"}), "got '1' for token 5"),
        (dict(logit_bias=[(5, 1.0)]), "logit_bias=[(5, 1.0)]"),
    ],
    ids=lambda v: str(v) if isinstance(v, str) else None,
)
def test_invalid_values_raise_and_quote_the_value(kwargs, quoted):
    with pytest.raises(ValueError) as err:
        SamplingParams(**kwargs)
    assert quoted in str(err.value)


def test_max_tokens_none_is_allowed():
    assert SamplingParams(max_tokens=None, min_tokens=100).max_tokens is None


def test_logit_bias_is_normalized_and_its_errors_name_it():
    assert SamplingParams(logit_bias={}).logit_bias is None  # no bias at all: the sampler skips the row
    p = SamplingParams(logit_bias={3: 1, 0: -100, 7: 100.0})
    assert p.logit_bias == {3: 1.0, 0: -100.0, 7: 100.0} and all(type(v) is float for v in p.logit_bias.values())
    with pytest.raises(ValueError, match="^logit_bias must"):  # the API names the param from the message's start
        SamplingParams(logit_bias={1: 101})
