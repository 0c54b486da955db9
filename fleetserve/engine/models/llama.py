"""Llama-family decoder (LlamaForCausalLM, MistralForCausalLM; Qwen2 subclasses it).

Parameter names mirror Hugging Face's so that checkpoint names map one to one, except that q/k/v
are fused into `qkv_proj` and gate/up into `gate_up_proj` at load time (one matmul each).
All tensors are token-major and unpadded: [num_tokens, ...], one flat batch per step.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from fleetserve.engine.layers.activation import SiluAndMul
from fleetserve.engine.layers.attention import AttentionBackend, AttentionMetadata
from fleetserve.engine.layers.linear import Embedding, Linear, MergedLinear
from fleetserve.engine.layers.norm import RMSNorm
from fleetserve.engine.layers.rotary import RotaryEmbedding
from fleetserve.engine.models.interface import CausalLM

# Checkpoint projection name → (our fused module name, shard index).
_STACKED_PARAMS: tuple[tuple[str, str, int], ...] = (
    ("q_proj", "qkv_proj", 0),
    ("k_proj", "qkv_proj", 1),
    ("v_proj", "qkv_proj", 2),
    ("gate_proj", "gate_up_proj", 0),
    ("up_proj", "gate_up_proj", 1),
)


def head_size_of(hf_config: dict[str, Any]) -> int:
    """The config's `head_dim` when present, else hidden_size // num_attention_heads."""
    head_dim = hf_config.get("head_dim")
    if head_dim:
        return int(head_dim)
    return int(hf_config["hidden_size"]) // int(hf_config["num_attention_heads"])


class LlamaAttention(nn.Module):
    def __init__(
        self,
        hf_config: dict[str, Any],
        rotary: RotaryEmbedding,
        backend_cls: type[AttentionBackend],
        *,
        qkv_bias: bool,
        o_bias: bool,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        hidden = int(hf_config["hidden_size"])
        self.num_heads = int(hf_config["num_attention_heads"])
        self.num_kv_heads = int(hf_config.get("num_key_value_heads") or self.num_heads)
        self.head_size = head_size_of(hf_config)
        self.q_size = self.num_heads * self.head_size
        self.kv_size = self.num_kv_heads * self.head_size
        self.scale = self.head_size**-0.5
        self.qkv_proj = MergedLinear(
            hidden,
            [self.q_size, self.kv_size, self.kv_size],
            bias=qkv_bias,
            dtype=dtype,
            device=device,
        )
        self.o_proj = Linear(self.q_size, hidden, bias=o_bias, dtype=dtype, device=device)
        self.rotary = rotary
        self.attn = backend_cls(self.num_heads, self.num_kv_heads, self.head_size)

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        qkv = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_size)
        k = k.view(-1, self.num_kv_heads, self.head_size)
        v = v.view(-1, self.num_kv_heads, self.head_size)
        q, k = self.rotary(positions, q, k)
        out = self.attn.forward(q, k, v, kv_cache, metadata, self.scale)
        return self.o_proj(out.reshape(-1, self.q_size))


