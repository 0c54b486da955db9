"""The dense GEMM: oneDNN on the CPU for float32/bfloat16 (plain or prepacked weights) and the
small-row kernels for decode-sized GEMMs (float32 on AVX-512 or AVX2, bfloat16 on AMX), each equal to
the float64 product to its dtype's precision; layers compute with it, and the loader prepacks
every layer's weight."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from fleetserve.engine.layers import gemm as gemm_module
from fleetserve.engine.layers.gemm import (
    SMALL_GEMM_MAX_ROWS,
    DenseGemm,
    onednn_linear,
    small_gemm_pack,
    small_linear,
    warm_up_gemms,
)
from fleetserve.engine.layers.layer_context import LayerContext
from fleetserve.engine.layers.linear import Linear
from fleetserve.engine.layers.vocab_parallel_embedding import ParallelLMHead
from fleetserve.engine.quantization.method import UnquantizedLinearMethod
from fleetserve.kernels.cpu.ops import amx_gemm_supported, small_gemm_supported
from tests.isa import isa_skipif

CPU = torch.device("cpu")
needs_onednn = pytest.mark.skipif(
    not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN"
)
needs_small_gemm = isa_skipif(
    not small_gemm_supported(),
    reason="the small-row GEMM needs the CPU kernels and AVX-512 or AVX2",
)
needs_small_gemm_bf16 = isa_skipif(
    not small_gemm_supported(torch.bfloat16),
    reason="the bfloat16 small-row GEMM needs the CPU kernels and AMX-BF16 or AVX2 only",
)
needs_amx = isa_skipif(
    not amx_gemm_supported(), reason="the AMX bfloat16 GEMM needs the CPU kernels and AMX-BF16"
)
needs_widened_bf16 = isa_skipif(
    not (small_gemm_supported(torch.bfloat16) and not amx_gemm_supported()),
    reason="the widened bfloat16 GEMM runs on AVX2 CPUs only (AVX-512 ones have oneDNN's)",
)
BF16_MAX_ROWS = SMALL_GEMM_MAX_ROWS[torch.bfloat16]


@needs_onednn
def test_cpu_float32_and_bfloat16_use_onednn_and_others_do_not() -> None:
    assert DenseGemm(CPU, torch.float32).uses_onednn
    # oneDNN's bfloat16 needs AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT; AVX2 CPUs compute it in F.linear.
    bf16_here = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    assert DenseGemm(CPU, torch.bfloat16).uses_onednn is bf16_here
    assert not DenseGemm(CPU, torch.float16).uses_onednn
    meta = DenseGemm(torch.device("meta"), torch.float32)
    meta.prepack(torch.empty(4, 4, device="meta"))
    assert not meta.uses_onednn and not meta.prepacked


def test_bfloat16_without_onednn_support_computes_in_f_linear(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """On a CPU where neither oneDNN nor a kernel computes bfloat16 (AVX2 without the CPU
    kernels), a bfloat16 layer neither reorders its weight for oneDNN (which raises there) nor
    packs it: F.linear computes it, and the start-up says it is slow."""
    monkeypatch.setattr(gemm_module, "onednn_supports", lambda dtype: dtype == torch.float32)
    monkeypatch.setattr(gemm_module, "small_gemm_supported", lambda dtype: dtype == torch.float32)
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(300, 576, generator=gen).bfloat16()
    bias = torch.randn(300, generator=gen).bfloat16()
    x = torch.randn(5, 576, generator=gen).bfloat16()
    gemm = DenseGemm(CPU, torch.bfloat16)
    gemm.prepack(weight, bias)
    assert not gemm.uses_onednn and not gemm.uses_small_gemm and not gemm.prepacked
    assert torch.equal(gemm(x, weight, bias), F.linear(x, weight, bias))
    assert DenseGemm(CPU, torch.float32).uses_onednn
    with caplog.at_level(logging.WARNING, logger=gemm_module.__name__):
        warm_up_gemms([(gemm, 8)])
    assert "--dtype float32 is faster" in caplog.text


@needs_onednn
@pytest.mark.parametrize("shape", [(1, 576), (7, 576), (3, 5, 576), (37, 576), (2, 19, 576)])
def test_onednn_linear_is_the_float32_product(
    shape: tuple[int, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FLEETSERVE_CPU_SMALL_GEMM", "0")  # every row count to oneDNN
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(300, 576, generator=gen)
    bias = torch.randn(300, generator=gen)
    # A non-contiguous input (every other column of a wider tensor) as the model's slices are.
    x = torch.randn(*shape[:-1], 2 * shape[-1], generator=gen)[..., ::2]
    out = onednn_linear(x, weight, bias)
    oracle = (x.double() @ weight.double().t() + bias.double()).float()
    torch.testing.assert_close(out, oracle, atol=2e-4, rtol=1e-5)
    torch.testing.assert_close(out, F.linear(x, weight, bias), atol=2e-4, rtol=1e-5)
    gemm = DenseGemm(CPU, torch.float32)
    gemm.prepack(weight)
    assert gemm.prepacked and not gemm.uses_small_gemm
    packed = gemm(x, weight, bias)
    torch.testing.assert_close(packed, oracle, atol=2e-4, rtol=1e-5)
    if x.numel() // x.shape[-1] > 1:  # oneDNN's batch-1 path (a GEMV) sums in another order
        assert torch.equal(packed, out)


@needs_small_gemm
@pytest.mark.parametrize("out_features", [300, 64, 7])
def test_the_small_row_kernel_is_the_float32_product_whatever_rows_are_beside(
    out_features: int,
) -> None:
    # 300 and 7 output columns end in a partial 32-column panel; 1000 input features span
    # several K blocks (128) with a partial one.
    gen = torch.Generator().manual_seed(5)
    weight = torch.randn(out_features, 1000, generator=gen)
    bias = torch.randn(out_features, generator=gen)
    packed = torch.ops.fleetserve_cpu.small_gemm_pack(weight)
    x = torch.randn(150, 2000, generator=gen)[:, ::2]  # non-contiguous, as the model's slices
    whole = small_linear(x, packed, out_features, bias)
    oracle = (x.double() @ weight.double().t() + bias.double()).float()
    torch.testing.assert_close(whole, oracle, atol=5e-4, rtol=1e-5)
    # A row's sum is one FMA chain in input order: alone, in any block of 12 rows, in any chunk
    # of 64, it comes out the same bits.
    for start, rows in [(0, 1), (5, 7), (13, 12), (40, 33), (100, 50)]:
        part = small_linear(x[start : start + rows], packed, out_features, bias)
        assert torch.equal(part, whole[start : start + rows])
    unbiased = small_linear(x[:3].reshape(3, 1, 1000), packed, out_features)
    assert unbiased.shape == (3, 1, out_features)
    torch.testing.assert_close(unbiased[:, 0] + bias, whole[:3], atol=1e-4, rtol=1e-6)


@needs_small_gemm
def test_small_gemm_rejects_what_it_was_not_packed_for() -> None:
    packed = torch.ops.fleetserve_cpu.small_gemm_pack(torch.zeros(40, 16))
    with pytest.raises(RuntimeError, match="x has 8 features, the packed weight 16"):
        torch.ops.fleetserve_cpu.small_gemm(torch.zeros(2, 8), packed, 40, None)
    with pytest.raises(RuntimeError, match="does not match"):
        torch.ops.fleetserve_cpu.small_gemm(torch.zeros(2, 16), packed, 80, None)
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.fleetserve_cpu.small_gemm(torch.zeros(2, 16).double(), packed, 40, None)


@needs_small_gemm
def test_float32_decode_sized_gemms_take_the_small_row_kernel_and_longer_ones_onednn() -> None:
    gen = torch.Generator().manual_seed(6)
    weight, bias = torch.randn(96, 64, generator=gen), torch.randn(96, generator=gen)
    gemm = DenseGemm(CPU, torch.float32)
    assert gemm.uses_small_gemm and not DenseGemm(CPU, torch.float16).uses_small_gemm
    gemm.prepack(weight, bias)
    assert gemm.prepacked
    packed = torch.ops.fleetserve_cpu.small_gemm_pack(weight)
    max_rows = SMALL_GEMM_MAX_ROWS[torch.float32]
    for rows in (1, 16, max_rows):
        x = torch.randn(rows, 64, generator=gen)
        assert torch.equal(gemm(x, weight, bias), small_linear(x, packed, 96, bias))
    x = torch.randn(max_rows + 1, 64, generator=gen)
    assert torch.equal(gemm(x, weight, bias), onednn_linear(x, weight, bias))


def _bf16_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The float64 product of bfloat16 operands, rounded to bfloat16 once."""
    out = x.double() @ weight.double().t()
    return (out if bias is None else out + bias.double()).bfloat16()


