from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from fleetserve.api.crd import CRD_FILENAME, crd_manifest, crd_yaml
from fleetserve.api.models import InferenceDeploymentSpec

ROOT = Path(__file__).resolve().parents[2]


def test_checked_in_crd_matches_models() -> None:
    checked_in = (ROOT / "crds" / CRD_FILENAME).read_text()
    assert checked_in == crd_yaml(), "crds/ is stale: run `fleetserve crds -o crds/" + CRD_FILENAME


def test_schema_is_structural_and_defaulted() -> None:
    version = crd_manifest()["spec"]["versions"][0]
    spec = version["schema"]["openAPIV3Schema"]["properties"]["spec"]
    assert spec["required"] == ["model", "roles"]
    kv = spec["properties"]["kvTransfer"]
    assert kv["default"] == {}
    assert kv["properties"]["connector"] == {
        "type": "string",
        "default": "tcp",
        "enum": ["tcp", "mooncake", "none"],
    }
    role = spec["properties"]["roles"]["properties"]["decode"]
    assert "default" not in role
    assert role["properties"]["gpusPerPod"] == {
        "type": "integer",
        "default": 1,
        "minimum": 0,
        "maximum": 16,
    }
    assert role["x-kubernetes-validations"][0]["message"].startswith("tensor × pipeline × data")
    assert "self.parallelism.data" in role["x-kubernetes-validations"][0]["rule"]
    disaggregation = spec["properties"]["router"]["properties"]["disaggregation"]["properties"]
    assert set(disaggregation) == {"mode", "minUncachedTokens"}
    status = version["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]
    assert status["phase"]["enum"] == ["Pending", "Progressing", "Ready", "Degraded", "Failed"]
    assert "compatibilityHash" in status["roles"]["additionalProperties"]["properties"]
    assert set(status["router"]["properties"]) == {"replicas", "readyReplicas"}
    text = yaml.safe_dump(version)
    assert "$ref" not in text and "anyOf" not in text and "title" not in text
    assert version["subresources"] == {"status": {}}
    assert [c["name"] for c in version["additionalPrinterColumns"]] == [
        "Phase",
        "Ready",
        "Prefill",
        "Prefill-Want",
        "Decode",
        "Decode-Want",
        "Endpoint",
        "Age",
    ]


@pytest.mark.parametrize(
    "sample", sorted(p.name for p in (ROOT / "manifests" / "samples").glob("*.yaml"))
)
def test_samples_validate(sample: str) -> None:
    doc = yaml.safe_load((ROOT / "manifests" / "samples" / sample).read_text())
    InferenceDeploymentSpec.model_validate(doc["spec"])


def _spec(**roles: dict) -> dict:
    return {"model": {"name": "m", "source": {"uri": "/m"}}, "roles": roles}


def test_python_validation_mirrors_cel() -> None:
    with pytest.raises(ValidationError, match="multiple of gpusPerPod"):
        InferenceDeploymentSpec.model_validate(
            _spec(prefill={"gpusPerPod": 8, "parallelism": {"tensor": 3}}, decode={})
        )
    with pytest.raises(ValidationError, match=r"model\.moe"):
        InferenceDeploymentSpec.model_validate(
            _spec(prefill={}, decode={"parallelism": {"expert": True}})
        )
    with pytest.raises(ValidationError, match="connector"):
        InferenceDeploymentSpec.model_validate(_spec(unified={}))


@pytest.mark.parametrize(
    ("value", "ok"),
    [
        ("4", True),
        ("500m", True),
        ("1.5", True),
        (".5", True),
        ("2Gi", True),
        ("128M", True),
        ("1e3", True),
        ("lots", False),
        ("-1", False),
        ("1Gb", False),
        ("2 Gi", False),
        ("", False),
    ],
)
def test_resource_quantities_are_checked_in_the_crd_and_in_python(value: str, ok: bool) -> None:
    """engine.cpu/memory and router.cpu/memory: the CRD carries the API server's quantity
    pattern (without a sign), and Python refuses the same strings, naming the field and the
    allowed forms."""
    props = crd_manifest()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]
    spec_props = props["spec"]["properties"]
    for section in ("engine", "router"):
        for name in ("cpu", "memory"):
            field = spec_props[section]["properties"][name]
            assert field["type"] == "string"
            assert (re.fullmatch(field["pattern"], value) is not None) == ok, (section, name)
            body = {**_spec(prefill={}, decode={}), section: {name: value}}
            if ok:
                InferenceDeploymentSpec.model_validate(body)
            else:
                with pytest.raises(
                    ValidationError, match=rf"{section}\.{name}\n.*must be a Kubernetes quantity"
                ):
                    InferenceDeploymentSpec.model_validate(body)


@pytest.mark.parametrize(
    ("role", "ok"),
    [
        ({"gpusPerPod": 4, "parallelism": {"tensor": 2, "data": 2}}, True),
        ({"gpusPerPod": 4, "parallelism": {"tensor": 2, "data": 3}}, False),
        ({"gpusPerPod": 4, "parallelism": {"data": 4}}, True),
        # Data-parallel ranks run in one pod (issue 16: `DPAsyncLLM`).
        ({"gpusPerPod": 2, "parallelism": {"data": 4}}, False),
        ({"gpusPerPod": 0, "parallelism": {"data": 2}}, False),
        ({"gpusPerPod": 0}, True),
    ],
)
def test_data_parallel_counts_in_the_gpus_per_pod_rule(role: dict, ok: bool) -> None:
    """tensor × pipeline × data, the same product in Python as in the CEL rule."""
    body = {**_spec(unified=role), "kvTransfer": {"connector": "none"}}
    if ok:
        spec = InferenceDeploymentSpec.model_validate(body)
        assert spec.roles.unified is not None
        p = spec.roles.unified.parallelism
        assert spec.roles.unified.world_size == p.tensor * p.pipeline * p.data
    else:
        with pytest.raises(ValidationError, match=r"tensor × pipeline × data .* gpusPerPod"):
            InferenceDeploymentSpec.model_validate(body)


def test_api_imports_neither_torch_nor_kopf_and_operator_no_torch() -> None:
    import subprocess
    import sys

    code = (
        "import sys, fleetserve.api.crd, fleetserve.api.compat, fleetserve.api.labels,"
        " fleetserve.api.router_config;"
        "assert not {'torch', 'kopf'} & set(sys.modules), 'api';"
        "import fleetserve.operator.handlers;"
        "assert 'torch' not in sys.modules, 'operator'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
