"""A tiny Mixtral whose router sends every token to experts 0 and 2 (a forced skew).

transformers' Mixtral router has no bias, so the skew rides the residual stream: hidden
coordinate 0 is a large constant in every token's embedding that only the router rows of experts
0 and 2 read. The LM head ignores it too, so the greedy tokens still depend on the rest of the
computation (the experts' weights included).
With 4 experts + 2 redundant slots on 2 EP ranks the load-time placement is [0, 1, 2 | 3, 0, 1]:
rank 0 serves all of expert 2 and half of expert 0, a balancedness of 0.5 / 0.75 ≈ 0.67.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tests.engine.tiny_models import make_tiny_moe_model

HOT_EXPERTS = (0, 2)
CARRIER = 8.0


def make_skewed_mixtral(root: Path) -> Path:
    from transformers import AutoModelForCausalLM

    path = make_tiny_moe_model(root, "mixtral", seed=5)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        # Coordinate 0 of the residual stream: a constant nothing but two router rows reads
        # (attention and the experts neither read nor write it), so it stays CARRIER in every
        # layer and dominates the normalised hidden state the router sees.
        model.model.embed_tokens.weight[:, 0] = CARRIER
        model.lm_head.weight[:, 0] = 0.0
        for layer in model.model.layers:
            attn = layer.self_attn
            for proj in (attn.q_proj, attn.k_proj, attn.v_proj):
                proj.weight[:, 0] = 0.0
            attn.o_proj.weight[0, :] = 0.0
            moe = layer.mlp
            moe.experts.gate_up_proj[:, :, 0] = 0.0
            moe.experts.down_proj[:, 0, :] = 0.0
            moe.gate.weight[:, 0] = 0.0
            for expert in HOT_EXPERTS:
                moe.gate.weight[expert, 0] = 3.0
    model.save_pretrained(path)
    return path
