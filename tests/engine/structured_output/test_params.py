"""`StructuredOutputsParams` and its place in `SamplingParams`: exactly one constraint, checked
where the request enters (a ValueError naming the field), and a lossless wire form."""

from __future__ import annotations

import pytest

from fleetserve.engine.sampling_params import SamplingParams
from fleetserve.engine.structured_output.params import MAX_SPEC_CHARS, StructuredOutputsParams
from fleetserve.engine.validation import validate_without_tokenizer


@pytest.mark.parametrize(
    ("values", "words"),
    [
        ({}, "exactly one of"),
        ({"regex": "a", "grammar": 'root ::= "a"'}, "exactly one of"),
        ({"json": "{not json"}, "structured_outputs.json is not valid JSON"),
        ({"json": "[1]"}, "must be a JSON schema"),
        ({"json": {"type": "integer", "minimum": "0"}}, "not a valid JSON schema at minimum"),
        ({"regex": "("}, "structured_outputs.regex is not a valid regex"),
        ({"regex": "   "}, "non-empty string"),
        ({"choice": ["a", ""]}, "non-empty list of non-empty strings"),
        ({"choice": "ab"}, "must be a list of strings"),
        ({"grammar": "x" * (MAX_SPEC_CHARS + 1)}, f"at most {MAX_SPEC_CHARS}"),
    ],
)
def test_bad_constraints_name_the_field(values: dict, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        StructuredOutputsParams.create(**values)


def test_the_wire_form_round_trips_through_sampling_params() -> None:
    params = SamplingParams(structured_outputs={"json": {"type": "object"}})
    assert isinstance(params.structured_outputs, StructuredOutputsParams)
    wire = params.to_dict()
    assert wire["structured_outputs"] == {
        "json": '{"type":"object"}', "json_object": False, "regex": None, "choice": None,
        "grammar": None,
    }  # fmt: skip
    assert SamplingParams.from_dict(wire) == params
    assert params.clone(structured_outputs=None).structured_outputs is None
    with pytest.raises(ValueError, match="unknown structured_outputs field"):
        SamplingParams(structured_outputs={"xml": "<a/>"})
    with pytest.raises(ValueError, match="structured_outputs must be"):
        SamplingParams(structured_outputs="json")  # type: ignore[arg-type]


def test_keys_tell_constraints_apart() -> None:
    keys = {
        StructuredOutputsParams(regex="a").key,
        StructuredOutputsParams(grammar="a").key,
        StructuredOutputsParams(choice=("a",)).key,
        StructuredOutputsParams(json_object=True).key,
    }
    assert len(keys) == 4


def test_an_engine_without_a_tokenizer_refuses_constraints() -> None:
    with pytest.raises(ValueError, match=r"structured_outputs .* need a tokenizer"):
        validate_without_tokenizer(SamplingParams(structured_outputs={"regex": "a"}))
