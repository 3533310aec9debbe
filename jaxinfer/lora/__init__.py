"""Multi-LoRA (8.2.1): PEFT adapters (adapter.py, host), which adapter holds which device
slot (slots.py, host), and the grouped low-rank ops the model calls (ops.py, JAX).

This package's top level imports no JAX: the runtime uses `AdapterSlots`.
"""
from jaxinfer.lora.adapter import (AdapterError, LoraAdapter, TARGETS, adapter_bytes,  # noqa
                                   load_peft, save_peft, union_targets)
from jaxinfer.lora.slots import AdapterSlots  # noqa: F401
