"""Session 47 (CPU, fp32): FAFO's pool with the fumble guesses never stored (prompt and output
n-grams only; the forward still runs the fumble subsequences), `_setting.py` otherwise. Writes
/tmp/seed_only.json.   PYTHONPATH=. python benchmarks/results/s47/seed_only_tau.py [NUM_PROMPTS]"""
import sys

import jax.numpy as jnp

import _setting
from sparsedec.decode.fafo import Fafo


class SeedOnly(Fafo):
  def _store(self, pool, discarded, discarded_len, *rest):
    # An empty discarded buffer has no suffix to key a guess by: no fumble guess is stored.
    return super()._store(pool, discarded, jnp.zeros_like(discarded_len), *rest)


_setting.per_prompt_taus(_setting.fafo(SeedOnly), "/tmp/seed_only.json",
                         int(sys.argv[1]) if len(sys.argv) > 1 else 10)
