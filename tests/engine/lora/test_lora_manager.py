"""The seed's LoRA scenarios (notes part 3 §4, L1–L3) on a real tiny model's wrapped layers."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fleetserve.engine.config import EngineConfig
from fleetserve.engine.lora.config import LoRAConfig
from fleetserve.engine.lora.layers import LoRALinear, LoRAStepState
from fleetserve.engine.lora.manager import LoRAModelManager, create_lora_modules
from fleetserve.engine.lora.runner import LoRARunner
from fleetserve.engine.lora.weights import LoRAModel
from tests.engine.lora.adapters import TinyLoRAs
from tests.engine.tiny_models import load_engine_model

QKV = "model.layers.0.self_attn.qkv_proj"
O_PROJ = "model.layers.0.self_attn.o_proj"


def wrapped_model(tiny_loras: TinyLoRAs, **lora: int) -> tuple[nn.Module, LoRARunner]:
    config = EngineConfig.create(
        str(tiny_loras.base), dtype="float32", max_model_len=64, enable_lora=True, max_lora_rank=8,
        **lora,
    )  # fmt: skip
    assert config.lora is not None
    model = load_engine_model(config)
    return model, LoRARunner(config.lora, model, 64, torch.device("cpu"))


def adapters(tiny_loras: TinyLoRAs) -> list[LoRAModel]:
    paths = [tiny_loras.a, tiny_loras.b, tiny_loras.c]
    return [LoRAModel.from_folder(i + 1, str(p), max_rank=8) for i, p in enumerate(paths)]


def slot_is_zero(module: LoRALinear, slot: int) -> bool:
    return not module.lora_a[slot].any() and not module.lora_b[slot].any()


def test_l1_a_third_activation_over_max_loras_2_raises_and_reactivation_is_a_no_op(
    tiny_loras: TinyLoRAs,
) -> None:
    _, runner = wrapped_model(tiny_loras, max_loras=2, max_cpu_loras=3)
    manager = runner.manager
    for lora in adapters(tiny_loras):
        manager.add_adapter(lora)
    assert manager.activate_adapter(1) and manager.activate_adapter(2)
    assert manager.lora_index_to_id == [1, 2]
    with pytest.raises(ValueError, match="No free lora slots"):
        manager.activate_adapter(3)
    qkv = manager.modules[QKV]
    before = qkv.lora_a[0].clone()
    assert manager.activate_adapter(1) is False
    assert manager.lora_index_to_id == [1, 2]
    assert torch.equal(qkv.lora_a[0], before)


def test_l2_a_third_registration_over_max_cpu_loras_2_evicts_the_lru_and_frees_its_slot(
    tiny_loras: TinyLoRAs,
) -> None:
    _, runner = wrapped_model(tiny_loras, max_loras=2, max_cpu_loras=2)
    manager = runner.manager
    a, b, c = adapters(tiny_loras)
    manager.add_adapter(a)
    manager.add_adapter(b)
    manager.activate_adapter(1)
    manager.activate_adapter(2)  # using b makes a the least recently used
    assert not slot_is_zero(manager.modules[QKV], 0)
    manager.add_adapter(c)
    assert manager.registered_ids == [2, 3]
    assert manager.lora_index_to_id == [None, 2], "CPU eviction deactivated a's slot"
    assert all(slot_is_zero(m, 0) for m in manager.modules.values())
    # The device level is independent: the freed slot takes c.
    manager.activate_adapter(3)
    assert manager.lora_index_to_id == [3, 2]


def test_l3_a_module_the_adapter_has_no_weights_for_gets_a_zeroed_slot(
    tiny_loras: TinyLoRAs,
) -> None:
    _, runner = wrapped_model(tiny_loras, max_loras=2, max_cpu_loras=2)
    manager = runner.manager
    b, a = adapters(tiny_loras)[1], adapters(tiny_loras)[0]
    manager.add_adapter(b)
    manager.activate_adapter(2)  # slot 0 holds b: every projection
    manager.deactivate_adapter(2)
    manager.add_adapter(a)
    manager.activate_adapter(1)  # slot 0 again: a has q, v and down only
    o_proj, qkv = manager.modules[O_PROJ], manager.modules[QKV]
    assert slot_is_zero(o_proj, 0), "b's o_proj weights were cleared"
    rank, (q, k, _v) = 8, (p.size for p in qkv.parts)
    assert qkv.lora_a[0, :rank].any() and qkv.lora_a[0, 2 * rank :].any()
    assert not qkv.lora_a[0, rank : 2 * rank].any(), "k (no weights in a) is zero"
    assert not qkv.lora_b[0, :, q : q + k].any(), "nothing of a leaks into k's outputs"


def test_l3_an_aliased_module_is_wrapped_once_and_keeps_its_weights(
    tiny_loras: TinyLoRAs,
) -> None:
    config = EngineConfig.create(str(tiny_loras.base), dtype="float32", max_model_len=64)
    model = load_engine_model(config)
    layer = model.model.layers[0]
    layer.o_proj_alias = layer.self_attn.o_proj  # one module, two paths
    state = LoRAStepState(64, 2, torch.device("cpu"))
    modules = create_lora_modules(model, model.stacked_params_mapping(), 2, 8, state)
    assert layer.o_proj_alias is layer.self_attn.o_proj
    assert isinstance(layer.o_proj_alias, LoRALinear)
    wrappers = [m for m in modules.values() if m is layer.self_attn.o_proj]
    assert len(wrappers) == 1, "registered once"
    manager = LoRAModelManager(modules, state, max_loras=2, max_cpu_loras=2)
    manager.add_adapter(adapters(tiny_loras)[1])
    manager.activate_adapter(2)
    assert not slot_is_zero(layer.o_proj_alias, 0), "the alias kept the weights just set"


def test_l3_an_out_of_band_activation_rebuilds_the_token_slot_map(tiny_loras: TinyLoRAs) -> None:
    _, runner = wrapped_model(tiny_loras, max_loras=2, max_cpu_loras=3)
    manager = runner.manager
    for lora in adapters(tiny_loras):
        manager.add_adapter(lora)
    manager.set_active_adapters([1, 2])
    assert manager.set_adapter_mapping([1, 0, 2], [2, 1, 1]) is True
    assert runner.state.token_slots[:4].tolist() == [0, 0, -1, 1]
    assert manager.set_adapter_mapping([1, 0, 2], [2, 1, 1]) is False, "unchanged: kept"
    # Out of band: 1 leaves its slot, 3 takes it, 1 comes back into the other slot.
    manager.deactivate_adapter(1)
    manager.deactivate_adapter(2)
    manager.activate_adapter(3)
    manager.activate_adapter(2)
    manager.deactivate_adapter(3)
    manager.activate_adapter(1)
    assert manager.lora_index_to_id == [1, 2] or manager.lora_index_to_id == [2, 1]
    moved = manager.lora_index_to_id != [1, 2]
    assert manager.set_adapter_mapping([1, 0, 2], [2, 1, 1]) is moved
    slot_1, slot_2 = manager.lora_index_to_id.index(1), manager.lora_index_to_id.index(2)
    assert runner.state.token_slots[:4].tolist() == [slot_1, slot_1, -1, slot_2]


def test_a_step_needing_more_adapters_than_slots_is_refused(tiny_loras: TinyLoRAs) -> None:
    _, runner = wrapped_model(tiny_loras, max_loras=2, max_cpu_loras=3)
    for lora in adapters(tiny_loras):
        runner.manager.add_adapter(lora)
    with pytest.raises(ValueError, match="needs 3 adapters but max_loras is 2"):
        runner.manager.set_active_adapters([1, 2, 3])


@pytest.mark.parametrize("segmented", [True, False], ids=["segmented", "masked"])
def test_the_fused_projection_adds_each_parts_own_low_rank_term(
    tiny_loras: TinyLoRAs, segmented: bool
) -> None:
    _, runner = wrapped_model(tiny_loras, max_loras=2, max_cpu_loras=2)
    runner.state.segmented = segmented
    b = adapters(tiny_loras)[1]
    runner.manager.add_adapter(b)
    runner.manager.set_active_adapters([2])
    runner.manager.set_adapter_mapping([0, 2], [1, 2])
    qkv = runner.manager.modules[QKV]
    x = torch.randn(3, qkv.base.input_size, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        out = qkv(x)
        base = qkv.base(x)
    assert torch.equal(out[0], base[0]), "a base-model token is exactly the base output"
    prefix = QKV.removesuffix("qkv_proj")
    parts = [b.weights[prefix + name] for name in ("q_proj", "k_proj", "v_proj")]
    delta = torch.cat([(x[1:] @ w.lora_a.t() @ w.lora_b.t()) * b.scaling for w in parts], dim=1)
    torch.testing.assert_close(out[1:], base[1:] + delta, rtol=1e-4, atol=1e-4)


def test_lora_config_refuses_what_it_cannot_hold() -> None:
    with pytest.raises(ValueError, match="max_cpu_loras must be >= max_loras"):
        LoRAConfig(max_loras=3, max_cpu_loras=2)
    with pytest.raises(ValueError, match="max_lora_rank must be one of"):
        LoRAConfig(max_lora_rank=12)


def test_the_segmented_and_the_masked_matmul_agree_on_a_mixed_step(tiny_loras: TinyLoRAs) -> None:
    _, runner = wrapped_model(tiny_loras, max_loras=2, max_cpu_loras=3)
    for lora in adapters(tiny_loras):
        runner.manager.add_adapter(lora)
    runner.manager.set_active_adapters([3, 1])
    runner.manager.set_adapter_mapping([1, 0, 3, 1], [3, 2, 4, 1])
    x = torch.randn(10, 64, generator=torch.Generator().manual_seed(1))
    for name, module in runner.manager.modules.items():
        inputs = x if module.base.input_size == 64 else torch.randn(10, module.base.input_size)
        with torch.inference_mode():
            runner.state.segmented = True
            segmented = module(inputs)
            runner.state.segmented = False
            masked = module(inputs)
        torch.testing.assert_close(segmented, masked, rtol=1e-5, atol=1e-5, msg=name)
