"""The fused C++ elementwise kernels of the CPU (`fleetserve/kernels/cpu/elementwise.cpp`, called
through `fleetserve.kernels.cpu.ops`) against the engine's torch arithmetic (`kernels.reference`):
odd widths, strided rows, in-place rotary on views of one qkv buffer, extreme activations, the
fall-backs (float16, partial and gpt-j rotary), batch invariance, bfloat16 rounded where torch's
bfloat16 ops round, and refused inputs.

Float32 results may differ from torch by a few ulp (the order of RMSNorm's sum of squares, the
exponential's polynomial, fused multiply-adds), hence the tolerances of a few float32 ulp.
"""

from __future__ import annotations

import pytest
import torch

from fleetserve.kernels.cpu import ops
from fleetserve.kernels.cpu.build import load_cpu_kernels
from fleetserve.kernels.reference import rms_norm_ref, rotary_ref, silu_and_mul_ref

pytestmark = pytest.mark.skipif(
    not load_cpu_kernels().available, reason=f"no CPU kernels: {load_cpu_kernels().error}"
)
ULPS = {"rtol": 4e-6, "atol": 1e-6}


def _rotary_tables(max_position: int, head_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (10000 ** (torch.arange(0, head_size, 2, dtype=torch.float32) / head_size))
    freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


@pytest.mark.parametrize(("rows", "hidden"), [(1, 64), (3, 65), (257, 576), (2048, 96)])
def test_rms_norm_and_the_residual_add_equal_the_reference(rows: int, hidden: int) -> None:
    gen = torch.Generator().manual_seed(rows * hidden)
    # Rows strided inside a wider buffer, as a slice of a fused projection would be.
    x = torch.randn(rows, hidden + 7, generator=gen)[:, :hidden]
    residual = torch.randn(rows, hidden, generator=gen) * 10
    weight = torch.randn(hidden, generator=gen)
    torch.testing.assert_close(ops.rms_norm(x, weight, 1e-5), rms_norm_ref(x, weight, 1e-5), **ULPS)
    normed, summed = ops.fused_add_rms_norm(x, residual, weight, 1e-6)
    ref_normed, ref_summed = rms_norm_ref(x, weight, 1e-6, residual)
    assert torch.equal(summed, ref_summed)  # one float add, exactly torch's
    torch.testing.assert_close(normed, ref_normed, **ULPS)


def test_a_rows_result_does_not_depend_on_the_batch_around_it() -> None:
    gen = torch.Generator().manual_seed(0)
    x, weight = torch.randn(1000, 576, generator=gen), torch.randn(576, generator=gen)
    gate_up = torch.randn(1000, 3072, generator=gen) * 4
    assert torch.equal(ops.rms_norm(x, weight, 1e-5)[7], ops.rms_norm(x[7:8], weight, 1e-5)[0])
    assert torch.equal(ops.silu_and_mul(gate_up)[999], ops.silu_and_mul(gate_up[999:])[0])


@pytest.mark.parametrize(("heads", "kv_heads", "head_size"), [(9, 3, 64), (4, 4, 80), (2, 1, 32)])
def test_rotary_rotates_views_of_one_qkv_buffer_in_place_like_the_reference(
    heads: int, kv_heads: int, head_size: int
) -> None:
    gen = torch.Generator().manual_seed(heads)
    tokens = 37
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_size, generator=gen)
    q = qkv[:, : heads * head_size].view(tokens, heads, head_size)
    k = qkv[:, heads * head_size : (heads + kv_heads) * head_size].view(tokens, kv_heads, head_size)
    v_before = qkv[:, (heads + kv_heads) * head_size :].clone()
    positions = torch.randint(0, 4096, (tokens,), generator=gen)
    cos, sin = _rotary_tables(4096, head_size)
    expected_q, expected_k = rotary_ref(positions, q, k, cos, sin, True)
    ops.rotary_embedding(positions, q, k, cos, sin, True)
    torch.testing.assert_close(q, expected_q, **ULPS)
    torch.testing.assert_close(k, expected_k, **ULPS)
    assert torch.equal(qkv[:, (heads + kv_heads) * head_size :], v_before)  # V untouched


