"""jaxinfer: a JAX/XLA inference stack for large language models."""
from jaxinfer.config import ModelConfig, SamplingParams, get_model_config

__all__ = ["ModelConfig", "SamplingParams", "get_model_config", "LLM"]


def __getattr__(name):  # heavy imports only when asked for
  if name == "LLM":
    from jaxinfer.llm import LLM
    return LLM
  if name == "Engine":
    from jaxinfer.runtime.engine import Engine
    return Engine
  raise AttributeError(name)
