"""One tiny Llama and three PEFT adapters of it, shared by the LoRA tests of this folder."""

from __future__ import annotations

import pytest

from tests.engine.lora.adapters import ALL_PROJECTIONS, TinyLoRAs, make_adapter
from tests.engine.tiny_models import make_tiny_model


@pytest.fixture(scope="session")
def tiny_loras(tmp_path_factory: pytest.TempPathFactory) -> TinyLoRAs:
    root = tmp_path_factory.mktemp("lora")
    base = make_tiny_model(root, "llama")
    return TinyLoRAs(
        base=base,
        a=make_adapter(base, root / "a", seed=1, target_modules=["q_proj", "v_proj", "down_proj"]),
        b=make_adapter(
            base,
            root / "b",
            seed=2,
            target_modules=ALL_PROJECTIONS,
            r=4,
            lora_alpha=8,
            use_rslora=True,
        ),
        c=make_adapter(base, root / "c", seed=3, target_modules=["o_proj", "gate_proj", "up_proj"]),
    )