def test_silu_and_mul_equals_the_reference_and_stays_finite_at_the_extremes() -> None:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(129, 2 * 1537, generator=gen) * 5
    x[0, :6] = torch.tensor([-1e4, -100.0, -88.0, 88.0, 100.0, 1e4])
    x[0, 1537 : 1537 + 6] = 1.0
    out = ops.silu_and_mul(x)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, silu_and_mul_ref(x), **ULPS)


def _bf16_agreement(ours: torch.Tensor, ref: torch.Tensor, ulps: int = 1) -> None:
    """Within `ulps` bfloat16 ulps everywhere, and the same bits almost everywhere: a float32
    difference of a few ulp (the sum of squares' order, the exponential) changes the bfloat16
    result only where it straddles a rounding boundary. One ulp is 2**-7 relative at most (8
    significant bits); the absolute part is for SiLU far below zero, where the clamped
    exponential gives -6e-35 and torch -0."""
    assert ours.dtype == ref.dtype == torch.bfloat16
    torch.testing.assert_close(ours.float(), ref.float(), rtol=ulps * 2**-7, atol=1e-30)
    assert (ours != ref).float().mean().item() < 0.01


@pytest.mark.parametrize(("rows", "hidden"), [(1, 64), (3, 65), (257, 576)])
def test_bfloat16_rms_norm_rounds_where_the_torch_ops_round(rows: int, hidden: int) -> None:
    gen = torch.Generator().manual_seed(rows + hidden)
    x = (torch.randn(rows, hidden + 7, generator=gen) * 3).bfloat16()[:, :hidden]
    residual = (torch.randn(rows, hidden, generator=gen) * 10).bfloat16()
    weight = torch.randn(hidden, generator=gen).bfloat16()
    # The normalised value is rounded before the weight multiplies it, so where it straddles a
    # rounding boundary it is one ulp off, and the rounded product up to two: with a weight of
    # ones the output is that value itself.
    ones = torch.ones(hidden).bfloat16()
    for w, ulps in ((ones, 1), (weight, 2)):
        ref = rms_norm_ref(x, w, 1e-5)
        assert isinstance(ref, torch.Tensor)
        _bf16_agreement(ops.rms_norm(x, w, 1e-5), ref, ulps)
        normed, summed = ops.fused_add_rms_norm(x, residual, w, 1e-6)
        ref_normed, ref_summed = rms_norm_ref(x, w, 1e-6, residual)
        assert torch.equal(summed, ref_summed)  # the add rounded once, as torch's bfloat16 add
        _bf16_agreement(normed, ref_normed, ulps)


@pytest.mark.parametrize(("heads", "kv_heads", "head_size"), [(9, 3, 64), (2, 1, 40)])
def test_bfloat16_rotary_gives_the_torch_ops_bits(
    heads: int, kv_heads: int, head_size: int
) -> None:
    gen = torch.Generator().manual_seed(heads)
    tokens = 37
    qkv = (torch.randn(tokens, (heads + 2 * kv_heads) * head_size, generator=gen) * 4).bfloat16()
    q = qkv[:, : heads * head_size].view(tokens, heads, head_size)
    k = qkv[:, heads * head_size : (heads + kv_heads) * head_size].view(tokens, kv_heads, head_size)
    v_before = qkv[:, (heads + kv_heads) * head_size :].clone()
    positions = torch.randint(0, 4096, (tokens,), generator=gen)
    cos, sin = (t.bfloat16() for t in _rotary_tables(4096, head_size))
    expected_q, expected_k = rotary_ref(positions, q, k, cos, sin, True)
    ops.rotary_embedding(positions, q, k, cos, sin, True)
    assert torch.equal(q, expected_q) and torch.equal(k, expected_k)
    assert torch.equal(qkv[:, (heads + kv_heads) * head_size :], v_before)


