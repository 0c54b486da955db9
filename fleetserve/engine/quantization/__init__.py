"""Quantized linear layers: config resolution (`config`, `resolve`; torch-free), the layers'
quant-method hook (`method`), online int8 (`int8`) and fp8 (`fp8`) methods, pre-quantized
compressed-tensors checkpoints (`ct_scheme`, `compressed_tensors`), and the per-layer assignment
(`apply`). Import the submodules: this package module imports nothing (the API server reads the
torch-free config without loading torch)."""
