"""sparsedec: faster LLM decoding in JAX by reading a compressed KV cache where that is safe."""

from sparsedec.decode.api import GenerationResult, generate
from sparsedec.decode.sampling import SamplingConfig
from sparsedec.errors import (CheckpointError, InputError, SparsedecError,
                              UnsupportedConfigError)
from sparsedec.model.config import ModelConfig

__all__ = ["CheckpointError", "GenerationResult", "InputError", "ModelConfig", "SamplingConfig",
           "SparsedecError", "UnsupportedConfigError", "generate"]
__version__ = "0.1.0"
