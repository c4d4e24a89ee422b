"""Compression policies C(kv): which cache blocks a compressed read sees (a fixed budget)."""
from sparsedec.compress.base import CompressionPolicy
from sparsedec.compress.quest import Quest
from sparsedec.compress.retrieval import ChunkRetrieval
from sparsedec.compress.snapkv import SnapKV
from sparsedec.compress.streaming import StreamingLLM

POLICIES = {"streaming": StreamingLLM, "quest": Quest, "snapkv": SnapKV,
            "retrieval": ChunkRetrieval}

__all__ = ["ChunkRetrieval", "CompressionPolicy", "POLICIES", "Quest", "SnapKV", "StreamingLLM"]
