"""`tracekit estimate`: predicted memory by category from a model shape and a training setup.

shapes (model shape, exact parameter count), presets (bundled configs),
memory (the formulas), deepspeed (DeepSpeed's own estimator), measured
(predicted beside a recording), whatif (fit growth with the batch, levers).
"""
from .memory import Estimate, Setup, estimate
from .presets import load_shape, preset_names
from .shapes import ModelShape, from_hf_config

__all__ = ["Estimate", "Setup", "estimate", "load_shape", "preset_names", "ModelShape", "from_hf_config"]
