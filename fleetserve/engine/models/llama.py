"""Llama-family decoder (LlamaForCausalLM, MistralForCausalLM; Qwen2 subclasses it).

Parameter names mirror Hugging Face's so that checkpoint names map one to one, except that q/k/v
are fused into `qkv_proj` and gate/up into `gate_up_proj` at load time (one matmul each; the
mapping is `stacked_params_mapping`). Every module is built from one `ModelArch` (what the config
declares) and one `LayerContext` (dtype, device, custom ops, parallel ranks). All tensors are
token-major and unpadded: [num_tokens, ...], one flat batch per step; the step's attention
metadata and KV caches arrive in the `ForwardContext`.

Under tensor parallelism (the context's `tp_size` > 1) each rank holds its share of the heads
(KV heads replicated when there are fewer than ranks), of the MLP's intermediate width and of
the vocabulary; the all-reduces sit where Megatron puts them: after o_proj, after down_proj and
after the embedding lookup (`fleetserve.engine.layers.linear`).

Under pipeline parallelism a rank builds only its stage's decoder layers (the others are empty
placeholders, so that names and layer indices stay global), the embedding on the first stage and
the final norm and LM head on the last; a stage before the last returns `IntermediateTensors`
for the next one (`fleetserve.engine.distributed.pipeline`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from functools import partial

import torch
from torch import nn

from fleetserve.engine.distributed.pipeline import IntermediateTensors
from fleetserve.engine.layers.activation import SiluAndMul
from fleetserve.engine.layers.attention.base import AttentionBackend
from fleetserve.engine.layers.attention.layer import Attention
from fleetserve.engine.layers.forward_context import ForwardContext
from fleetserve.engine.layers.layer_context import LayerContext
from fleetserve.engine.layers.linear import (
    CheckpointTensor,
    ColumnParallelLinear,
    RowParallelLinear,
    copy_checked,
    qkv_slices,
)
from fleetserve.engine.layers.norm import RMSNorm
from fleetserve.engine.layers.rotary import RotaryEmbedding
from fleetserve.engine.layers.vocab_parallel_embedding import (
    ParallelLMHead,
    VocabParallelEmbedding,
)
from fleetserve.engine.models.arch import ModelArch
from fleetserve.engine.models.interface import CausalLM


class LlamaAttention(nn.Module):
    def __init__(
        self,
        arch: ModelArch,
        context: LayerContext,
        rotary: RotaryEmbedding,
        backend_cls: type[AttentionBackend],
        *,
        qkv_bias: bool,
        o_bias: bool,
        prefix: str,
    ) -> None:
        super().__init__()
        slices = qkv_slices(
            arch.num_attention_heads,
            arch.num_key_value_heads,
            arch.head_size,
            context.tp_rank,
            context.tp_size,
        )
        self.head_size = arch.head_size
        self.q_size, self.kv_size = slices[0].size, slices[1].size
        self.num_heads = self.q_size // self.head_size
        self.num_kv_heads = self.kv_size // self.head_size
        self.qkv_proj = ColumnParallelLinear(arch.hidden_size, list(slices), context, bias=qkv_bias)
        self.o_proj = RowParallelLinear(arch.q_size, arch.hidden_size, context, bias=o_bias)
        self.rotary = rotary
        self.attn = Attention(
            self.num_heads,
            self.num_kv_heads,
            self.head_size,
            backend_cls=backend_cls,
            layer_name=f"{prefix}.attn",
        )

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, context: ForwardContext
    ) -> torch.Tensor:
        qkv = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_size)
        k = k.view(-1, self.num_kv_heads, self.head_size)
        v = v.view(-1, self.num_kv_heads, self.head_size)
        q, k = self.rotary(positions, q, k)
        out = self.attn(q, k, v, context)
        return self.o_proj(out.reshape(-1, self.q_size))


class LlamaMLP(nn.Module):
    def __init__(self, arch: ModelArch, context: LayerContext, *, bias: bool) -> None:
        super().__init__()
        if arch.hidden_act != "silu":
            raise ValueError(f"hidden_act must be 'silu', got {arch.hidden_act!r}")
        hidden, intermediate = arch.hidden_size, arch.intermediate_size
        self.gate_up_proj = ColumnParallelLinear.merged(
            hidden, [intermediate, intermediate], context, bias=bias
        )
        self.down_proj = RowParallelLinear(intermediate, hidden, context, bias=bias)
        self.act_fn = SiluAndMul(context)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


LayerParts = Callable[[int, RotaryEmbedding, str], tuple[nn.Module | None, nn.Module | None]]
"""(layer index, the shared rotary, the layer's prefix) → a model family's own (self_attn, mlp)
modules for that layer, None for Llama's (MoE models replace the MLP, MLA the attention)."""


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self,
        arch: ModelArch,
        context: LayerContext,
        rotary: RotaryEmbedding,
        backend_cls: type[AttentionBackend],
        *,
        biases: tuple[bool, bool, bool],
        prefix: str,
        self_attn: nn.Module | None = None,
        mlp: nn.Module | None = None,
    ) -> None:
        super().__init__()
        qkv_bias, o_bias, mlp_bias = biases
        self.self_attn = (
            self_attn
            if self_attn is not None
            else LlamaAttention(
                arch,
                context,
                rotary,
                backend_cls,
                qkv_bias=qkv_bias,
                o_bias=o_bias,
                prefix=f"{prefix}.self_attn",
            )
        )
        self.mlp = mlp if mlp is not None else LlamaMLP(arch, context, bias=mlp_bias)
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, context)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, context)

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        residual: torch.Tensor | None,
        context: ForwardContext,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states, context)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class LlamaModel(nn.Module):
    def __init__(
        self,
        arch: ModelArch,
        context: LayerContext,
        backend_cls: type[AttentionBackend],
        *,
        biases: tuple[bool, bool, bool],
        max_position: int,
        prefix: str = "model",
        layer_parts: LayerParts | None = None,
    ) -> None:
        super().__init__()
        self.start_layer, self.end_layer = context.layer_range(arch.num_hidden_layers)
        self.embed_tokens = (
            VocabParallelEmbedding(arch.vocab_size, arch.hidden_size, context)
            if context.is_first_stage
            else None
        )
        # NOTE: one rotary table for all layers (they share the config).
        rotary = RotaryEmbedding(arch.rope, arch.head_size, max_position, context)

        def decoder_layer(i: int) -> LlamaDecoderLayer:
            name = f"{prefix}.layers.{i}"
            self_attn, mlp = (None, None) if layer_parts is None else layer_parts(i, rotary, name)
            return LlamaDecoderLayer(
                arch, context, rotary, backend_cls, biases=biases, prefix=name,
                self_attn=self_attn, mlp=mlp,
            )  # fmt: skip

        self.layers = nn.ModuleList(
            decoder_layer(i)
            if self.start_layer <= i < self.end_layer
            else nn.Identity()  # another stage's layer
            for i in range(arch.num_hidden_layers)
        )
        self.norm = (
            RMSNorm(arch.hidden_size, arch.rms_norm_eps, context) if context.is_last_stage else None
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        context: ForwardContext,
        intermediate: IntermediateTensors | None = None,
    ) -> torch.Tensor | IntermediateTensors:
        residual: torch.Tensor | None
        if intermediate is None:
            assert self.embed_tokens is not None, "a later pipeline stage needs its input"
            hidden_states, residual = self.embed_tokens(input_ids), None
        else:
            hidden_states, residual = intermediate.hidden_states, intermediate.residual
        for layer in self.layers[self.start_layer : self.end_layer]:
            hidden_states, residual = layer(positions, hidden_states, residual, context)
        if self.norm is None:
            assert residual is not None
            return IntermediateTensors(hidden_states, residual)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class LlamaForCausalLM(CausalLM):
    """Llama (and Mistral) causal LM.

    Construction allocates uninitialised weights on the context's device; `load_weights` fills
    them. With the context's triton custom ops, RMSNorm, rotary and SiLU-and-mul run as the fused
    kernels of `fleetserve.kernels` instead of eager torch ops.
    """

    uses_sliding_window_by_default = True
    """Whether a `sliding_window` key applies when the config has no `use_sliding_window`."""

    @classmethod
    def projection_biases(cls, arch: ModelArch) -> tuple[bool, bool, bool]:
        """Which projections carry a bias: (q/k/v, o_proj, MLP)."""
        return arch.attention_bias, arch.attention_bias, arch.mlp_bias

    @classmethod
    def stacked_params_mapping(cls) -> tuple[tuple[str, str, int], ...]:
        """Checkpoint projection name → (our fused module name, shard index).

        A per-model mapping: an MoE model adds its expert mapping beside it.
        """
        return (
            ("q_proj", "qkv_proj", 0),
            ("k_proj", "qkv_proj", 1),
            ("v_proj", "qkv_proj", 2),
            ("gate_proj", "gate_up_proj", 0),
            ("up_proj", "gate_up_proj", 1),
        )

    def __init__(
        self,
        arch: ModelArch,
        context: LayerContext,
        *,
        attn_backend: type[AttentionBackend],
        max_position: int,
    ) -> None:
        super().__init__()
        window = arch.sliding_window
        uses_window = (
            self.uses_sliding_window_by_default
            if arch.use_sliding_window is None
            else arch.use_sliding_window
        )
        if uses_window and window and window < max_position:
            raise ValueError(
                f"sliding_window attention is not supported; max_model_len must be <= "
                f"sliding_window ({window}), got {max_position}"
            )
        self.attn_backend = attn_backend
        self.model = LlamaModel(
            arch,
            context,
            attn_backend,
            biases=self.projection_biases(arch),
            max_position=max_position,
            layer_parts=partial(self.decoder_layer_parts, arch, context, attn_backend),
        )
        self.tie_word_embeddings = arch.tie_word_embeddings
        self.lm_head = (
            ParallelLMHead(arch.vocab_size, arch.hidden_size, context)
            if context.is_last_stage
            else None
        )
        if self.tie_word_embeddings and self.model.embed_tokens is not None:
            self.tie_lm_head()

    def decoder_layer_parts(
        self,
        arch: ModelArch,
        context: LayerContext,
        attn_backend: type[AttentionBackend],
        index: int,
        rotary: RotaryEmbedding,
        prefix: str,
    ) -> tuple[nn.Module | None, nn.Module | None]:
        """Layer `index`'s (self_attn, mlp) when a subclass replaces Llama's (None: Llama's)."""
        return None, None

    def tie_lm_head(self) -> None:
        """Share the embedding matrix as the output projection (when this stage has both; a
        last stage without the embedding loads the embedding's checkpoint into its head)."""
        if self.lm_head is not None and self.model.embed_tokens is not None:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        context: ForwardContext,
        intermediate: IntermediateTensors | None = None,
    ) -> torch.Tensor | IntermediateTensors:
        """Hidden states [num_tokens, hidden] after the final norm (the last pipeline stage),
        or this stage's `IntermediateTensors` for the next one."""
        return self.model(input_ids, positions, context, intermediate)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Float32 logits [n, vocab_size] for the selected hidden states [n, hidden] (the full
        vocabulary on every tensor-parallel rank; the last pipeline stage only)."""
        assert self.lm_head is not None, "only the last pipeline stage computes logits"
        return self.lm_head.compute_logits(hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, CheckpointTensor]]) -> set[str]:
        """Copy this rank's part of each checkpoint tensor into the parameters (each owning
        module's `load_weight` reads only the rows or columns it keeps); returns the names of
        the parameters filled.

        Raises:
            ValueError: a tensor's shape does not match its parameter.
        """
        params = dict(self.named_parameters(remove_duplicate=False))
        stacked = self.stacked_params_mapping()
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and self.tie_word_embeddings:
                continue
            if (
                name == "model.embed_tokens.weight"
                and self.tie_word_embeddings
                and self.model.embed_tokens is None
                and self.lm_head is not None
            ):
                # A last pipeline stage without the embedding: its head is the tied table.
                self.lm_head.load_weight(self.lm_head.weight, tensor, name)
                loaded.add("lm_head.weight")
                continue
            for ckpt_part, fused_part, shard in stacked:
                if f".{ckpt_part}." not in name:
                    continue
                fused_name = name.replace(f".{ckpt_part}.", f".{fused_part}.")
                if fused_name not in params:
                    continue
                module = self.get_submodule(fused_name.rsplit(".", 1)[0])
                assert isinstance(module, ColumnParallelLinear), f"{fused_name} is not fused"
                module.load_weight(params[fused_name], tensor, name, shard)
                loaded.add(f"{fused_name}#{shard}")
                break
            else:
                if name not in params:
                    continue
                owner = self.get_submodule(name.rsplit(".", 1)[0])
                load_weight = getattr(owner, "load_weight", None)
                if load_weight is not None:
                    load_weight(params[name], tensor, name)
                else:  # norms: replicated, small
                    copy_checked(params[name].data, tensor.narrow(0, 0, tensor.shape[0]), name)
                loaded.add(name)
        return self._complete_names(loaded)

    def _complete_names(self, loaded: set[str]) -> set[str]:
        """Parameter names whose every shard was loaded (tied lm_head counts as loaded)."""
        complete = {name for name in loaded if "#" not in name}
        for name, module in self.named_modules():
            if isinstance(module, ColumnParallelLinear):
                for param_name, _ in module.named_parameters():
                    full = f"{name}.{param_name}"
                    shards = {f"{full}#{i}" for i in range(len(module.output_sizes))}
                    if shards <= loaded:
                        complete.add(full)
        if self.tie_word_embeddings and "model.embed_tokens.weight" in complete:
            complete.add("lm_head.weight")
        return complete
