"""One adapter's weights, read from its PEFT folder into host memory."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fleetserve.engine.lora.peft_config import ADAPTER_WEIGHTS, PEFTLoRAConfig, read_peft_config

__all__ = ["LoRAModel", "LoRAWeights"]

_PREFIX = "base_model.model."


@dataclass(frozen=True, slots=True)
class LoRAWeights:
    """One checkpoint module's low-rank pair (host tensors, float32)."""

    lora_a: torch.Tensor
    """[r, in]"""
    lora_b: torch.Tensor
    """[out, r]"""


@dataclass(frozen=True, slots=True)
class LoRAModel:
    """A loaded adapter: its id, rank, scaling and weights by checkpoint module name
    (e.g. model.layers.0.self_attn.q_proj)."""

    lora_int_id: int
    rank: int
    scaling: float
    weights: dict[str, LoRAWeights]

    @classmethod
    def from_folder(cls, lora_int_id: int, path: str, max_rank: int) -> LoRAModel:
        """Load `path` (adapter_config.json + adapter_model.safetensors).

        Raises:
            ValueError: a bad folder or config, a rank above `max_rank`, or tensors that do not
                form matching A/B pairs of rank r (each message names the tensor).
        """
        from safetensors.torch import load_file

        config = read_peft_config(path)
        if config.r > max_rank:
            raise ValueError(
                f"LoRA adapter {path!r} has rank {config.r}, above max_lora_rank ({max_rank})"
            )
        tensors = load_file(f"{path}/{ADAPTER_WEIGHTS}")
        return cls(lora_int_id, config.r, config.scaling, _pair_tensors(tensors, config, path))


def _pair_tensors(
    tensors: dict[str, torch.Tensor], config: PEFTLoRAConfig, path: str
) -> dict[str, LoRAWeights]:
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        stem = name.removeprefix(_PREFIX)
        for kind in ("lora_A", "lora_B"):
            marker = f".{kind}."
            if marker in stem:
                module = stem.split(marker, 1)[0]
                halves.setdefault(module, {})[kind] = tensor
                break
        else:
            raise ValueError(
                f"LoRA adapter {path!r}: tensor {name} is not a lora_A/lora_B weight "
                "(embeddings, biases and modules_to_save are not served)"
            )
    weights: dict[str, LoRAWeights] = {}
    for module, pair in sorted(halves.items()):
        if set(pair) != {"lora_A", "lora_B"}:
            raise ValueError(f"LoRA adapter {path!r}: {module} lacks lora_A or lora_B")
        a, b = pair["lora_A"], pair["lora_B"]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != config.r or b.shape[1] != config.r:
            raise ValueError(
                f"LoRA adapter {path!r}: {module} has lora_A {tuple(a.shape)} and lora_B "
                f"{tuple(b.shape)}, expected [r, in] and [out, r] with r={config.r}"
            )
        if not config.targets(module):
            raise ValueError(
                f"LoRA adapter {path!r}: {module} has weights but target_modules "
                f"{config.target_modules!r} does not name it"
            )
        weights[module] = LoRAWeights(a.float(), b.float())
    if not weights:
        raise ValueError(f"LoRA adapter {path!r} holds no LoRA weights")
    return weights
