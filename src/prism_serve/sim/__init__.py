"""The discrete-event cluster simulator: simulated engines and memory driven by the control/ policies.

See README.md in this directory for the event loop, the cost model and what is synthetic.
"""

from prism_serve.sim.cost import COST_MODELS, RooflineCostModel
from prism_serve.sim.errors import SimConfigError, SimError, SimStateError
from prism_serve.sim.hardware import HARDWARE, HardwareProfile, get_hardware
from prism_serve.sim.metrics import SimResult, attainment
from prism_serve.sim.models import MODEL_SHAPES, ModelShape, ServedModel, model_shape
from prism_serve.sim.simulator import ModelSLO, SimConfig, Simulator, simulate

__all__ = [
    "COST_MODELS",
    "HARDWARE",
    "MODEL_SHAPES",
    "HardwareProfile",
    "ModelSLO",
    "ModelShape",
    "RooflineCostModel",
    "ServedModel",
    "SimConfig",
    "SimConfigError",
    "SimError",
    "SimResult",
    "SimStateError",
    "Simulator",
    "attainment",
    "get_hardware",
    "model_shape",
    "simulate",
]
