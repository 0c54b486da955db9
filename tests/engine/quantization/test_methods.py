"""Each linear quant method against its dequantized reference, at the layer level."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fleetserve.engine.layers.gemm import DenseGemm
from fleetserve.engine.layers.layer_context import LayerContext
from fleetserve.engine.layers.linear import ColumnParallelLinear, Linear, RowParallelLinear
from fleetserve.engine.quantization.compressed_tensors import PackedIntMethod, unpack_int32
from fleetserve.engine.quantization.ct_scheme import CompressedTensorsScheme
from fleetserve.engine.quantization.fp8 import Fp8PerTensorMethod, quantize_fp8_per_tensor
from fleetserve.engine.quantization.int8 import (
    Int8WeightOnlyMethod,
    dequantize_int8,
    quantize_int8_per_channel,
)
from fleetserve.engine.quantization.method import UnquantizedLinearMethod
from tests.engine.quantization.ct_reference import dequantize, pack_int32, quantize_symmetric

CPU = torch.device("cpu")
CONTEXT = LayerContext(dtype=torch.float32, device=CPU)


def _layer(weight: torch.Tensor, bias: bool = False) -> Linear:
    layer = Linear(weight.shape[1], weight.shape[0], CONTEXT, bias=bias)
    layer.weight.data.copy_(weight)
    if layer.bias is not None:
        layer.bias.data.copy_(torch.randn(weight.shape[0]))
    return layer


def test_unquantized_default_is_the_dense_gemm_bit_for_bit() -> None:
    torch.manual_seed(0)
    layer = _layer(torch.randn(48, 64), bias=True)
    assert isinstance(layer.quant_method, UnquantizedLinearMethod)
    x = torch.randn(5, 64)
    assert layer.bias is not None
    dense = DenseGemm(CPU, torch.float32)
    assert torch.equal(layer(x), dense(x, layer.weight, layer.bias))
    layer.quant_method.process_weights_after_loading(layer)  # prepacked: the same products
    assert torch.equal(layer(x), dense(x, layer.weight, layer.bias))


def test_int8_weight_only_matches_the_dequantized_reference() -> None:
    torch.manual_seed(0)
    weight = torch.randn(96, 64)
    layer = _layer(weight, bias=True)
    layer.set_quant_method(Int8WeightOnlyMethod(), torch.float32, CPU)
    layer.weight.data.copy_(weight)
    layer.quant_method.process_weights_after_loading(layer)
    assert layer.weight.dtype == torch.int8 and layer.weight_scale.shape == (96,)
    q, scale = quantize_int8_per_channel(weight)
    reference_w = dequantize_int8(q, scale, torch.float32)
    assert (reference_w - weight).abs().max() <= scale.max() / 2 + 1e-6  # half a step per row
    x = torch.randn(7, 64)
    expected = F.linear(x, reference_w, layer.bias)
    assert torch.equal(layer(x), expected)


def test_fp8_per_tensor_falls_back_on_cpu_to_dequantized_fp8_weights() -> None:
    torch.manual_seed(0)
    weight = torch.randn(32, 64)
    method = Fp8PerTensorMethod(CPU)
    assert method.fallback_reason is not None and "cpu" in method.fallback_reason
    layer = _layer(weight)
    layer.set_quant_method(method, torch.float32, CPU)
    layer.weight.data.copy_(weight)
    method.process_weights_after_loading(layer)
    assert layer.weight.dtype == torch.float8_e4m3fn and layer.weight_scale.shape == ()
    q, scale = quantize_fp8_per_tensor(weight)
    x = torch.randn(3, 64)
    torch.testing.assert_close(layer(x), F.linear(x, q.float() * scale))
    # fp8 e4m3 keeps ~2 significant digits: the weights stay close.
    assert (q.float() * scale - weight).abs().max() < 0.07 * weight.abs().max()


@pytest.mark.parametrize("bits", [4, 8])
def test_unpack_inverts_the_reference_packer(bits: int) -> None:
    torch.manual_seed(0)
    q = torch.randint(-(2 ** (bits - 1)), 2 ** (bits - 1), (6, 64), dtype=torch.int8)
    assert torch.equal(unpack_int32(pack_int32(q, bits), bits, 64), q)


def _scheme(bits: int, group: int | None) -> CompressedTensorsScheme:
    return CompressedTensorsScheme(num_bits=bits, group_size=group, targets=())


def test_packed_int4_layer_applies_the_dequantized_weight() -> None:
    torch.manual_seed(0)
    weight = torch.randn(40, 64)
    q, scale = quantize_symmetric(weight, 4, 32)
    layer = Linear(64, 40, CONTEXT, bias=False)
    layer.set_quant_method(PackedIntMethod(_scheme(4, 32)), torch.float32, CPU)
    assert "weight" not in dict(layer.named_parameters())
    layer.weight_packed.data.copy_(pack_int32(q, 4))
    layer.weight_scale.data.copy_(scale.float())
    x = torch.randn(4, 64)
    assert torch.equal(layer(x), F.linear(x, dequantize(q, scale, 32)))


def test_packed_layers_load_fused_rows_and_sharded_packed_columns() -> None:
    # Fused q/k/v parts land in their rows; a row-parallel rank reads its packed columns.
    torch.manual_seed(0)
    parts = [torch.randn(n, 64) for n in (32, 16, 16)]
    fused = ColumnParallelLinear.merged(64, [32, 16, 16], CONTEXT, bias=False)
    fused.set_quant_method(PackedIntMethod(_scheme(4, 32)), torch.float32, CPU)
    for shard, w in enumerate(parts):
        q, scale = quantize_symmetric(w, 4, 32)
        fused.load_weight(fused.weight_packed, pack_int32(q, 4), "p", shard)
        fused.load_weight(fused.weight_scale, scale.float(), "s", shard)
    method = fused.quant_method
    assert isinstance(method, PackedIntMethod)
    expected = torch.cat([dequantize(*quantize_symmetric(w, 4, 32), 32) for w in parts])
    assert torch.equal(method.dequantized_weight(fused, torch.float32), expected)

    row = RowParallelLinear(64, 24, CONTEXT, bias=False)
    row.set_quant_method(PackedIntMethod(_scheme(4, 32)), torch.float32, CPU)
    w = torch.randn(24, 64)
    q, scale = quantize_symmetric(w, 4, 32)
    row.load_weight(row.weight_packed, pack_int32(q, 4), "p")
    row.load_weight(row.weight_scale, scale.float(), "s")
    assert torch.equal(row.quant_method.dequantized_weight(row, torch.float32),  # type: ignore[attr-defined]
                       dequantize(q, scale, 32))  # fmt: skip


def test_packed_layer_refuses_a_group_that_does_not_divide_the_input() -> None:
    layer = Linear(48, 8, CONTEXT, bias=False)
    with pytest.raises(ValueError, match="group_size \\(32\\) must divide"):
        layer.set_quant_method(PackedIntMethod(_scheme(4, 32)), torch.float32, CPU)


@pytest.mark.gpu
def test_fp8_per_tensor_w8a8_on_gpu_matches_its_quantized_reference() -> None:
    device = torch.device("cuda")
    method = Fp8PerTensorMethod(device)
    if method.fallback_reason is not None:
        pytest.skip(method.fallback_reason)
    torch.manual_seed(0)
    weight = torch.randn(64, 128, device=device, dtype=torch.bfloat16)
    context = LayerContext(dtype=torch.bfloat16, device=device)
    layer = Linear(128, 64, context, bias=False)
    layer.set_quant_method(method, torch.bfloat16, device)
    layer.weight.data.copy_(weight)
    method.process_weights_after_loading(layer)
    x = torch.randn(5, 128, device=device, dtype=torch.bfloat16)
    xq, x_scale = quantize_fp8_per_tensor(x)
    wq, w_scale = quantize_fp8_per_tensor(weight)
    reference = (xq.float() * x_scale) @ (wq.float() * w_scale).t()
    torch.testing.assert_close(layer(x).float(), reference, rtol=2e-2, atol=2e-2)