@needs_small_gemm_bf16
@pytest.mark.parametrize(("out_features", "in_features"), [(300, 1000), (64, 576), (7, 40)])
def test_the_bfloat16_small_row_kernel_is_the_product_whatever_rows_are_beside(
    out_features: int, in_features: int
) -> None:
    # Partial 32-column panels (300, 7), K padded to a multiple of 32 (1000, 40) or not (576);
    # 150 rows: chunks of 32 rows and a partial one (16 + 6).
    gen = torch.Generator().manual_seed(out_features)
    weight = torch.randn(out_features, in_features, generator=gen).bfloat16()
    bias = torch.randn(out_features, generator=gen).bfloat16()
    packed = small_gemm_pack(weight)
    x = torch.randn(150, 2 * in_features, generator=gen).bfloat16()[:, ::2]  # non-contiguous
    whole = small_linear(x, packed, out_features, bias)
    assert whole.dtype == torch.bfloat16
    # Float32 sums rounded once to bfloat16: within one bfloat16 ulp of the exact product.
    oracle = _bf16_product(x, weight, bias)
    torch.testing.assert_close(whole.float(), oracle.float(), rtol=2**-7, atol=1e-3)
    if gemm_module.onednn_supports(torch.bfloat16):
        torch.testing.assert_close(whole, onednn_linear(x, weight, bias), rtol=2**-7, atol=1e-3)
    # The same chain of steps (AMX tiles, or float32 FMAs) for each output: alone, in a 16-row
    # tile, in any 32-row chunk, a row comes out the same bits.
    for start, rows in [(0, 1), (5, 7), (13, 16), (40, 33), (100, 50)]:
        part = small_linear(x[start : start + rows], packed, out_features, bias)
        assert torch.equal(part, whole[start : start + rows])
    unbiased = small_linear(x[:3].reshape(3, 1, in_features), packed, out_features)
    assert unbiased.shape == (3, 1, out_features)
    torch.testing.assert_close(
        unbiased[:, 0].float(), _bf16_product(x[:3], weight, None).float(), rtol=2**-7, atol=1e-3
    )


