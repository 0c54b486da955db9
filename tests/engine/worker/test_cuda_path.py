"""The engine's CUDA path: decode-graph padding, fused custom ops, dummy weights, pinned buffers.

On the CPU the padded batches that CUDA graphs replay run eagerly (`DecodeGraphs(capture=False)`)
through the Triton kernels in the interpreter, so the padding itself (null block, slot -1, length
1) is tested without a GPU; the GPU-marked tests capture and replay real graphs.
"""

from __future__ import annotations

import itertools
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from fleetserve import LLM, SamplingParams
from fleetserve.engine.config import EngineConfig
from fleetserve.engine.core.engine_core import EngineCore
from fleetserve.engine.worker.cuda_graphs import DecodeGraphs, cuda_graph_capture_sizes
from fleetserve.engine.worker.executor import UniProcExecutor
from fleetserve.engine.worker.model_runner import ModelRunner
from fleetserve.engine.worker.worker import Worker
from tests.engine.tiny_models import make_tiny_model

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
# Five prompts of different lengths: decode batches of 5 (padded to 8), then fewer as they
# finish at different steps when max_tokens differ.
PROMPTS = [{"prompt_token_ids": [3 + i, 17, 90 + 7 * i][: 1 + i % 3] * (1 + i)} for i in range(5)]


def _worker(llm: LLM) -> Worker:
    executor = llm.engine_core.executor
    assert isinstance(executor, UniProcExecutor)
    return executor.worker


def _runner(llm: LLM) -> ModelRunner:
    return _worker(llm).model_runner


def _greedy_tokens(llm: LLM, prompts: list[dict[str, list[int]]]) -> list[list[int]]:
    params = [
        SamplingParams(temperature=0, max_tokens=3 + 2 * i, ignore_eos=True)
        for i in range(len(prompts))
    ]
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]


def _tiny_llm(path: Path, **kwargs: object) -> LLM:
    settings: dict[str, object] = {
        "dtype": "float32",
        "block_size": 4,
        "num_kv_blocks": 64,
        "max_model_len": 64,
        "max_num_seqs": 8,
    }
    settings.update(kwargs)
    return LLM(str(path), **settings)  # type: ignore[arg-type]


def test_capture_sizes_cover_every_batch_up_to_max_num_seqs() -> None:
    assert cuda_graph_capture_sizes(1) == (1,)
    assert cuda_graph_capture_sizes(5) == (1, 2, 4, 5)
    assert cuda_graph_capture_sizes(20) == (1, 2, 4, 8, 16, 20)
    sizes = cuda_graph_capture_sizes(1000)
    assert sizes[:5] == (1, 2, 4, 8, 16) and sizes[-1] == 512
    assert all(b - a <= 8 for a, b in itertools.pairwise(sizes))


def test_dispatch_pads_uniform_decode_only() -> None:
    graphs = DecodeGraphs((1, 2, 4, 8), capture=False)
    assert graphs.padded_size(3, uniform_decode=True) == 4
    assert graphs.padded_size(8, uniform_decode=True) == 8
    assert graphs.padded_size(1, uniform_decode=True) == 1
    assert graphs.padded_size(9, uniform_decode=True) is None  # beyond the largest: eager
    assert graphs.padded_size(3, uniform_decode=False) is None  # mixed batch: never a graph
    with pytest.raises(ValueError, match="sizes must be distinct positive ascending"):
        DecodeGraphs((4, 2), capture=False)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_padded_decode_batches_give_the_unpadded_tokens(tmp_path: Path, backend: str) -> None:
    path = make_tiny_model(tmp_path, "llama")
    expected = _greedy_tokens(_tiny_llm(path, attention_backend=backend), PROMPTS)
    llm = _tiny_llm(path, attention_backend=backend)
    runner = _runner(llm)
    runner.decode_graphs = DecodeGraphs((1, 2, 4, 8), capture=False)
    prepared: list[Any] = []
    prepare = runner.input_preparer.prepare

    def recording_prepare(*args: Any) -> Any:
        prepared.append(prepare(*args))
        return prepared[-1]

    runner.input_preparer.prepare = recording_prepare  # type: ignore[method-assign]
    assert _greedy_tokens(llm, PROMPTS) == expected
    assert runner.decode_graphs.num_runs >= 5  # every decode step after the prefill
    # What a graph replays must live at fixed addresses: every padded step reads the same
    # storage (seed scenario 44: no per-step allocations).
    buffers = runner.buffers
    padded = [p for p in prepared if p.padded_size is not None]
    assert len(padded) == runner.decode_graphs.num_runs
    for inputs in padded:
        assert inputs.input_ids.data_ptr() == buffers.input_ids.device.data_ptr()
        assert inputs.positions.data_ptr() == buffers.positions.device.data_ptr()
        metadata = inputs.metadata
        assert metadata.slot_mapping.data_ptr() == buffers.slot_mapping.device.data_ptr()
        assert metadata.block_table.data_ptr() == buffers.block_table.device.data_ptr()
        assert metadata.seq_lens.data_ptr() == buffers.seq_lens.device.data_ptr()
        assert metadata.query_start_loc.data_ptr() == buffers.query_start_loc.device.data_ptr()
        assert inputs.input_ids.shape[0] in (1, 2, 4, 8)
    for kv_cache in runner.kv_caches:  # padding rows wrote nothing, least of all the null block
        assert not kv_cache[:, 0].any()


