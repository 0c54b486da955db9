"""Backend selection (reasons, fallback, logging) and the triton backend against the torch one."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from fleetserve import LLM, SamplingParams
from fleetserve.engine.layers.attention.base import AttentionBackend
from fleetserve.engine.layers.attention.cpu_backend import CpuPagedAttentionBackend
from fleetserve.engine.layers.attention.metadata import build_attention_metadata
from fleetserve.engine.layers.attention.selector import (
    attention_backend_registry,
    select_attention_backend,
)
from fleetserve.engine.layers.attention.torch_backend import TorchAttentionBackend
from fleetserve.engine.layers.attention.triton_backend import TritonAttentionBackend
from fleetserve.kernels.cpu.build import load_cpu_kernels
from tests.engine.tiny_models import make_tiny_model

CPU = torch.device("cpu")


def test_registry_lists_every_backend_cpu_ones_first_without_cuda() -> None:
    registry = attention_backend_registry()
    assert set(registry) == {"cpu_paged", "torch", "triton", "flash_attn"}
    if not torch.cuda.is_available():
        assert list(registry)[:2] == ["cpu_paged", "torch"]


def test_auto_on_cpu_picks_a_cpu_backend_even_with_the_interpreter() -> None:
    expected = CpuPagedAttentionBackend if load_cpu_kernels().available else TorchAttentionBackend
    assert select_attention_backend("auto", 32, torch.float32, 16, CPU) is expected


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter is only set without CUDA")
def test_explicit_triton_on_cpu_uses_the_interpreter() -> None:
    assert select_attention_backend("triton", 32, torch.float32, 16, CPU) is TritonAttentionBackend


@pytest.mark.parametrize(
    ("name", "head_size", "dtype", "reason"),
    [
        ("triton", 80, torch.float32, "head_size 80 is not one of"),
        ("triton", 64, torch.int8, "dtype torch.int8 is not one of"),
        ("flash_attn", 64, torch.bfloat16, "flash_attn"),
    ],
)
def test_unservable_request_fails_with_the_backends_reason(
    name: str, head_size: int, dtype: torch.dtype, reason: str
) -> None:
    with pytest.raises(ValueError, match=f"attention_backend '{name}' cannot serve.*{reason}"):
        select_attention_backend(name, head_size, dtype, 16, CPU)


def test_triton_on_cpu_without_the_interpreter_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        select_attention_backend("triton", 32, torch.float32, 16, CPU)


def test_auto_falls_back_and_logs_why(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """On a CUDA host serving a CPU model, both kernels decline and 'auto' lands on torch
    (here with the fused CPU backend declining too)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(CpuPagedAttentionBackend, "supported_dtypes", ())
    assert list(attention_backend_registry()) == ["flash_attn", "triton", "cpu_paged", "torch"]
    with caplog.at_level(logging.INFO, logger="fleetserve.engine.layers.attention.selector"):
        chosen = select_attention_backend("auto", 32, torch.float32, 16, CPU)
    assert chosen is TorchAttentionBackend
    skipped = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert len(skipped) == 3
    assert skipped[0].startswith("attention backend 'flash_attn' skipped: ")
    assert skipped[1].startswith("attention backend 'triton' skipped: ")
    assert skipped[2].startswith("attention backend 'cpu_paged' skipped: ")
    assert "TRITON_INTERPRET=1" in skipped[1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter is only set without CUDA")
def test_auto_never_picks_the_interpreted_triton_on_cpu(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Even when torch cannot serve and triton could (interpreted), 'auto' refuses and says why."""
    monkeypatch.setattr(TorchAttentionBackend, "supported_block_sizes", (16,))
    monkeypatch.setattr(CpuPagedAttentionBackend, "supported_block_sizes", (16,))
    with (
        caplog.at_level(logging.INFO, logger="fleetserve.engine.layers.attention.selector"),
        pytest.raises(ValueError, match=r"no attention backend.*triton: on the CPU triton runs"),
    ):
        select_attention_backend("auto", 32, torch.float32, 4, CPU)
    assert "attention backend 'triton' skipped: on the CPU triton runs" in caplog.text
    assert select_attention_backend("triton", 32, torch.float32, 4, CPU) is TritonAttentionBackend


def test_llm_start_up_fails_with_the_reason(tmp_path: Path) -> None:
    path = make_tiny_model(tmp_path, "llama", head_dim=48)
    with pytest.raises(ValueError, match="head_size 48 is not one of"):
        LLM(str(path), dtype="float32", attention_backend="triton", num_kv_blocks=16)
    with pytest.raises(ValueError, match="attention_backend 'flash_attn' cannot serve"):
        LLM(str(path), dtype="float32", attention_backend="flash_attn", num_kv_blocks=16)


def _compare_with_torch_backend(
    backend_cls: type[AttentionBackend], dtype: torch.dtype, device: torch.device
) -> None:
    """Mixed step with a padding token (slot -1); both backends write and read their own cache."""
    gen = torch.Generator().manual_seed(1)
    num_heads, num_kv_heads, head_size, block_size = 4, 2, 32, 4
    # Request 0: context 5 already cached (blocks 3, 1), computes 3 -> blocks 3, 1; request 1:
    # fresh 2-token prompt in block 2; request 2: decode at position 6 (blocks 4, 5).
    query_lens, seq_lens = [3, 2, 1], [8, 2, 7]
    table = torch.tensor([[3, 1], [2, 0], [4, 5]], dtype=torch.int32)
    step_slots = [13, 6, 7, 8, 9, 22, -1]  # last token is padding
    cache = torch.randn(2, 6, block_size, num_kv_heads, head_size, generator=gen).to(dtype)
    cache[:, 0] = 0.0
    q = torch.randn(7, num_heads, head_size, generator=gen).to(dtype)
    k = torch.randn(7, num_kv_heads, head_size, generator=gen).to(dtype)
    v = torch.randn(7, num_kv_heads, head_size, generator=gen).to(dtype)
    metadata = build_attention_metadata(
        query_lens,
        seq_lens,
        table,
        torch.tensor(step_slots[:6], dtype=torch.int64),
        block_size,
        device,
    )
    results = []
    for cls in (TorchAttentionBackend, backend_cls):
        backend = cls(num_heads, num_kv_heads, head_size)
        kv_cache = cache.clone().to(device)
        out = backend.forward(
            q.to(device), k.to(device), v.to(device), kv_cache, metadata, head_size**-0.5
        )
        results.append((out[:6], kv_cache))
    (torch_out, torch_cache), (kernel_out, kernel_cache) = results
    torch.testing.assert_close(kernel_cache, torch_cache, atol=0.0, rtol=0.0)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(kernel_out, torch_out, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_backend_matches_torch_backend(dtype: torch.dtype, device: torch.device) -> None:
    _compare_with_torch_backend(TritonAttentionBackend, dtype, device)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["triton", "flash_attn"])
def test_kernel_backends_match_torch_backend_on_gpu(name: str) -> None:
    backend_cls = attention_backend_registry()[name]
    device = torch.device("cuda")
    reason = backend_cls.validate_configuration(32, torch.bfloat16, 4, device)
    if reason is not None:
        pytest.skip(reason)
    _compare_with_torch_backend(backend_cls, torch.bfloat16, device)
    _compare_with_torch_backend(backend_cls, torch.float16, device)


def test_llm_greedy_tokens_equal_torch_backend(tmp_path: Path) -> None:
    """Chunked prefill (8-token budget) and prefix caching (shared 8-token prefix) on."""
    path = str(make_tiny_model(tmp_path, "llama"))
    shared = [5, 6, 7, 8, 9, 10, 11, 12]
    first = {"prompt_token_ids": [*shared, 40, 41, 42]}
    batch = [{"prompt_token_ids": [*shared, 50, 51]}, {"prompt_token_ids": [3, 4, 60]}]
    greedy = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    tokens, cached = {}, {}
    for backend in ("torch", "triton"):
        llm = LLM(
            path,
            dtype="float32",
            block_size=4,
            num_kv_blocks=32,
            max_model_len=64,
            max_num_batched_tokens=8,
            enable_chunked_prefill=True,
            enable_prefix_caching=True,
            attention_backend=backend,
        )
        outs = llm.generate([first], greedy) + llm.generate(batch, greedy)
        tokens[backend] = [list(o.outputs[0].token_ids) for o in outs]
        cached[backend] = [o.num_cached_tokens for o in outs]
    assert tokens["triton"] == tokens["torch"]
    assert all(len(t) == 5 for t in tokens["torch"])
    assert cached["triton"] == cached["torch"] == [0, 8, 0]  # two full shared blocks hit
