"""A small reference quantizer for compressed-tensors `pack-quantized` checkpoints, written
from the format's description (symmetric int-N per group, offset to unsigned, N-bit values
packed low bits first into int32 words along the input dim), independent of the engine's
unpacking code. `write_ct_checkpoint` turns a tiny full-precision HF folder into a quantized
one, and a full-precision folder of the same weights dequantized for the transformers reference.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

LINEAR_SUFFIXES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def quantize_symmetric(w: torch.Tensor, bits: int, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 values in [-2^(bits-1), 2^(bits-1) - 1], fp16 scale [out, in / group])."""
    qmax = 2 ** (bits - 1) - 1
    grouped = w.to(torch.float32).reshape(w.shape[0], -1, group)
    scale = (grouped.abs().amax(dim=-1) / (qmax + 0.5)).clamp(min=1e-8).to(torch.float16)
    q = torch.round(grouped / scale.to(torch.float32).unsqueeze(-1))
    q = q.clamp(-qmax - 1, qmax).to(torch.int8).reshape(w.shape)
    return q, scale


def pack_int32(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Word j of a row holds columns [j*f, (j+1)*f), column j*f + i in bits [bits*i, bits*(i+1))."""
    factor = 32 // bits
    unsigned = (q.to(torch.int64) + (1 << (bits - 1))).reshape(q.shape[0], -1, factor)
    words = torch.zeros(unsigned.shape[:2], dtype=torch.int64)
    for i in range(factor):
        words |= unsigned[:, :, i] << (bits * i)
    # Reinterpret the unsigned 32-bit words as int32 (two's complement).
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def dequantize(q: torch.Tensor, scale: torch.Tensor, group: int) -> torch.Tensor:
    grouped = q.to(torch.float32).reshape(q.shape[0], -1, group)
    return (grouped * scale.to(torch.float32).unsqueeze(-1)).reshape(q.shape)


def write_ct_checkpoint(
    src: Path, out: Path, *, bits: int, group: int, ignore: tuple[str, ...] = ()
) -> Path:
    """Quantize src's linear weights into `out` (compressed-tensors) and write the dequantized
    full-precision equivalent to `out`-dequant; returns the dequantized folder."""
    tensors = load_file(str(src / "model.safetensors"))
    packed: dict[str, torch.Tensor] = {}
    dequant: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        module = name.removesuffix(".weight")
        quantize = name.endswith(".weight") and module.endswith(LINEAR_SUFFIXES)
        if not quantize or module in ignore:
            packed[name] = tensor
            dequant[name] = tensor
            continue
        q, scale = quantize_symmetric(tensor, bits, group)
        packed[f"{module}.weight_packed"] = pack_int32(q, bits)
        packed[f"{module}.weight_scale"] = scale
        packed[f"{module}.weight_shape"] = torch.tensor(list(tensor.shape), dtype=torch.int32)
        dequant[name] = dequantize(q, scale, group)
    dequant_dir = out.with_name(out.name + "-dequant")
    for folder, data in ((out, packed), (dequant_dir, dequant)):
        shutil.copytree(src, folder)
        save_file(data, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": bits, "type": "int", "symmetric": True,
                            "strategy": "group", "group_size": group, "dynamic": False},
                "input_activations": None,
                "output_activations": None,
            }
        },
        "ignore": ["lm_head", *ignore],
    }  # fmt: skip
    (out / "config.json").write_text(json.dumps(config))
    return dequant_dir
