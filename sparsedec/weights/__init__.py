"""Weights: HF safetensors and GGUF loaders, orbax checkpoints, conversion."""
from sparsedec.weights.checkpoint import convert, load_checkpoint, load_model, save_checkpoint

__all__ = ["convert", "load_checkpoint", "load_model", "save_checkpoint"]
