"""The chapter's cost model: hardware profiles, byte/FLOP counts derived from the model
config, a roofline step-time model calibrated with measured MBU/MFU, and the formulas
of SPEC 8.2-8.6 as functions."""
from jaxinfer.costmodel.formulas import *  # noqa: F401,F403
from jaxinfer.costmodel.hardware import HardwareProfile, load_hardware
from jaxinfer.costmodel.roofline import Calibration, ModelCosts, RooflineStepModel, load_calibration

__all__ = ["HardwareProfile", "load_hardware", "Calibration", "ModelCosts", "RooflineStepModel",
           "load_calibration"]