def test_bfloat16_silu_and_mul_rounds_where_the_torch_ops_round() -> None:
    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(129, 2 * 1537, generator=gen) * 5).bfloat16()
    x[0, :6] = torch.tensor([-1e4, -100.0, -88.0, 88.0, 100.0, 1e4])
    x[0, 1537 : 1537 + 6] = 1.0
    out = ops.silu_and_mul(x)
    assert torch.isfinite(out).all()
    _bf16_agreement(out, silu_and_mul_ref(x))
    assert torch.equal(ops.silu_and_mul(x)[100], ops.silu_and_mul(x[100:101])[0])


def test_bfloat16_calls_run_the_kernels_not_the_torch_fallback() -> None:
    """The bfloat16 tests above go through the wrappers, as the engine does; here the wrappers
    are seen to reach the C++ kernels (a fallback would also agree with the reference)."""
    x, weight = torch.randn(4, 64).bfloat16(), torch.randn(64).bfloat16()
    q, k = torch.randn(4, 2, 32).bfloat16(), torch.randn(4, 1, 32).bfloat16()
    cos, sin = (t.bfloat16() for t in _rotary_tables(16, 32))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        ops.rms_norm(x, weight, 1e-5)
        ops.fused_add_rms_norm(x, x, weight, 1e-5)
        ops.rotary_embedding(torch.arange(4), q, k, cos, sin, True)
        ops.silu_and_mul(x)
    called = {event.key for event in prof.key_averages()}
    for name in ("rms_norm", "fused_add_rms_norm", "rotary_embedding", "silu_and_mul"):
        assert f"fleetserve_cpu::{name}" in called, name


def test_other_dtypes_and_rotary_layouts_fall_back_to_the_reference_exactly() -> None:
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(5, 64, generator=gen).to(torch.float16)
    weight = torch.randn(64, generator=gen).to(torch.float16)
    assert torch.equal(ops.rms_norm(x, weight, 1e-5), rms_norm_ref(x, weight, 1e-5))
    assert torch.equal(ops.silu_and_mul(x), silu_and_mul_ref(x))
    positions = torch.arange(5)
    cos, sin = _rotary_tables(16, 32)  # partial rotary: 32 of 64 dims
    q, k = torch.randn(5, 2, 64, generator=gen), torch.randn(5, 1, 64, generator=gen)
    for is_neox in (True, False):
        expected = rotary_ref(positions, q, k, cos, sin, is_neox)
        q2, k2 = q.clone(), k.clone()
        ops.rotary_embedding(positions, q2, k2, cos, sin, is_neox)
        assert torch.equal(q2, expected[0]) and torch.equal(k2, expected[1])


def test_the_kernels_refuse_what_they_cannot_compute_with_the_reason() -> None:
    kernels = torch.ops.fleetserve_cpu
    x = torch.randn(4, 8)
    with pytest.raises(RuntimeError, match="must be float32"):
        kernels.rms_norm(x.double(), torch.ones(8).double(), 1e-5, torch.empty(4, 8).double())
    with pytest.raises(RuntimeError, match="one dtype"):
        kernels.rms_norm(x, torch.ones(8).bfloat16(), 1e-5, torch.empty(4, 8))
    with pytest.raises(RuntimeError, match="weight must be contiguous"):
        kernels.rms_norm(x, torch.ones(9), 1e-5, torch.empty(4, 8))
    with pytest.raises(RuntimeError, match="x must be \\[rows, 2d\\] and out \\[rows, d\\]"):
        kernels.silu_and_mul(x, torch.empty(4, 8))
    cos, sin = _rotary_tables(4, 8)
    q, k = torch.randn(1, 1, 8), torch.randn(1, 1, 8)
    with pytest.raises(RuntimeError, match="outside the cos/sin tables"):
        kernels.rotary_embedding(torch.tensor([4]), q, k, cos, sin)
