"""RMSNorm (+ fused residual), rotary (neox, gpt-j, partial) and SiLU-and-mul vs the references."""

from __future__ import annotations

import pytest
import torch

from fleetserve.engine.layers.activation import SiluAndMul
from fleetserve.engine.layers.layer_context import LayerContext
from fleetserve.engine.layers.norm import RMSNorm
from fleetserve.engine.layers.rotary import RopeSettings, RotaryEmbedding
from fleetserve.kernels.reference import rms_norm_ref, rotary_ref, silu_and_mul_ref
from tests.kernels.helpers import TOLERANCES, assert_close

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _randn(*shape: int, dtype: torch.dtype, device: torch.device, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(dtype=dtype, device=device)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_matches_the_engine_layer(dtype: torch.dtype, device: torch.device) -> None:
    from fleetserve.kernels.rms_norm import rms_norm

    num_rows, hidden, eps = 7, 200, 1e-6  # hidden not a power of 2: a partial block
    x = _randn(num_rows, hidden, dtype=dtype, device=device)
    layer = RMSNorm(hidden, eps, LayerContext(dtype, device))
    layer.weight.copy_(1.0 + 0.1 * _randn(hidden, dtype=dtype, device=device, seed=1))
    out = torch.full_like(x, float("nan"))
    result = rms_norm(x, layer.weight, eps, out=out)
    assert result is out
    from_layer, from_ref = layer(x), rms_norm_ref(x, layer.weight, eps)
    assert isinstance(from_layer, torch.Tensor) and isinstance(from_ref, torch.Tensor)
    assert_close(out, from_layer, dtype)
    assert_close(out, from_ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_fused_residual(dtype: torch.dtype, device: torch.device) -> None:
    from fleetserve.kernels.rms_norm import rms_norm

    num_rows, hidden, eps = 5, 96, 1e-5
    # A strided input: every other row of a larger buffer.
    x = _randn(2 * num_rows, hidden, dtype=dtype, device=device)[::2]
    residual = _randn(num_rows, hidden, dtype=dtype, device=device, seed=2)
    weight = _randn(hidden, dtype=dtype, device=device, seed=3)
    out = torch.full_like(residual, float("nan"))
    residual_out = torch.full_like(residual, float("nan"))
    rms_norm(x, weight, eps, residual, out=out, residual_out=residual_out)
    expected_out, expected_residual = rms_norm_ref(x, weight, eps, residual)
    # NOTE: compiled kernels round the sum to nearest-even like torch (bit-exact); Triton's
    # interpreter converts float32 to bfloat16 its own way, off by up to one ulp.
    tol = 0.0 if device.type == "cuda" else TOLERANCES[dtype]
    torch.testing.assert_close(residual_out, expected_residual, atol=tol, rtol=tol)
    assert_close(out, expected_out, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_matches_the_engine_layer(dtype: torch.dtype, device: torch.device) -> None:
    from fleetserve.kernels.silu_and_mul import silu_and_mul

    x = _randn(3, 2 * 1100, dtype=dtype, device=device)  # d=1100: two column blocks, one partial
    out = torch.full((3, 1100), float("nan"), dtype=dtype, device=device)
    assert silu_and_mul(x, out=out) is out
    assert_close(out, SiluAndMul(LayerContext(dtype, device))(x), dtype)
    assert_close(out, silu_and_mul_ref(x), dtype)


def _tables(
    head_size: int, partial: float, dtype: torch.dtype, device: torch.device
) -> RotaryEmbedding:
    rope = RopeSettings(rope_theta=10000.0, partial_rotary_factor=partial)
    return RotaryEmbedding(rope, head_size, 64, LayerContext(dtype, device))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_neox_matches_the_engine_layer(dtype: torch.dtype, device: torch.device) -> None:
    from fleetserve.kernels.rotary import rotary_embedding

    rope = _tables(32, 1.0, dtype, device)
    positions = torch.tensor([0, 5, 6, 63, 17], device=device)
    query = _randn(5, 6, 32, dtype=dtype, device=device)
    key = _randn(5, 2, 32, dtype=dtype, device=device, seed=1)
    expected_q, expected_k = rope(positions, query, key)
    rotary_embedding(positions, query, key, rope.cos_cache, rope.sin_cache, is_neox=True)
    assert_close(query, expected_q, dtype)
    assert_close(key, expected_k, dtype)


@pytest.mark.parametrize(("is_neox", "partial"), [(False, 1.0), (True, 0.5), (False, 0.5)])
def test_rotary_styles_and_partial_dims(
    is_neox: bool, partial: float, device: torch.device
) -> None:
    """gpt-j interleaving and partial rotary on a strided query (a slice of a fused qkv)."""
    from fleetserve.kernels.rotary import rotary_embedding

    rope = _tables(64, partial, torch.float32, device)
    positions = torch.tensor([3, 0, 40], device=device)
    qkv = _randn(3, 4 + 1 + 1, 64, dtype=torch.float32, device=device)
    query, key = qkv[:, :4], qkv[:, 4:5]
    expected_q, expected_k = rotary_ref(
        positions, query.clone(), key.clone(), rope.cos_cache, rope.sin_cache, is_neox
    )
    untouched = qkv[:, 5].clone()
    rotary_embedding(positions, query, key, rope.cos_cache, rope.sin_cache, is_neox=is_neox)
    assert_close(query, expected_q, torch.float32)
    assert_close(key, expected_k, torch.float32)
    assert torch.equal(qkv[:, 5], untouched)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_elementwise_realistic_sizes_on_gpu(dtype: torch.dtype) -> None:
    from fleetserve.kernels.rms_norm import rms_norm
    from fleetserve.kernels.rotary import rotary_embedding
    from fleetserve.kernels.silu_and_mul import silu_and_mul

    device = torch.device("cuda")
    x = _randn(4096, 4096, dtype=dtype, device=device)
    residual = _randn(4096, 4096, dtype=dtype, device=device, seed=1)
    weight = _randn(4096, dtype=dtype, device=device, seed=2)
    got, got_residual = rms_norm(x, weight, 1e-6, residual)
    want, want_residual = rms_norm_ref(x, weight, 1e-6, residual)
    assert_close(got, want, dtype)
    assert_close(got_residual, want_residual, dtype)
    gate_up = _randn(4096, 2 * 14336, dtype=dtype, device=device)
    assert_close(silu_and_mul(gate_up), silu_and_mul_ref(gate_up), dtype)
    rope = _tables(128, 1.0, dtype, device)
    positions = torch.randint(0, 64, (4096,), device=device)
    query = _randn(4096, 32, 128, dtype=dtype, device=device)
    key = _randn(4096, 8, 128, dtype=dtype, device=device, seed=3)
    expected_q, expected_k = rope(positions, query, key)
    rotary_embedding(positions, query, key, rope.cos_cache, rope.sin_cache)
    assert_close(query, expected_q, dtype)
    assert_close(key, expected_k, dtype)
