"""The fused kernels as torch custom ops: each equals its torch reference, its fake (meta)
implementation gives the real op's shapes and dtypes under FakeTensorMode, torch's own op checks
pass (schema, fake, aliasing), and `--custom-ops` selects per op."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from fleetserve.engine.custom_ops import resolve_custom_ops, uses_custom_op
from fleetserve.engine.layers.activation import SiluAndMul
from fleetserve.engine.layers.layer_context import LayerContext
from fleetserve.engine.layers.norm import RMSNorm
from fleetserve.kernels import custom_ops
from fleetserve.kernels.reference import (
    reshape_and_cache_ref,
    rms_norm_ref,
    rotary_ref,
    silu_and_mul_ref,
)


def _rotary_args(device: torch.device) -> tuple[torch.Tensor, ...]:
    torch.manual_seed(0)
    positions = torch.tensor([0, 3, 7, 1], device=device)
    freqs = torch.outer(torch.arange(16.0), 1.0 / 10000 ** (torch.arange(0, 32, 2) / 32))
    emb = torch.cat((freqs, freqs), dim=-1)
    q = torch.randn(4, 4, 32, device=device)
    k = torch.randn(4, 2, 32, device=device)
    return positions, q, k, emb.cos().to(device), emb.sin().to(device)


def test_each_custom_op_equals_its_torch_reference(device: torch.device) -> None:
    torch.manual_seed(0)
    x, residual, weight = (torch.randn(5, 64, device=device) for _ in range(3))
    weight = weight[0].contiguous()
    torch.testing.assert_close(custom_ops.rms_norm(x, weight, 1e-6), rms_norm_ref(x, weight, 1e-6))
    normed, summed = custom_ops.fused_add_rms_norm(x, residual, weight, 1e-6)
    ref_normed, ref_summed = rms_norm_ref(x, weight, 1e-6, residual)
    torch.testing.assert_close(normed, ref_normed)
    torch.testing.assert_close(summed, ref_summed)
    gate_up = torch.randn(5, 128, device=device)
    torch.testing.assert_close(custom_ops.silu_and_mul(gate_up), silu_and_mul_ref(gate_up))
    positions, q, k, cos, sin = _rotary_args(device)
    ref_q, ref_k = rotary_ref(positions, q, k, cos, sin, True)
    assert custom_ops.rotary_embedding(positions, q, k, cos, sin, True) is None  # in place
    torch.testing.assert_close((q, k), (ref_q, ref_k))
    key, value = torch.randn(3, 2, 32, device=device), torch.randn(3, 2, 32, device=device)
    cache = torch.zeros(2, 4, 4, 2, 32, device=device)
    expected = cache.clone()
    slots = torch.tensor([5, -1, 9], device=device)
    custom_ops.reshape_and_cache(key, value, cache, slots)
    reshape_and_cache_ref(key, value, expected, slots)
    assert torch.equal(cache, expected)


def test_fake_implementations_give_the_real_shapes_under_fake_tensor_mode() -> None:
    with FakeTensorMode():
        x = torch.empty(7, 64, dtype=torch.bfloat16)
        w = torch.empty(64, dtype=torch.float32)
        out = torch.ops.fleetserve.rms_norm(x, w, 1e-6)
        assert (out.shape, out.dtype) == ((7, 64), torch.float32)  # promoted like the kernel
        normed, summed = torch.ops.fleetserve.fused_add_rms_norm(x, x, w, 1e-6)
        assert (normed.dtype, summed.shape, summed.dtype) == (torch.float32, (7, 64), x.dtype)
        act = torch.ops.fleetserve.silu_and_mul(torch.empty(7, 256, dtype=torch.float16))
        assert (act.shape, act.dtype) == ((7, 128), torch.float16)
        q, k = torch.empty(7, 4, 32), torch.empty(7, 2, 32)
        table = torch.empty(16, 32)
        positions = torch.zeros(7, dtype=torch.int64)
        assert torch.ops.fleetserve.rotary_embedding(positions, q, k, table, table, True) is None
        cache = torch.empty(2, 4, 4, 2, 32)
        assert torch.ops.fleetserve.reshape_and_cache(k, k, cache, positions) is None


def test_torch_opcheck_schema_fake_and_aliasing(device: torch.device) -> None:
    torch.manual_seed(0)
    x = torch.randn(3, 32, device=device)
    w = torch.randn(32, device=device)
    checks = ("test_schema", "test_faketensor")
    torch.library.opcheck(torch.ops.fleetserve.rms_norm.default, (x, w, 1e-6), test_utils=checks)
    torch.library.opcheck(torch.ops.fleetserve.fused_add_rms_norm.default, (x, x.clone(), w, 1e-6),
                          test_utils=checks)  # fmt: skip
    torch.library.opcheck(torch.ops.fleetserve.silu_and_mul.default, (x,), test_utils=checks)
    positions, q, k, cos, sin = _rotary_args(device)
    torch.library.opcheck(torch.ops.fleetserve.rotary_embedding.default,
                          (positions, q, k, cos, sin, True), test_utils=checks)  # fmt: skip


def test_custom_ops_flag_resolves_per_op_over_the_platform_default() -> None:
    assert resolve_custom_ops("auto", "cuda") == "triton"
    assert resolve_custom_ops("auto", "cpu") == "torch"  # -O0: eager torch ops
    assert resolve_custom_ops("auto", "cpu", cpu_kernels=True) == "triton"  # -O1+: the C++ kernels
    assert resolve_custom_ops("-rotary", "cpu", cpu_kernels=True) == "+rms_norm,+silu_and_mul"
    assert resolve_custom_ops("all", "cpu") == "triton"
    assert resolve_custom_ops("none", "cuda") == "torch"
    assert resolve_custom_ops("triton", "cpu") == "triton"  # the older spellings
    assert resolve_custom_ops("-rotary", "cuda") == "+rms_norm,+silu_and_mul"
    assert resolve_custom_ops("+rms_norm", "cpu") == "+rms_norm"
    assert resolve_custom_ops("all,-rotary,-silu_and_mul", "cpu") == "+rms_norm"
    assert resolve_custom_ops("none,+rms_norm,-rms_norm", "cuda") == "torch"
    for bad in ("+attention", "cuda", "rms_norm"):
        with pytest.raises(ValueError, match=r"custom_ops must be one of .*'rms_norm'"):
            resolve_custom_ops(bad, "cpu")
    assert uses_custom_op("+rms_norm", "rms_norm") and not uses_custom_op("+rms_norm", "rotary")


def test_a_selected_op_runs_as_its_kernel_and_the_others_as_torch(device: torch.device) -> None:
    context = LayerContext(torch.float32, device, custom_ops="+rms_norm")
    norm, act = RMSNorm(64, 1e-6, context), SiluAndMul(context)
    assert norm.use_triton and not act.use_triton
    norm.weight.data.normal_()
    x = torch.randn(3, 64, device=device)
    torch.testing.assert_close(norm(x), rms_norm_ref(x, norm.weight, 1e-6))
    with pytest.raises(ValueError, match="custom_ops must be one of"):
        LayerContext(torch.float32, device, custom_ops="+attention")


def test_dynamo_traces_the_custom_ops_without_a_graph_break(device: torch.device) -> None:
    def block(x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        normed, _ = torch.ops.fleetserve.fused_add_rms_norm(x, residual, w, 1e-6)
        return torch.ops.fleetserve.silu_and_mul(normed)

    compiled = torch.compile(block, backend="eager", fullgraph=True)  # a break would raise
    torch.manual_seed(0)
    x, residual = torch.randn(3, 64, device=device), torch.randn(3, 64, device=device)
    w = torch.randn(64, device=device)
    torch.testing.assert_close(compiled(x, residual, w), block(x, residual, w))
