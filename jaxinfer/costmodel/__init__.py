"""The chapter's cost model: hardware profiles, byte/FLOP counts derived from the model
config, a roofline step-time model calibrated with measured MBU/MFU, and the formulas
of chapter 8.2-8.6 as functions.

`formulas` and `hardware` are plain Python (the host runtime uses them); the roofline
model imports the KV formats (JAX), so it loads on first use.
"""
from jaxinfer.costmodel.formulas import *  # noqa: F401,F403
from jaxinfer.costmodel.hardware import HardwareProfile, load_hardware  # noqa: F401

_LAZY = ("Calibration", "ModelCosts", "RooflineStepModel", "load_calibration")


def __getattr__(name):
  if name in _LAZY:
    from jaxinfer.costmodel import roofline
    return getattr(roofline, name)
  raise AttributeError(name)
