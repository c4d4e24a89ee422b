"""Model: config, params layout, rope, forward (import the forward from sparsedec.model.forward)."""
from sparsedec.model.config import ModelConfig, RopeScaling
from sparsedec.model.params import abstract_params, check_params, init_random, param_shapes

__all__ = ["ModelConfig", "RopeScaling", "abstract_params", "check_params", "init_random",
           "param_shapes"]
