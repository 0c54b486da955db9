"""The Triton batched LoRA equals the masked torch path (`ops.lora_delta`) token by token."""

from __future__ import annotations

import pytest
import torch

from fleetserve.engine.lora.ops import lora_delta

LORA_TOLERANCES: dict[torch.dtype, float] = {torch.float32: 1e-5, torch.bfloat16: 3e-2}


def _case(
    num_tokens: int,
    num_slots: int,
    width: int,
    in_features: int,
    out_features: int,
    dtype: torch.dtype,
    device: torch.device,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, in_features, generator=gen)
    lora_a = torch.randn(num_slots, width, in_features, generator=gen) * in_features**-0.5
    lora_b = torch.randn(num_slots, width, out_features, generator=gen) * width**-0.5
    # Every slot and the base model (-1) appear whenever there are enough tokens.
    slots = torch.arange(num_tokens, dtype=torch.int64) % (num_slots + 1) - 1
    slots = slots[torch.randperm(num_tokens, generator=gen)]
    return (
        x.to(dtype=dtype, device=device),
        lora_a.to(dtype=dtype, device=device),
        lora_b.to(dtype=dtype, device=device),
        slots.to(device),
    )


def _expected(
    x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, slots: torch.Tensor
) -> torch.Tensor:
    """`lora_delta` in float32 (the kernel accumulates in float32 throughout)."""
    ids = torch.arange(lora_a.shape[0], dtype=torch.int64, device=x.device)
    return lora_delta(x.float(), lora_a.float(), lora_b.float(), slots, ids)


@pytest.mark.parametrize(
    ("num_tokens", "num_slots", "width", "in_features", "out_features", "dtype"),
    [
        (1, 1, 8, 40, 24, torch.float32),
        (7, 3, 16, 37, 53, torch.float32),
        (33, 3, 8, 300, 150, torch.float32),  # several in blocks, two out blocks
        (7, 1, 16, 45, 19, torch.bfloat16),
        (33, 3, 16, 37, 53, torch.bfloat16),
    ],
)
def test_lora_delta_triton_matches_masked_torch(
    num_tokens: int,
    num_slots: int,
    width: int,
    in_features: int,
    out_features: int,
    dtype: torch.dtype,
    device: torch.device,
) -> None:
    from fleetserve.kernels.lora import lora_delta_triton

    x, lora_a, lora_b, slots = _case(
        num_tokens, num_slots, width, in_features, out_features, dtype, device
    )
    out = lora_delta_triton(x, lora_a, lora_b, slots)
    assert out.shape == (num_tokens, out_features) and out.dtype == dtype
    tol = LORA_TOLERANCES[dtype]
    torch.testing.assert_close(out.float(), _expected(x, lora_a, lora_b, slots), atol=tol, rtol=tol)
    ids = torch.arange(num_slots, dtype=torch.int64, device=device)
    torch.testing.assert_close(out, lora_delta(x, lora_a, lora_b, slots, ids), atol=tol, rtol=tol)
    assert (out[slots < 0] == 0).all(), "base-model tokens must get exactly 0"


def test_lora_delta_triton_base_only_and_empty(device: torch.device) -> None:
    import fleetserve.kernels
    from fleetserve.kernels.lora import lora_delta_triton

    assert fleetserve.kernels.lora_delta_triton is lora_delta_triton

    x, lora_a, lora_b, _ = _case(5, 2, 8, 20, 30, torch.float32, device)
    base = torch.full((5,), -1, dtype=torch.int64, device=device)
    assert (lora_delta_triton(x, lora_a, lora_b, base) == 0).all()
    none = torch.empty(0, dtype=torch.int64, device=device)
    assert lora_delta_triton(x[:0], lora_a, lora_b, none).shape == (0, 30)


@pytest.mark.gpu
def test_lora_delta_triton_realistic_size_on_gpu() -> None:
    from fleetserve.kernels.lora import lora_delta_triton

    device = torch.device("cuda")
    # A fused qkv_proj-like layer: 3 parts of rank 16, 4 slots, 300 tokens.
    x, lora_a, lora_b, slots = _case(300, 4, 48, 2048, 2560, torch.bfloat16, device)
    out = lora_delta_triton(x, lora_a, lora_b, slots)
    torch.testing.assert_close(
        out.float(), _expected(x, lora_a, lora_b, slots), atol=3e-2, rtol=3e-2
    )


def test_a_lora_layer_with_use_triton_equals_its_torch_paths(device: torch.device) -> None:
    """The wiring: a wrapped layer on the Triton path adds what the masked and the segmented
    torch paths add (one slot without weights, base-model tokens, a fused 3-part layer)."""
    from fleetserve.engine.layers.layer_context import LayerContext
    from fleetserve.engine.layers.linear import Linear
    from fleetserve.engine.lora.layers import LoRALinear, LoRAStepState
    from fleetserve.engine.lora.weights import LoRAWeights

    gen = torch.Generator().manual_seed(2)
    base = Linear(24, 30, LayerContext(dtype=torch.float32, device=device), bias=False)
    base.output_sizes = [10, 10, 10]  # type: ignore[attr-defined]
    with torch.no_grad():
        base.weight.copy_(torch.randn(30, 24, generator=gen))
    state = LoRAStepState(9, 3, device)
    layer = LoRALinear(base, ["q", "k", "v"], num_slots=3, max_rank=8, state=state)
    for slot, rank in ((0, 8), (2, 4)):  # slot 1 stays empty
        weights = {
            name: LoRAWeights(
                torch.randn(rank, 24, generator=gen).to(device),
                torch.randn(10, rank, generator=gen).to(device),
            )
            for name in ("q", "v")
        }
        layer.set_lora(slot, weights, scaling=0.5)
    slots = torch.tensor([0, -1, 2, 1, 0, 2, -1], dtype=torch.int64, device=device)
    state.token_slots[:7] = slots
    state.active = True
    x = torch.randn(7, 24, generator=gen).to(device)
    with torch.inference_mode():
        state.segmented, state.use_triton = False, True
        triton_out = layer(x)
        state.use_triton = False
        masked_out = layer(x)
        state.segmented = True
        state.segments = [(s, (slots == s).nonzero()[:, 0]) for s in range(3)]
        segmented_out = layer(x)
    assert not torch.equal(masked_out, base(x)), "the adapters must change the output"
    torch.testing.assert_close(triton_out, masked_out, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(triton_out, segmented_out, atol=1e-4, rtol=1e-4)
