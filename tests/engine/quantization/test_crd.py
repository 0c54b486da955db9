"""The CRD's `model.quantization` is one of the engine's `--quantization` values and is rendered
as that flag into every engine pod."""

from __future__ import annotations

import typing

import pytest
from pydantic import ValidationError

from fleetserve.api.models import InferenceDeploymentSpec, ModelSpec
from fleetserve.engine.quantization.resolve import QUANTIZATION_CHOICES
from fleetserve.operator.render import engine_args


def _crd_values() -> tuple[str, ...]:
    annotation = ModelSpec.model_fields["quantization"].annotation
    (literal, _none) = typing.get_args(annotation)
    return typing.get_args(literal)


def test_crd_values_are_engine_choices_that_need_no_extra_config() -> None:
    assert set(_crd_values()) <= set(QUANTIZATION_CHOICES)
    # 'online' needs a JSON config and mxfp4/mxfp8 are not built: not offered by the CRD.
    assert not {"online", "mxfp4", "mxfp8"} & set(_crd_values())


def test_quantization_renders_as_the_engine_flag_and_bad_values_fail_admission() -> None:
    spec = InferenceDeploymentSpec.model_validate({
        "model": {"name": "m", "source": {"uri": "/m"}, "quantization": "int8"},
        "roles": {"unified": {"replicas": 1}}, "kvTransfer": {"connector": "none"},
    })  # fmt: skip
    assert spec.roles.unified is not None
    args = engine_args(spec, "unified", spec.roles.unified)
    assert args[args.index("--quantization") + 1] == "int8"
    plain = spec.model_copy(update={"model": spec.model.model_copy(update={"quantization": None})})
    assert "--quantization" not in engine_args(plain, "unified", plain.roles.unified)
    with pytest.raises(ValidationError, match="quantization"):
        ModelSpec.model_validate({"name": "m", "source": {"uri": "/m"}, "quantization": "int3"})
