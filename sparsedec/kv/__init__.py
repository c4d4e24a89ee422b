"""KV cache pytrees."""
from sparsedec.kv.dense import KVCache, InflightKV, commit, init_cache

__all__ = ["KVCache", "InflightKV", "commit", "init_cache"]
