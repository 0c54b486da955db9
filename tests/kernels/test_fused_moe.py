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
