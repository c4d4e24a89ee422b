"""Decoding: state, sampling, the while_loop, and one module per method."""
from sparsedec.decode.api import GenerationResult, generate
from sparsedec.decode.sampling import SamplingConfig

__all__ = ["GenerationResult", "SamplingConfig", "generate"]
