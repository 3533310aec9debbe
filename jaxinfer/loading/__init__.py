"""Weights (GGUF, HF safetensors, orbax checkpoints), tokenizer and model registry."""
from jaxinfer.loading.errors import ModelLoadError
from jaxinfer.loading.registry import LoadedModel, load_model, resolve_model

__all__ = ["LoadedModel", "ModelLoadError", "load_model", "resolve_model"]
