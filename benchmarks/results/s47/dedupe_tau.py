"""Session 47 (CPU, fp32), tried and not kept: FAFO with each fumble subsequence whose k tokens
equal an earlier subsequence's reseeded with random context tokens after every step (late in a
decode 11-20 of the 40 are such duplicates, `chain_duplicates.py`); `_setting.py` otherwise.
Writes /tmp/dedupe.json.
  PYTHONPATH=. python benchmarks/results/s47/dedupe_tau.py [NUM_PROMPTS]"""
import sys

import jax.numpy as jnp

import _setting
from sparsedec.decode.fafo import Fafo
from sparsedec.decode.guesses import context_tokens, row_salt


class DedupFafo(Fafo):
  def step(self, cfg, params, state, ctx):
    new = super().step(cfg, params, state, ctx)
    x = new.extras
    f = x.fumble                                                   # [B, n, k]
    n, k = f.shape[1:]
    same = jnp.all(f[:, :, None, :] == f[:, None, :, :], axis=-1)  # [B, n, n]
    earlier = jnp.tril(jnp.ones((n, n), bool), -1)                 # j' < j
    dup = jnp.any(same & earlier[None], axis=-1)                   # [B, n]
    fill = context_tokens(row_salt(new, 0x44555045), new.tokens, new.num_tokens, (n, k))
    dup = dup[:, :, None] & ~new.done[:, None, None]
    return new.replace(extras=x.replace(fumble=jnp.where(dup, fill, f),
                                        discarded=jnp.where(dup, fill, x.discarded)))


_setting.per_prompt_taus(_setting.fafo(DedupFafo), "/tmp/dedupe.json",
                         int(sys.argv[1]) if len(sys.argv) > 1 else 10)
