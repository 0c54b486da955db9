"""Tensor-parallel layers without processes: which heads and rows a rank keeps, and sharded
loading that reads only them from the safetensors checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open

from fleetserve.engine.config import EngineConfig
from fleetserve.engine.distributed.group import GroupCoordinator
from fleetserve.engine.layers.linear import RowSlice, num_kv_heads_per_rank, qkv_slices
from fleetserve.engine.models import loader
from fleetserve.engine.models.arch import ModelArch


def test_heads_split_evenly_when_there_are_enough() -> None:
    # 4 query heads, 2 KV heads of 32 on 2 ranks: two query heads and one KV head each.
    assert qkv_slices(4, 2, 32, 1, 2) == (
        RowSlice(128, 64, 64),
        RowSlice(64, 32, 32),
        RowSlice(64, 32, 32),
    )
    assert num_kv_heads_per_rank(8, 4) == 2


def test_kv_heads_are_replicated_when_fewer_than_ranks() -> None:
    # 8 query heads, 2 KV heads on 4 ranks: ranks 0-1 read KV head 0, ranks 2-3 KV head 1.
    kv_starts = [qkv_slices(8, 2, 16, rank, 4)[1].start for rank in range(4)]
    assert kv_starts == [0, 0, 16, 16]
    assert [qkv_slices(8, 2, 16, rank, 4)[0].start for rank in range(4)] == [0, 32, 64, 96]
    assert num_kv_heads_per_rank(2, 4) == 1


@pytest.mark.parametrize(
    ("heads", "kv_heads", "size", "message"),
    [
        (6, 2, 4, "num_attention_heads"),
        (8, 3, 2, "num_key_value_heads"),
        (12, 4, 6, "multiple of num_key_value_heads"),
        (10, 2, 4, "num_attention_heads"),
    ],
)
def test_heads_that_do_not_divide_are_refused(
    heads: int, kv_heads: int, size: int, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        qkv_slices(heads, kv_heads, 8, 0, size)


class _Recording:
    """A checkpoint slice that records how many elements each read materialises."""

    def __init__(self, inner: loader.SafetensorsSlice, name: str, log: dict[str, int]) -> None:
        self.inner, self.name, self.log = inner, name, log
        self.shape = inner.shape

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        tensor = self.inner.narrow(dim, start, length)
        self.log[self.name] = self.log.get(self.name, 0) + tensor.numel()
        return tensor


def _load_rank(config: EngineConfig, rank: int, monkeypatch: pytest.MonkeyPatch) -> Any:
    """Rank `rank` of 2's model, loaded through a recording checkpoint (no collectives run
    while loading, so a group without torch channels is enough)."""
    log: dict[str, int] = {}
    monkeypatch.undo()  # the real iterate_weights, not the previous rank's recording one
    real = loader.iterate_weights

    def recording(model_dir: Any, dtype: torch.dtype) -> Any:
        for name, tensor in real(model_dir, dtype):
            yield name, _Recording(tensor, name, log)

    monkeypatch.setattr(loader, "iterate_weights", recording)
    arch = ModelArch.from_hf_config(config.model.hf_config)
    group = GroupCoordinator([0, 1], rank)
    model = loader.load_model(config, arch, loader.build_layer_context(config, tp_group=group))
    return model, log


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_sharded_load_reads_only_what_the_rank_owns(
    arch: str,
    tiny_llama_dir: Path,
    tiny_qwen2_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model_dir = tiny_llama_dir if arch == "llama" else tiny_qwen2_dir
    config = EngineConfig.create(
        str(model_dir), dtype="float32", device="cpu", tensor_parallel_size=2, max_model_len=64
    )
    (path,) = loader.safetensors_files(model_dir)
    with safe_open(str(path), framework="pt") as f:
        full = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
    ranks = [_load_rank(config, rank, monkeypatch) for rank in range(2)]
    for name, tensor in full.items():
        read = [log[name] for _, log in ranks]
        if "norm" in name or name.endswith("o_proj.bias"):
            assert read == [tensor.numel()] * 2, name  # replicated
        else:
            assert read == [tensor.numel() // 2] * 2, name  # half each, never the whole
    (m0, _), (m1, _) = ranks
    # The two ranks' shards put back together are the checkpoint's tensors.
    layer = "model.layers.0"
    q, k, v = (full[f"{layer}.self_attn.{p}_proj.weight"] for p in "qkv")
    for rank, model in enumerate((m0, m1)):
        qkv = model.get_parameter(f"{layer}.self_attn.qkv_proj.weight")
        assert torch.equal(qkv[:64], q[64 * rank : 64 * rank + 64])
        assert torch.equal(qkv[64:96], k[32 * rank : 32 * rank + 32])
        assert torch.equal(qkv[96:], v[32 * rank : 32 * rank + 32])
    down = full[f"{layer}.mlp.down_proj.weight"]
    joined = torch.cat([m.get_parameter(f"{layer}.mlp.down_proj.weight") for m in (m0, m1)], 1)
    assert torch.equal(joined, down)
    embed = torch.cat([m.get_parameter("model.embed_tokens.weight") for m in (m0, m1)])
    assert torch.equal(embed, full["model.embed_tokens.weight"])
