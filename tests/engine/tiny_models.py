"""Tiny random-weight HF checkpoints for model, runner and end-to-end fidelity tests.

`make_tiny_model(tmp_path, "llama")` builds a transformers model from a small config with a fixed
seed, saves it with `save_pretrained` (config.json + model.safetensors) next to a tiny byte-level
tokenizer (every id in the vocabulary decodes to text) and returns the folder. `hf_greedy` and
`hf_model` are the transformers references the fidelity tests compare with.
"""

from __future__ import annotations

import random
from functools import cache
from pathlib import Path
from typing import Any

import torch

TINY_CONFIG: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "vocab_size": 512,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "tie_word_embeddings": False,
}


TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' + message['content'] + '</s>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


def save_tiny_tokenizer(out: Path, vocab_size: int) -> None:
    """A byte-level tokenizer: <unk>=0, <s>=1, </s>=2, the 256 bytes, then filler tokens.

    No merges, so any text encodes byte by byte; filler ids decode to `<tN>` so that whatever a
    random-weight model generates can be detokenized.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>"]
    symbols = specials + sorted(pre_tokenizers.ByteLevel.alphabet())
    if vocab_size < len(symbols):
        raise ValueError(f"vocab_size must be >= {len(symbols)} for the tiny tokenizer")
    symbols += [f"<t{i}>" for i in range(len(symbols), vocab_size)]
    vocab = {symbol: i for i, symbol in enumerate(symbols)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(specials)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        chat_template=TINY_CHAT_TEMPLATE,
    )
    wrapped.save_pretrained(out)


def make_tiny_model(tmp_path: Path, arch: str, seed: int = 0, **overrides: Any) -> Path:
    """Save a random-weight tiny `arch` ("llama" or "qwen2") model under tmp_path; return its dir.

    Overrides replace TINY_CONFIG keys (e.g. `rope_scaling={...}`, `tie_word_embeddings=True`).
    Weights are drawn with a larger std than HF's default so logits are far from uniform and
    greedy argmax is not decided by rounding noise.
    """
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    config_classes = {"llama": LlamaConfig, "qwen2": Qwen2Config}
    if arch not in config_classes:
        raise ValueError(f"arch must be one of {sorted(config_classes)}, got {arch!r}")
    config = config_classes[arch](**{**TINY_CONFIG, **overrides})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
            else:
                param.copy_(0.2 * torch.randn_like(param))
    out = tmp_path / f"tiny-{arch}-{seed}"
    model.save_pretrained(out)
    save_tiny_tokenizer(out, int(config.vocab_size))
    return out


def load_engine_model(config: Any) -> Any:
    """The engine's model for an `EngineConfig`, built as the worker builds it (typed arch, layer
    context, then the loader)."""
    from fleetserve.engine.models.arch import ModelArch
    from fleetserve.engine.models.loader import build_layer_context, load_model

    arch = ModelArch.from_hf_config(config.model.hf_config)
    return load_model(config, arch, build_layer_context(config))


@cache
def hf_model(path: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_greedy(path: Path, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Reference: one prompt at a time (no padding), greedy, stopping at EOS like we do."""
    model = hf_model(str(path))
    outputs = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_tokens,
                do_sample=False,
                pad_token_id=model.config.eos_token_id,
            )
        outputs.append(out[0, len(prompt) :].tolist())
    return outputs


def make_prompts(vocab: int, lengths: list[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


# -- mixture-of-experts models ------------------------------------------------------------------

TINY_MOE_CONFIGS: dict[str, dict[str, Any]] = {
    "mixtral": {"intermediate_size": 64, "num_local_experts": 4, "num_experts_per_tok": 2},
    "qwen2_moe": {
        # Layer 1 of 3 keeps a dense MLP; the shared expert is gated; top-k not renormalised.
        "num_hidden_layers": 3,
        "mlp_only_layers": [1],
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 64,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "norm_topk_prob": False,
    },
    "qwen3_moe": {
        "moe_intermediate_size": 32,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "norm_topk_prob": True,
    },
    "deepseek_v3": {
        # MLA with q/kv LoRA ranks; layer 0 dense; 8 experts in 4 groups, 2 groups per token.
        "num_hidden_layers": 3,
        "num_key_value_heads": 4,
        "head_dim": None,
        "first_k_dense_replace": 1,
        "moe_intermediate_size": 32,
        "n_routed_experts": 8,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "n_group": 4,
        "topk_group": 2,
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "q_lora_rank": 32,
        "kv_lora_rank": 32,
        "qk_nope_head_dim": 32,
        "qk_rope_head_dim": 32,
        "v_head_dim": 32,
    },
}


def make_tiny_moe_model(tmp_path: Path, arch: str, seed: int = 0, **overrides: Any) -> Path:
    """Save a random-weight tiny MoE model ("mixtral", "qwen2_moe", "qwen3_moe" or
    "deepseek_v3") under tmp_path; return its dir. Weights as `make_tiny_model` draws them;
    DeepSeek's correction bias gets random values too, so the grouped choice is exercised."""
    from transformers import (
        AutoModelForCausalLM,
        DeepseekV3Config,
        MixtralConfig,
        Qwen2MoeConfig,
        Qwen3MoeConfig,
    )

    config_classes = {
        "mixtral": MixtralConfig,
        "qwen2_moe": Qwen2MoeConfig,
        "qwen3_moe": Qwen3MoeConfig,
        "deepseek_v3": DeepseekV3Config,
    }
    if arch not in config_classes:
        raise ValueError(f"arch must be one of {sorted(config_classes)}, got {arch!r}")
    settings = {**TINY_CONFIG, **TINY_MOE_CONFIGS[arch], **overrides}
    settings = {k: v for k, v in settings.items() if v is not None}
    config = config_classes[arch](**settings)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
            else:
                param.copy_(0.2 * torch.randn_like(param))
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(0.1 * torch.randn_like(buffer))
    out = tmp_path / f"tiny-{arch}-{seed}"
    model.save_pretrained(out)
    save_tiny_tokenizer(out, int(config.vocab_size))
    return out
