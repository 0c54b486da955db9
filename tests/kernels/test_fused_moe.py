"""Fused MoE equals the per-token loop reference; the expert alignment is exact."""

from __future__ import annotations

import pytest
import torch

from fleetserve.kernels.reference import fused_moe_ref

# NOTE: looser than one op's tolerance: the kernel rounds the gate/up and activation
# intermediates to the dtype, the reference keeps them in float32.
MOE_TOLERANCES: dict[torch.dtype, float] = {torch.float32: 1e-4, torch.bfloat16: 5e-2}


def test_align_by_expert_groups_and_pads() -> None:
    from fleetserve.kernels.fused_moe import align_by_expert

    # 3 tokens x top-2: pairs 0..5 choose experts [2, 0], [2, 3], [0, 2]; expert 1 gets none.
    ids = torch.tensor([[2, 0], [2, 3], [0, 2]], dtype=torch.int32)
    sorted_ids, block_expert = align_by_expert(ids, num_experts=4, block_m=4)
    pad = 6
    assert sorted_ids.tolist() == [1, 4, pad, pad, 0, 2, 5, pad, 3, pad, pad, pad]
    assert block_expert.tolist() == [0, 2, 3]


@pytest.mark.parametrize(
    ("dtype", "top_k", "renormalize"),
    [(torch.float32, 2, True), (torch.bfloat16, 2, False), (torch.float32, 1, False)],
)
def test_fused_moe_matches_reference(
    dtype: torch.dtype, top_k: int, renormalize: bool, device: torch.device
) -> None:
    from fleetserve.kernels.fused_moe import fused_moe

    gen = torch.Generator().manual_seed(0)
    num_tokens, hidden, inter, num_experts = 9, 48, 40, 5  # odd sizes: partial tiles everywhere

    def rand(*shape: int, std: float = 1.0) -> torch.Tensor:
        return (std * torch.randn(*shape, generator=gen)).to(dtype=dtype, device=device)

    x = rand(num_tokens, hidden)
    w13 = rand(num_experts, 2 * inter, hidden, std=hidden**-0.5)
    w2 = rand(num_experts, hidden, inter, std=inter**-0.5)
    logits = torch.randn(num_tokens, num_experts, generator=gen).to(device)
    out = torch.full_like(x, float("nan"))
    assert fused_moe(x, w13, w2, logits, top_k, renormalize, out=out) is out
    expected = fused_moe_ref(x, w13, w2, logits, top_k, renormalize)
    assert out.dtype == dtype and not out.isnan().any()
    tol = MOE_TOLERANCES[dtype]
    torch.testing.assert_close(out, expected, atol=tol, rtol=tol)


@pytest.mark.gpu
def test_fused_moe_realistic_size_on_gpu() -> None:
    from fleetserve.kernels.fused_moe import fused_moe

    device, dtype = torch.device("cuda"), torch.bfloat16
    num_tokens, hidden, inter, num_experts = 64, 1024, 768, 8
    x = torch.randn(num_tokens, hidden, device=device).to(dtype)
    w13 = (torch.randn(num_experts, 2 * inter, hidden, device=device) * hidden**-0.5).to(dtype)
    w2 = (torch.randn(num_experts, hidden, inter, device=device) * inter**-0.5).to(dtype)
    logits = torch.randn(num_tokens, num_experts, device=device)
    out = fused_moe(x, w13, w2, logits, 2, True)
    torch.testing.assert_close(
        out, fused_moe_ref(x, w13, w2, logits, 2, True), atol=5e-2, rtol=5e-2
    )


def test_fused_experts_skip_other_ranks_experts(device: torch.device) -> None:
    """Ids outside [0, E) (another expert-parallel rank's experts) contribute nothing: the
    kernel equals the torch path, which drops them too."""
    from fleetserve.engine.layers.fused_moe.torch_experts import torch_experts
    from fleetserve.kernels.fused_moe import fused_experts

    gen = torch.Generator().manual_seed(1)
    num_tokens, hidden, inter, num_experts = 7, 32, 24, 3
    x = torch.randn(num_tokens, hidden, generator=gen)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=gen) * hidden**-0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=gen) * inter**-0.5
    ids = torch.randint(-2, num_experts + 2, (num_tokens, 2), generator=gen)
    weights = torch.rand(num_tokens, 2, generator=gen)
    expected = torch_experts(x, w13, w2, weights, ids)
    got = fused_experts(
        x.to(device), w13.to(device), w2.to(device), weights.to(device), ids.to(device)
    )
    torch.testing.assert_close(got.cpu(), expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("ep_rank", [0, 1])
def test_moe_layer_triton_backend_equals_torch(ep_rank: int, device: torch.device) -> None:
    """The same `FusedMoE` (DeepSeek routing: sigmoid, correction bias, grouped top-k, scaling)
    with moe_backend 'triton' and 'torch', on one expert-parallel rank of two."""
    from fleetserve.engine.distributed.group import GroupCoordinator
    from fleetserve.engine.layers.fused_moe import FusedMoE, RoutingConfig
    from fleetserve.engine.layers.layer_context import LayerContext

    routing = RoutingConfig(
        top_k=3, renormalize=True, scoring_func="sigmoid", num_expert_groups=4, topk_groups=2,
        routed_scaling_factor=2.5, use_correction_bias=True,
    )  # fmt: skip
    gen = torch.Generator().manual_seed(2)
    experts, hidden, inter = 8, 32, 16
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen) * hidden**-0.5
    w2 = torch.randn(experts, hidden, inter, generator=gen) * inter**-0.5
    bias = 0.1 * torch.randn(experts, generator=gen)
    x, logits = torch.randn(9, hidden, generator=gen), torch.randn(9, experts, generator=gen)
    outs = {}
    for backend in ("torch", "triton"):
        group = GroupCoordinator([0, 1], ep_rank)
        context = LayerContext(
            dtype=torch.float32, device=device, tp_rank=ep_rank, tp_size=2, tp_group=group,
            ep_rank=ep_rank, ep_size=2, ep_group=group, moe_backend=backend,
        )  # fmt: skip
        layer = FusedMoE(experts, hidden, inter, routing, context)
        layer.reduce_group = None  # one rank's partial sum, compared as is
        local = layer.local_physical_experts
        layer.w13_weight.data.copy_(w13[local.start : local.stop])
        layer.w2_weight.data.copy_(w2[local.start : local.stop])
        assert layer.e_score_correction_bias is not None
        layer.e_score_correction_bias.data.copy_(bias)
        outs[backend] = layer(x.to(device), logits.to(device)).cpu()
    assert outs["torch"].abs().sum() > 0
    torch.testing.assert_close(outs["triton"], outs["torch"], atol=1e-4, rtol=1e-4)


def test_moe_backend_is_selected_like_the_attention_backend(device: torch.device) -> None:
    """'auto' is the kernel on CUDA and torch on the CPU; 'triton' on the CPU needs the
    interpreter (these tests run under it when there is no GPU)."""
    from fleetserve.engine.layers.fused_moe.selector import select_moe_backend

    auto = select_moe_backend("auto", device)
    assert auto == ("triton" if device.type == "cuda" else "torch")
    assert select_moe_backend("triton", device) == "triton"
    with pytest.raises(ValueError, match="moe_backend must be one of"):
        select_moe_backend("cutlass", device)
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv("TRITON_INTERPRET", raising=False)
        with pytest.raises(ValueError, match="moe_backend 'triton' runs on device 'cpu' only"):
            select_moe_backend("triton", torch.device("cpu"))
