"""N-gram guess sources for lossless n-gram decoding (Lookahead Decoding, FAFO)."""
from sparsedec.ngram.pool import NgramPool, PoolConfig, init_pool, insert, lookup

__all__ = ["NgramPool", "PoolConfig", "init_pool", "insert", "lookup"]
