from __future__ import annotations

import pytest

from fleetserve.api.compat import (
    compatibility_hash,
    resolved_dtype,
    role_compatibility_hashes,
)
from fleetserve.api.models import InferenceDeploymentSpec


def _spec(dtype: str, prefill_gpus: int, decode_gpus: int) -> InferenceDeploymentSpec:
    return InferenceDeploymentSpec.model_validate(
        {
            "model": {"name": "m", "source": {"uri": "/m"}, "dtype": dtype},
            "roles": {
                "prefill": {"gpusPerPod": prefill_gpus},
                "decode": {"gpusPerPod": decode_gpus},
            },
        }
    )


def test_auto_resolves_per_device() -> None:
    spec = _spec("auto", 0, 1)
    assert spec.roles.prefill is not None and spec.roles.decode is not None
    assert resolved_dtype("auto", spec.roles.prefill) == "float32"
    assert resolved_dtype("auto", spec.roles.decode) == "auto@cuda"
    assert resolved_dtype("bfloat16", spec.roles.prefill) == "bfloat16"


def test_auto_on_cpu_hashes_as_float32() -> None:
    assert role_compatibility_hashes(_spec("auto", 0, 0)) == role_compatibility_hashes(
        _spec("float32", 0, 0)
    )
    assert compatibility_hash(_spec("auto", 0, 0)) == compatibility_hash(_spec("float32", 0, 0))
    # On a GPU the checkpoint decides, so "auto" is not float32 there.
    assert compatibility_hash(_spec("auto", 1, 1)) != compatibility_hash(_spec("float32", 1, 1))


def test_an_explicit_dtype_pairs_across_devices() -> None:
    hashes = role_compatibility_hashes(_spec("float32", 0, 1))
    assert hashes["prefill"] == hashes["decode"]
    assert compatibility_hash(_spec("float32", 0, 1)) == hashes["prefill"]


def test_auto_on_mixed_devices_cannot_pair() -> None:
    spec = _spec("auto", 0, 1)
    hashes = role_compatibility_hashes(spec)
    assert hashes["prefill"] != hashes["decode"]
    with pytest.raises(
        ValueError, match=r"set model\.dtype explicitly, or give the roles matching"
    ):
        compatibility_hash(spec)
    with pytest.raises(
        ValueError, match=r"roles\.prefill runs float32, roles\.decode runs auto@cuda"
    ):
        compatibility_hash(spec)


def test_hash_covers_the_kv_format() -> None:
    base = _spec("bfloat16", 1, 1)
    changed = InferenceDeploymentSpec.model_validate(
        {
            **base.model_dump(by_alias=True),
            "model": {**base.model.model_dump(by_alias=True), "blockSize": 32},
        }
    )
    assert compatibility_hash(base) != compatibility_hash(changed)
    more_tp = InferenceDeploymentSpec.model_validate(
        {
            **base.model_dump(by_alias=True),
            "roles": {
                "prefill": {"gpusPerPod": 1},
                "decode": {"gpusPerPod": 2, "parallelism": {"tensor": 2}},
            },
        }
    )
    assert compatibility_hash(base) == compatibility_hash(more_tp)
