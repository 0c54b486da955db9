"""Build a model from a Hugging Face folder: config.json + *.safetensors → our modules on a device.

Weights stream tensor by tensor from `safe_open` (never a whole file in memory) as lazy slices
(`SafetensorsSlice`): each parameter's module reads only the rows or columns its tensor-parallel
rank keeps (`narrow`), casts them to the engine dtype and copies them into its pre-allocated
parameter on the target device, so no rank materialises a tensor it does not own. The lm_head is tied to
the embedding when the config says so or when the checkpoint has no `lm_head.weight`.

`load_format="dummy"` skips the checkpoint: parameters are drawn from a seeded normal (std 0.02;
norm weights 1) directly on the device, so a model's shape can be benchmarked from its
config.json alone (e.g. an 8B model without 16 GB of weights on disk).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import safe_open

from fleetserve.engine.config import EngineConfig
from fleetserve.engine.layers.attention.selector import select_attention_backend
from fleetserve.engine.layers.fused_moe.selector import select_moe_backend
from fleetserve.engine.layers.layer_context import LayerContext
from fleetserve.engine.layers.vocab_parallel_embedding import ParallelLMHead
from fleetserve.engine.models.arch import ModelArch
from fleetserve.engine.models.interface import CausalLM
from fleetserve.engine.models.registry import resolve_model_class
from fleetserve.engine.quantization.apply import assign_quant_methods, finish_quantization
from fleetserve.envs import read_env

if TYPE_CHECKING:
    from fleetserve.engine.compilation.pieces import CompiledPieces
    from fleetserve.engine.distributed.group import GroupCoordinator

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def torch_dtype(name: str) -> torch.dtype:
    """Raises ValueError for names outside float32 / bfloat16 / float16."""
    if name not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {name!r}")
    return _DTYPES[name]


def safetensors_files(model_dir: str | Path) -> list[Path]:
    """The checkpoint shards: those the index names, else the single/all *.safetensors files.

    Raises:
        ValueError: the folder holds no safetensors weights.
    """
    root = Path(model_dir)
    index = root / "model.safetensors.index.json"
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        return [root / name for name in sorted(set(weight_map.values()))]
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model folder {str(root)!r} must contain *.safetensors weights")
    return files


class SafetensorsSlice:
    """One checkpoint tensor, read in part on demand (a `CheckpointTensor`).

    Valid while the file it comes from is open (during `iterate_weights`'s iteration of it).
    """

    def __init__(self, handle: Any, dtype: torch.dtype) -> None:
        self._handle = handle
        self._dtype = dtype
        self.shape = torch.Size(handle.get_shape())

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        """Rows (dim 0) or columns (dim 1) [start, start + length) as a CPU tensor in the
        engine dtype; only those elements are read from the file.

        Raises:
            ValueError: dim outside the tensor's dimensions.
        """
        if not 0 <= dim < max(len(self.shape), 1):
            raise ValueError(f"dim must be in [0, {len(self.shape)}), got {dim}")
        if not self.shape:
            return self._handle[:].to(self._dtype)  # a scalar: nothing to slice
        index = [slice(None)] * dim + [slice(start, start + length)]
        tensor: torch.Tensor = self._handle[tuple(index)]
        # NOTE: a quantized checkpoint's integer tensors (packed weights) keep their dtype.
        return tensor.to(self._dtype) if tensor.is_floating_point() else tensor


def iterate_weights(
    model_dir: str | Path, dtype: torch.dtype
) -> Iterator[tuple[str, SafetensorsSlice]]:
    """Yield (checkpoint name, lazy slice read as `dtype`) for every tensor of every shard."""
    for path in safetensors_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open handles are not iterable
                yield name, SafetensorsSlice(f.get_slice(name), dtype)


def build_layer_context(
    config: EngineConfig,
    *,
    tp_group: GroupCoordinator | None = None,
    pp_rank: int = 0,
    ep_group: GroupCoordinator | None = None,
) -> LayerContext:
    """The `LayerContext` of one rank: the engine's dtype, device and custom-ops choice, its
    tensor-parallel group (None: a single rank), its pipeline stage and its expert-parallel
    group (None: experts are not spread over ranks).

    Custom ops run everywhere: Triton kernels on CUDA, the fused C++ kernels on the CPU
    (`fleetserve.kernels.custom_ops`).

    Raises:
        ValueError: an unknown dtype, or a triton MoE backend on the CPU outside Triton's
            interpreter.
    """
    device = torch.device(config.device.device)
    custom_ops = config.device.custom_ops
    return LayerContext(
        dtype=torch_dtype(config.model.dtype),
        device=device,
        custom_ops=custom_ops,
        pieces=_compiled_pieces(config),
        tp_rank=0 if tp_group is None else tp_group.rank_in_group,
        tp_size=1 if tp_group is None else tp_group.world_size,
        tp_group=tp_group,
        pp_rank=pp_rank,
        pp_size=config.parallel.pipeline_parallel_size,
        pp_partition=config.parallel.pipeline_layer_partition,
        ep_rank=0 if ep_group is None else ep_group.rank_in_group,
        ep_size=1 if ep_group is None else ep_group.world_size,
        ep_group=ep_group,
        moe_backend=select_moe_backend(config.device.moe_backend, device),
        num_redundant_experts=config.eplb.redundant_experts if config.eplb.enabled else 0,
    )


def _compiled_pieces(config: EngineConfig) -> CompiledPieces | None:
    """The engine's compiled pieces when its config compiles (`compile_min_tokens` > 0); their
    cache key is what the generated code depends on: the dtype and the model's config."""
    min_tokens = config.device.compile_min_tokens
    if min_tokens == 0:
        return None
    from fleetserve.engine.compilation.pieces import CompiledPieces

    key = (config.model.dtype, json.dumps(config.model.hf_config, sort_keys=True, default=str))
    return CompiledPieces(min_tokens, read_env().cache_root / "compile", key)


def load_model(config: EngineConfig, arch: ModelArch, context: LayerContext) -> CausalLM:
    """Construct the configured architecture on the context's device and fill it from the
    checkpoint (or with seeded dummy weights under `load_format="dummy"`).

    Raises:
        ValueError: unknown architecture, no usable attention backend, a value the model class
            does not support, a shape mismatch, or parameters the checkpoint does not provide.
    """
    model_cls = resolve_model_class(arch.architecture)
    backend = select_attention_backend(
        config.device.attention_backend,
        arch.head_size,
        context.dtype,
        config.cache.block_size,
        context.device,
    )
    model = model_cls(arch, context, attn_backend=backend, max_position=config.model.max_model_len)
    if config.quantization is not None:
        assign_quant_methods(model, config.quantization, context.dtype, context.device)
    if config.model.load_format == "dummy":
        initialize_dummy_weights(model, config.model.seed)
        return _finish_loading(model)
    loaded = model.load_weights(iterate_weights(config.model.model, context.dtype))
    expected = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    if "lm_head.weight" in expected - loaded and "model.embed_tokens.weight" in loaded:
        model.tie_lm_head()
        loaded.add("lm_head.weight")
    missing = sorted(expected - loaded)
    if missing:
        raise ValueError(
            f"checkpoint in {config.model.model!r} lacks parameters: {', '.join(missing[:8])}"
            + (" ..." if len(missing) > 8 else "")
        )
    return _finish_loading(model)


def _finish_loading(model: CausalLM) -> CausalLM:
    """The weights are final: quant methods turn them into what they apply (and unquantized
    layers prepack them for the CPU GEMM), LM heads prepack theirs."""
    finish_quantization(model)
    for module in model.modules():
        if isinstance(module, ParallelLMHead):
            module.prepack()
    return model.eval()


def initialize_dummy_weights(model: torch.nn.Module, seed: int) -> None:
    """Fill every parameter in place: norm weights 1, biases 0, the rest N(0, 0.02), seeded."""
    generator: torch.Generator | None = None
    with torch.no_grad():
        for name, param in model.named_parameters():
            if generator is None:
                generator = torch.Generator(device=param.device)
                generator.manual_seed(seed)
            if not param.is_floating_point():  # a quantized checkpoint's packed words
                param.random_(generator=generator)
            elif name.endswith("norm.weight"):
                param.fill_(1.0)
            elif name.endswith(".bias"):
                param.zero_()
            else:
                param.normal_(0.0, 0.02, generator=generator)
