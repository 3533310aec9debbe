"""Pure-functional Llama / Qwen3 decoder over a paged KV pool."""
from jaxinfer.model.params import (abstract_params, cast_params, init_params, stack_layers,
                                   unstack_layers, weight_specs)
from jaxinfer.model.transformer import forward

__all__ = ["abstract_params", "cast_params", "forward", "init_params", "stack_layers",
           "unstack_layers", "weight_specs"]
