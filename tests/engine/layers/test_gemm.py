"""The dense GEMM: oneDNN on the CPU for float32/bfloat16 (plain or prepacked weights), equal to
the float64 product; layers compute with it, and the loader prepacks every layer's weight."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from fleetserve.engine.layers.gemm import DenseGemm, onednn_linear
from fleetserve.engine.layers.layer_context import LayerContext
from fleetserve.engine.layers.linear import Linear
from fleetserve.engine.layers.vocab_parallel_embedding import ParallelLMHead
from fleetserve.engine.quantization.method import UnquantizedLinearMethod

CPU = torch.device("cpu")
needs_onednn = pytest.mark.skipif(
    not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN"
)


@needs_onednn
def test_cpu_float32_and_bfloat16_use_onednn_and_others_do_not() -> None:
    assert DenseGemm(CPU, torch.float32).uses_onednn
    assert DenseGemm(CPU, torch.bfloat16).uses_onednn
    assert not DenseGemm(CPU, torch.float16).uses_onednn
    meta = DenseGemm(torch.device("meta"), torch.float32)
    meta.prepack(torch.empty(4, 4, device="meta"))
    assert not meta.uses_onednn and not meta.prepacked


@needs_onednn
@pytest.mark.parametrize("shape", [(1, 576), (7, 576), (3, 5, 576), (37, 576), (2, 19, 576)])
def test_onednn_linear_is_the_float32_product(shape: tuple[int, ...]) -> None:
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
    assert gemm.prepacked
    packed = gemm(x, weight, bias)
    torch.testing.assert_close(packed, oracle, atol=2e-4, rtol=1e-5)
    if x.numel() // x.shape[-1] > 1:  # oneDNN's batch-1 path (a GEMV) sums in another order
        assert torch.equal(packed, out)


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