def test_graphs_stay_off_on_the_cpu_and_under_enforce_eager(tmp_path: Path) -> None:
    path = make_tiny_model(tmp_path, "llama")
    llm = _tiny_llm(path, attention_backend="triton")
    assert _runner(llm).decode_graphs is None
    assert _worker(llm).cuda_graph_off_reason() == "device is 'cpu'"
    assert llm.config.device.custom_ops == "triton"  # 'auto' on the CPU at -O2: its C++ kernels
    # enforce_eager is checked before the device, so its effect is observable on the CPU too: a
    # worker that ignored it would report the device instead, and capture would not be refused
    # for it.
    eager = _tiny_llm(path, attention_backend="triton", enforce_eager=True)
    assert eager.config.device.enforce_eager
    worker = _worker(eager)
    assert worker.cuda_graph_off_reason() == "enforce_eager is set"
    assert worker.capture_cuda_graphs() == 0
    assert _runner(eager).decode_graphs is None
    assert len(_greedy_tokens(eager, PROMPTS)[0]) == 3


def test_triton_custom_ops_give_the_torch_tokens(tmp_path: Path) -> None:
    path = make_tiny_model(tmp_path, "qwen2")
    expected = _greedy_tokens(_tiny_llm(path), PROMPTS)
    llm = _tiny_llm(path, custom_ops="triton", attention_backend="triton")
    assert llm.config.device.custom_ops == "triton"
    assert _greedy_tokens(llm, PROMPTS) == expected


def test_bad_custom_ops_fail_at_start_up(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = make_tiny_model(tmp_path, "llama")
    with pytest.raises(
        ValueError, match=r"custom_ops must be one of \('auto', 'torch', 'triton'\)"
    ):
        _tiny_llm(path, custom_ops="cuda")
    # Without Triton's interpreter the CPU still runs every custom op: its fused C++ kernels.
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    if not torch.cuda.is_available():
        expected = _greedy_tokens(_tiny_llm(path, custom_ops="torch"), PROMPTS)
        assert _greedy_tokens(_tiny_llm(path, custom_ops="triton"), PROMPTS) == expected


def _config_only_folder(tmp_path: Path) -> Path:
    """A model folder with config.json alone (what a dummy-weight benchmark needs)."""
    source = make_tiny_model(tmp_path / "src", "llama")
    folder = tmp_path / "shape-only"
    folder.mkdir()
    shutil.copy(source / "config.json", folder / "config.json")
    return folder


def _dummy_core_tokens(folder: Path, seed: int) -> list[int]:
    config = EngineConfig.create(
        str(folder), dtype="float32", load_format="dummy", seed=seed, num_kv_blocks=16
    )
    core = EngineCore(config)
    core.add_request("r", [5, 6, 7], GREEDY, eos_token_ids=())
    tokens: list[int] = []
    while core.has_unfinished_requests():
        for out in core.step():
            tokens.extend(out.new_token_ids)
    return tokens


def test_dummy_weights_need_only_config_json_and_are_seeded(tmp_path: Path) -> None:
    folder = _config_only_folder(tmp_path)
    first = _dummy_core_tokens(folder, seed=0)
    assert len(first) == 6
    assert _dummy_core_tokens(folder, seed=0) == first
    with pytest.raises(ValueError, match="load_format must be one of"):
        EngineConfig.create(str(folder), load_format="pickle")
    # NOTE: without a checkpoint, the default format names what is missing.
    with pytest.raises(ValueError, match=r"must contain \*\.safetensors"):
        EngineCore(EngineConfig.create(str(folder), dtype="float32", num_kv_blocks=16))
    assert json.loads((folder / "config.json").read_text())["num_hidden_layers"] == 2


@pytest.mark.gpu
def test_cuda_graph_replays_give_the_eager_tokens(tmp_path: Path) -> None:
    path = make_tiny_model(tmp_path, "llama")
    settings = {"device": "cuda", "attention_backend": "triton"}
    eager = _tiny_llm(path, enforce_eager=True, **settings)
    assert _worker(eager).cuda_graph_off_reason() == "enforce_eager is set"
    assert _runner(eager).decode_graphs is None
    expected = _greedy_tokens(eager, PROMPTS)
    llm = _tiny_llm(path, **settings)
    assert _worker(llm).cuda_graph_off_reason() is None
    graphs = _runner(llm).decode_graphs
    assert graphs is not None and graphs.num_captured == len(cuda_graph_capture_sizes(8))
    assert _greedy_tokens(llm, PROMPTS) == expected
    assert graphs.num_runs >= 5
    assert _runner(llm).buffers.input_ids.host.is_pinned()
    assert not any(kv[:, 0].any() for kv in _runner(llm).kv_caches)


@pytest.mark.gpu
def test_torch_attention_on_cuda_runs_eagerly_and_says_why(tmp_path: Path) -> None:
    path = make_tiny_model(tmp_path, "llama")
    llm = _tiny_llm(path, device="cuda", attention_backend="torch")
    assert _runner(llm).decode_graphs is None
    assert _worker(llm).cuda_graph_off_reason() == "attention backend 'torch' cannot be captured"
    assert len(_greedy_tokens(llm, PROMPTS)[0]) == 3
