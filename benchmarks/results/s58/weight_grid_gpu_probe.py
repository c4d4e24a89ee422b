"""Session 58: the 4-bit weight quantizer's grids and codes, jitted on the GPU against the same
functions jitted on the host CPU (bit for bit), before (the formulas as they were, inline here) and
after the fix (the library's). Writes $OUT/weight_grid_gpu_probe_s58_h200.json."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from sparsedec.model import quant_weights as qw

META = jnp.float16


def old_to_meta(x, direction):
  r = x.astype(META)
  rf = r.astype(jnp.float32)
  toward = jnp.array(-jnp.inf if direction < 0 else jnp.inf, META)
  off = rf > x if direction < 0 else rf < x
  return jnp.where(off, jnp.nextafter(r, toward), r)


def old_group_grid(rows):
  zero = old_to_meta(rows.min(-2), -1)
  span = rows.max(-2) - zero.astype(jnp.float32)
  step = old_to_meta(span * jnp.float32(1 / 15), +1)
  lower = jnp.nextafter(step, jnp.zeros_like(step))
  step = jnp.where(lower.astype(jnp.float32) * 15 >= span, lower, step)
  return zero, jnp.where(step > 0, step, jnp.ones_like(step))


def old_codes(rows, zero, step):
  return jnp.clip(jnp.round((rows - zero.astype(jnp.float32)) / step.astype(jnp.float32)), 0, 15)


def quantize(grid, codes):
  def f(w):                                     # w [N, G, Out]
    z, s = grid(w)
    return z, s, codes(w, z[:, None], s[:, None])
  return f


cpu = jax.devices("cpu")[0]
gpu = jax.devices()[0]
rng = np.random.default_rng(0)
rows = []
for name, fn in [("old minmax", quantize(old_group_grid, old_codes)),
                 ("new minmax", quantize(qw.group_grid, qw.grid_codes)),
                 ("new absmax", quantize(qw.absmax_grid, qw.grid_codes))]:
  wrong = {"zero": 0, "step": 0, "codes": 0}
  total = {"zero": 0, "step": 0, "codes": 0}
  for t in range(8):
    w = (rng.normal(size=(64, 32, 256)) * rng.uniform(1e-3, 10)).astype(np.float32)
    on_gpu = jax.jit(fn)(jax.device_put(w, gpu))
    on_cpu = jax.jit(fn)(jax.device_put(w, cpu))
    for key, a, b in zip(("zero", "step", "codes"), on_gpu, on_cpu):
      a, b = np.asarray(a), np.asarray(b)
      wrong[key] += int((a.view(np.uint16 if a.dtype == np.float16 else np.uint32)
                         != b.view(np.uint16 if b.dtype == np.float16 else np.uint32)).sum())
      total[key] += a.size
  rows.append({"formulas": name, "differ_gpu_vs_cpu": wrong, "of": total})
  print(rows[-1], flush=True)
out = os.environ["OUT"]   # the device run's output folder (not the working tree)
with open(os.path.join(out, "weight_grid_gpu_probe_s58_h200.json"), "w") as f:
  json.dump({"device": str(gpu.device_kind), "rows": rows}, f, indent=1)