@needs_amx
def test_bfloat16_decode_sized_gemms_take_the_amx_kernel_beside_onednn_on_the_same_threads() -> (
    None
):
    """oneDNN's bfloat16 kernels use the AMX tiles too, on the same threads: each loads its own
    tile configuration, so calls of the two interleaved give the same bits as alone."""
    gen = torch.Generator().manual_seed(7)
    weight = torch.randn(96, 64, generator=gen).bfloat16()
    bias = torch.randn(96, generator=gen).bfloat16()
    gemm = DenseGemm(CPU, torch.bfloat16)
    assert gemm.uses_small_gemm and gemm.small_max_rows == BF16_MAX_ROWS
    gemm.prepack(weight, bias)
    packed = small_gemm_pack(weight)
    small_x = torch.randn(BF16_MAX_ROWS, 64, generator=gen).bfloat16()
    long_x = torch.randn(BF16_MAX_ROWS + 1, 64, generator=gen).bfloat16()
    alone = [small_linear(small_x[:rows], packed, 96, bias) for rows in (1, 17, BF16_MAX_ROWS)]
    long_alone = onednn_linear(long_x, weight, bias)
    for _ in range(2):
        for rows, expected in zip((1, 17, BF16_MAX_ROWS), alone, strict=True):
            assert torch.equal(gemm(small_x[:rows], weight, bias), expected)
            assert torch.equal(gemm(long_x, weight, bias), long_alone)


@needs_amx
def test_bfloat16_small_gemm_rejects_what_it_was_not_packed_for() -> None:
    packed = small_gemm_pack(torch.zeros(40, 64).bfloat16())
    kernel = torch.ops.fleetserve_cpu.small_gemm_bf16
    with pytest.raises(RuntimeError, match="x has 16 features, the packed weight 64"):
        kernel(torch.zeros(2, 16).bfloat16(), packed, 40, None)
    with pytest.raises(RuntimeError, match="does not match"):
        kernel(torch.zeros(2, 64).bfloat16(), packed, 80, None)
    with pytest.raises(RuntimeError, match="bfloat16"):
        kernel(torch.zeros(2, 64), packed, 40, None)
    with pytest.raises(RuntimeError, match="small_gemm_bf16_pack"):
        kernel(torch.zeros(2, 64).bfloat16(), torch.zeros(2, 32, 32).bfloat16(), 40, None)


