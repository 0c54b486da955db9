"""Tiny PEFT LoRA adapters for the LoRA tests, and the transformers + peft reference.

`make_adapter` wraps the tiny base model with `peft`, draws every LoRA weight from a fixed seed
(PEFT starts B at zero, which would make the adapter a no-op) and saves the PEFT folder;
`peft_greedy` merges the adapter into a fresh copy of the base model and decodes greedily.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import torch

from tests.engine.tiny_models import hf_greedy

ALL_PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@dataclass(frozen=True)
class TinyLoRAs:
    base: Path
    a: Path
    """rank 8, alpha 16, on q/v/down (k, o, gate and up untouched)."""
    b: Path
    """rank 4, rsLoRA, on every projection (the fused q/k/v and gate/up in full)."""
    c: Path
    """rank 8 on o_proj, gate_proj and up_proj (the third adapter of the eviction tests)."""


def make_adapter(
    base: Path,
    out: Path,
    *,
    seed: int,
    target_modules: list[str] | str,
    r: int = 8,
    lora_alpha: int = 16,
    use_rslora: bool = False,
) -> Path:
    """Save a random-weight LoRA adapter of `base` as a PEFT folder at `out`; return it."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    config = LoraConfig(
        r=r,
        lora_alpha=lora_alpha,
        target_modules=target_modules,
        lora_dropout=0.0,
        use_rslora=use_rslora,
        task_type="CAUSAL_LM",
    )
    peft_model = get_peft_model(model, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.copy_(0.3 * torch.randn(param.shape, generator=generator))
    peft_model.save_pretrained(str(out))
    return out


@cache
def merged_model_path(base: str, adapter: str, out: str) -> str:
    """The base model with `adapter` merged in (PEFT's merge_and_unload), saved at `out`."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    merged = PeftModel.from_pretrained(model, adapter).merge_and_unload()
    merged.save_pretrained(out)
    return out


def peft_greedy(
    base: Path, adapter: Path | None, prompts: list[list[int]], max_tokens: int, **_: Any
) -> list[list[int]]:
    """transformers' greedy tokens with `adapter` merged into `base` (None: the base model)."""
    if adapter is None:
        return hf_greedy(base, prompts, max_tokens)
    merged = merged_model_path(str(base), str(adapter), str(adapter) + "-merged")
    return hf_greedy(Path(merged), prompts, max_tokens)