class LlamaMLP(nn.Module):
    def __init__(
        self,
        hf_config: dict[str, Any],
        *,
        bias: bool,
        dtype: torch.dtype,
        device: torch.device,
        use_triton: bool = False,
    ) -> None:
        super().__init__()
        hidden = int(hf_config["hidden_size"])
        intermediate = int(hf_config["intermediate_size"])
        act = hf_config.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act must be 'silu', got {act!r}")
        self.gate_up_proj = MergedLinear(
            hidden, [intermediate, intermediate], bias=bias, dtype=dtype, device=device
        )
        self.down_proj = Linear(intermediate, hidden, bias=bias, dtype=dtype, device=device)
        self.act_fn = SiluAndMul(use_triton=use_triton)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self,
        hf_config: dict[str, Any],
        rotary: RotaryEmbedding,
        backend_cls: type[AttentionBackend],
        *,
        qkv_bias: bool,
        o_bias: bool,
        mlp_bias: bool,
        dtype: torch.dtype,
        device: torch.device,
        use_triton: bool = False,
    ) -> None:
        super().__init__()
        hidden = int(hf_config["hidden_size"])
        eps = float(hf_config.get("rms_norm_eps", 1e-6))
        self.self_attn = LlamaAttention(
            hf_config,
            rotary,
            backend_cls,
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            dtype=dtype,
            device=device,
        )
        self.mlp = LlamaMLP(
            hf_config, bias=mlp_bias, dtype=dtype, device=device, use_triton=use_triton
        )
        self.input_layernorm = RMSNorm(hidden, eps, dtype, device, use_triton=use_triton)
        self.post_attention_layernorm = RMSNorm(hidden, eps, dtype, device, use_triton=use_triton)

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states, kv_cache, metadata)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class LlamaModel(nn.Module):
    def __init__(
        self,
        hf_config: dict[str, Any],
        backend_cls: type[AttentionBackend],
        *,
        qkv_bias: bool,
        o_bias: bool,
        mlp_bias: bool,
        max_position: int,
        dtype: torch.dtype,
        device: torch.device,
        use_triton: bool = False,
    ) -> None:
        super().__init__()
        hidden = int(hf_config["hidden_size"])
        self.embed_tokens = Embedding(
            int(hf_config["vocab_size"]), hidden, dtype=dtype, device=device
        )
        # NOTE: one rotary table for all layers (they share the config).
        rotary = RotaryEmbedding(
            hf_config,
            head_size_of(hf_config),
            max_position,
            dtype,
            device,
            use_triton=use_triton,
        )
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(
                hf_config,
                rotary,
                backend_cls,
                qkv_bias=qkv_bias,
                o_bias=o_bias,
                mlp_bias=mlp_bias,
                dtype=dtype,
                device=device,
                use_triton=use_triton,
            )
            for _ in range(int(hf_config["num_hidden_layers"]))
        )
        eps = float(hf_config.get("rms_norm_eps", 1e-6))
        self.norm = RMSNorm(hidden, eps, dtype, device, use_triton=use_triton)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids)
        residual: torch.Tensor | None = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden_states, residual = layer(positions, hidden_states, residual, kv_cache, metadata)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class LlamaForCausalLM(CausalLM):
    """Llama (and Mistral) causal LM.

    Construction allocates uninitialised weights on `device`; `load_weights` fills them. With
    `use_triton_ops`, RMSNorm, rotary and SiLU-and-mul run as the fused kernels of
    `fleetserve.kernels` instead of eager torch ops.
    """

    uses_sliding_window_by_default = True
    """Whether a `sliding_window` key applies when the config has no `use_sliding_window`."""

    @classmethod
    def projection_biases(cls, hf_config: dict[str, Any]) -> tuple[bool, bool, bool]:
        """Which projections carry a bias: (q/k/v, o_proj, MLP)."""
        attention_bias = bool(hf_config.get("attention_bias", False))
        return attention_bias, attention_bias, bool(hf_config.get("mlp_bias", False))

    def __init__(
        self,
        hf_config: dict[str, Any],
        *,
        attn_backend: type[AttentionBackend],
        max_position: int,
        dtype: torch.dtype,
        device: torch.device,
        use_triton_ops: bool = False,
    ) -> None:
        super().__init__()
        window = hf_config.get("sliding_window")
        uses_window = hf_config.get("use_sliding_window", self.uses_sliding_window_by_default)
        if uses_window and window and int(window) < max_position:
            raise ValueError(
                f"sliding_window attention is not supported; max_model_len must be <= "
                f"sliding_window ({window}), got {max_position}"
            )
        qkv_bias, o_bias, mlp_bias = self.projection_biases(hf_config)
        self.attn_backend = attn_backend
        self.model = LlamaModel(
            hf_config,
            attn_backend,
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=mlp_bias,
            max_position=max_position,
            dtype=dtype,
            device=device,
            use_triton=use_triton_ops,
        )
        self.tie_word_embeddings = bool(hf_config.get("tie_word_embeddings", False))
        self.lm_head = Linear(
            int(hf_config["hidden_size"]),
            int(hf_config["vocab_size"]),
            bias=False,
            dtype=dtype,
            device=device,
        )
        if self.tie_word_embeddings:
            self.tie_lm_head()

    def tie_lm_head(self) -> None:
        """Share the embedding matrix as the output projection."""
        self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """Hidden states [num_tokens, hidden] after the final norm."""
        return self.model(input_ids, positions, kv_caches, attn_metadata)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Float32 logits [n, vocab_size] for the selected hidden states [n, hidden]."""
        return self.lm_head(hidden_states).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy checkpoint tensors into the parameters; returns the names of the parameters filled.

        Raises:
            ValueError: a tensor's shape does not match its parameter.
        """
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and self.tie_word_embeddings:
                continue
            for ckpt_part, fused_part, shard in _STACKED_PARAMS:
                if f".{ckpt_part}." not in name:
                    continue
                fused_name = name.replace(f".{ckpt_part}.", f".{fused_part}.")
                if fused_name not in params:
                    continue
                module = self.get_submodule(fused_name.rsplit(".", 1)[0])
                assert isinstance(module, MergedLinear), f"{fused_name} is not a fused linear"
                module.load_shard(params[fused_name], tensor, shard)
                loaded.add(f"{fused_name}#{shard}")
                break
            else:
                if name not in params:
                    continue
                param = params[name]
                if tuple(param.shape) != tuple(tensor.shape):
                    raise ValueError(
                        f"checkpoint tensor {name} has shape {tuple(tensor.shape)}, "
                        f"expected {tuple(param.shape)}"
                    )
                param.data.copy_(tensor)
                loaded.add(name)
        return self._complete_names(loaded)

    def _complete_names(self, loaded: set[str]) -> set[str]:
        """Parameter names whose every shard was loaded (tied lm_head counts as loaded)."""
        complete = {name for name in loaded if "#" not in name}
        for name, module in self.named_modules():
            if isinstance(module, MergedLinear):
                for param_name, _ in module.named_parameters():
                    full = f"{name}.{param_name}"
                    shards = {f"{full}#{i}" for i in range(len(module.output_sizes))}
                    if shards <= loaded:
                        complete.add(full)
        if self.tie_word_embeddings and "model.embed_tokens.weight" in complete:
            complete.add("lm_head.weight")
        return complete