@needs_widened_bf16
def test_bfloat16_on_avx2_is_the_float32_kernel_rounded_once_at_every_row_count() -> None:
    """Where oneDNN has no bfloat16 (AVX2), the float32 kernel reads the bfloat16 weight widened:
    its float32 sum plus bias, rounded to bfloat16 once, for every row count (torch's fallback
    GEMM is the only alternative there, 3-4x slower than float32)."""
    gen = torch.Generator().manual_seed(11)
    weight = torch.randn(300, 576, generator=gen).bfloat16()
    bias = torch.randn(300, generator=gen).bfloat16()
    gemm = DenseGemm(CPU, torch.bfloat16)
    assert gemm.uses_small_gemm and not gemm.uses_onednn and not gemm.slow_bf16
    gemm.prepack(weight, bias)
    packed = small_gemm_pack(weight)
    assert packed.dtype == torch.bfloat16 and packed.shape == (10, 576, 32)
    packed32 = torch.ops.fleetserve_cpu.small_gemm_pack(weight.float())
    for rows in (1, 7, 64, 300):
        x = torch.randn(rows, 576, generator=gen).bfloat16()
        expected = small_linear(x.float(), packed32, 300, bias.float()).bfloat16()
        assert torch.equal(gemm(x, weight, bias), expected)
        assert torch.equal(
            small_linear(x, packed, 300), small_linear(x.float(), packed32, 300).bfloat16()
        )
    assert warm_up_gemms([(gemm, 512)]) == 0  # nothing goes to oneDNN
    with pytest.raises(RuntimeError, match="must share a dtype"):
        torch.ops.fleetserve_cpu.small_gemm(torch.zeros(2, 576), packed, 300, None)
    with pytest.raises(RuntimeError, match="bias must have x's dtype"):
        torch.ops.fleetserve_cpu.small_gemm(
            torch.zeros(2, 576).bfloat16(), packed, 300, bias.float()
        )


@needs_onednn
def test_layers_compute_with_the_chosen_gemm() -> None:
    context = LayerContext(dtype=torch.float32, device=CPU)
    layer = Linear(64, 48, context, bias=True)
    head = ParallelLMHead(100, 64, context)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(48, 64, generator=gen))
        assert layer.bias is not None
        layer.bias.copy_(torch.randn(48, generator=gen))
        head.weight.copy_(torch.randn(100, 64, generator=gen))
    x = torch.randn(5, 64, generator=gen)
    assert torch.equal(layer(x), onednn_linear(x, layer.weight, layer.bias))
    assert torch.equal(head.compute_logits(x), onednn_linear(x, head.weight).float())
    layer.quant_method.process_weights_after_loading(layer)
    head.prepack()
    if small_gemm_supported():  # five rows: the small-row kernel's
        layer_packed = torch.ops.fleetserve_cpu.small_gemm_pack(layer.weight)
        head_packed = torch.ops.fleetserve_cpu.small_gemm_pack(head.weight)
        assert torch.equal(layer(x), small_linear(x, layer_packed, 48, layer.bias))
        assert torch.equal(head.compute_logits(x), small_linear(x, head_packed, 100))
    else:
        assert torch.equal(layer(x), onednn_linear(x, layer.weight, layer.bias))
        assert torch.equal(head.compute_logits(x), onednn_linear(x, head.weight).float())


@needs_onednn
def test_the_loader_prepacks_every_dense_layer(tmp_path: Path) -> None:
    from fleetserve.engine.config import EngineConfig
    from tests.engine.tiny_models import load_engine_model, make_tiny_model

    model_dir = make_tiny_model(tmp_path, "llama", tie_word_embeddings=True)
    model = load_engine_model(EngineConfig.create(str(model_dir), max_model_len=64))
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    heads = [m for m in model.modules() if isinstance(m, ParallelLMHead)]
    assert len(linears) >= 4 and len(heads) == 1
    assert all(
        isinstance(m.quant_method, UnquantizedLinearMethod) and m.quant_method.gemm.prepacked
        for m in linears
    )
    assert heads[0].gemm.prepacked
