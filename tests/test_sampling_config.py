"""SamplingConfig to and from SamplingParams, and SamplingParams from a client's values."""

from __future__ import annotations

import dataclasses

from coordinator.sampling_params import sampling_params
from minedraft.engine.sampling import SamplingConfig
from minedraft.proto import generation_pb2

# Every field off its default, each float one a float32 holds exactly (the proto's floats are float32).
FULL = SamplingConfig(
    temperature=0.75,
    top_p=0.5,
    top_k=7,
    seed=2**64 - 1,
    max_tokens=40,
    stop_token_ids=(3, 9),
    ignore_eos=True,
    logprobs=5,
    min_tokens=2,
    min_p=0.125,
    repetition_penalty=1.25,
    presence_penalty=-1.5,
    frequency_penalty=0.25,
    output_tokens=4,
    logit_bias=((5, 1.5), (9, -100.0)),
    prompt_logprobs=3,
    grammar=("choice", '["yes", "no"]', True),
)


def test_every_field_is_set_in_the_full_config() -> None:
    default = SamplingConfig()
    assert [f.name for f in dataclasses.fields(FULL) if getattr(FULL, f.name) == getattr(default, f.name)] == []


def test_a_config_comes_back_from_its_proto() -> None:
    for config in (FULL, SamplingConfig(), SamplingConfig(logprobs=0)):
        assert SamplingConfig.from_proto(config.to_proto(), output_tokens=config.output_tokens) == config


def test_to_proto_sets_every_field_but_stop() -> None:
    every = set(generation_pb2.SamplingParams.DESCRIPTOR.fields_by_name)
    assert {f.name for f, _ in FULL.to_proto().ListFields()} == every - {"stop"}
    assert not SamplingConfig().to_proto().HasField("logprobs")  # None: no log-probabilities


def test_unset_optional_fields_take_their_defaults() -> None:
    config = SamplingConfig.from_proto(generation_pb2.SamplingParams(), max_tokens=12, seed=5)
    assert config == SamplingConfig(max_tokens=12, seed=5)
    assert SamplingConfig.from_proto(generation_pb2.SamplingParams(seed=0), seed=5).seed == 0  # set 0 is not unset


def test_sampling_params_leaves_none_unset_and_other_names_out() -> None:
    params = sampling_params({"top_p": None, "seed": 0, "temperature": 0.5, "n": 3, "stop": ["x"]})
    assert not params.HasField("top_p") and params.HasField("seed")
    assert params == generation_pb2.SamplingParams(seed=0, temperature=0.5, stop=["x"])


def test_every_structured_output_comes_back_from_its_proto() -> None:
    kinds = [("json_schema", '{"type": "integer"}'), ("json_object", ""), ("regex", "a+"), ("grammar", "[0-9]+")]
    for kind, source in kinds:
        config = SamplingConfig(grammar=(kind, source, kind == "json_object"))
        assert SamplingConfig.from_proto(config.to_proto()) == config
    unset = generation_pb2.SamplingParams(structured_output=generation_pb2.StructuredOutput())
    assert SamplingConfig.from_proto(unset).grammar is None  # set without a constraint: none
