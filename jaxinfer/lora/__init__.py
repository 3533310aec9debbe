"""Multi-LoRA (8.2.1): PEFT adapters (adapter.py, host) and the grouped low-rank ops the
model calls (ops.py, JAX). Which adapter holds which device slot is the runtime's own
table (runtime/adapter_slots.py): the runtime sees adapter ids and slot counts only.

This package's top level imports no JAX.
"""
from jaxinfer.lora.adapter import (AdapterError, LoraAdapter, TARGETS, adapter_bytes,  # noqa
                                   load_peft, save_peft, union_targets)
