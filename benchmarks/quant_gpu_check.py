"""quant_attention on the GPU (not interpret mode) against the fp32 dequantize-then-attend
reference, over a few shapes: D 64 / 128, Tq 1 / 3 / 16, 4 and 8 bits, ragged lengths, score
output, explicit stage sizes (block_kv 64 / 128 / 256). Records the max |error| of out, lse
and probs and any NaN, per case, to
$OUT/quant_gpu_check.json (the tests run the same kernel in interpret mode on the CPU; this is
the compiled kernel).

  python benchmarks/quant_gpu_check.py
"""
import json
import os
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from pallas_kernels.quant_attention import (QuantAttentionConfig, quant_attention,  # noqa: E402
                                            quant_attention_reference, quantize_kv)
from pallas_kernels.register_operand import (pack_words, word_offset,  # noqa: E402
                                             word_tile_kernel)
OUT_PATH = os.path.join(os.environ.get("OUT", "."), "quant_gpu_check.json")
HQ_GROUP = 128                        # key group G
rows = []


def save():
  with open(OUT_PATH, "w") as f:
    json.dump(rows, f, indent=1)


def case(seed, b, tq, hq, hkv, d, s, rf, bits, lq, lf, sq=(), cfg=QuantAttentionConfig()):
  ks = jax.random.split(jax.random.key(seed), 8)
  nrm = lambda k, shape: jax.random.normal(k, shape, jnp.float32)
  bf = lambda x: x.astype(jnp.bfloat16)
  k = nrm(ks[0], (b, hkv, s, d)) * jnp.exp(nrm(ks[7], (d,)))       # per-channel outliers
  v = nrm(ks[1], (b, hkv, s, d)) + nrm(ks[6], (s, 1))               # per-token offsets
  qkv = quantize_kv(bf(k), bf(v), group=HQ_GROUP)
  q = bf(nrm(ks[2], (b, tq, hq, d)))
  kf, vf = bf(nrm(ks[3], (b, hkv, rf, d))), bf(nrm(ks[4], (b, hkv, rf, d)))
  kn = bf(nrm(ks[5], (b, tq, hkv, d)))
  vn = kn[..., ::-1]
  mask = jnp.tril(jnp.ones((tq, tq), bool))
  lq, lf = jnp.array(lq, jnp.int32), jnp.array(lf, jnp.int32)
  got = quant_attention(q, qkv, lq, kf, vf, lf, kn, vn, mask, bits=bits, return_lse=True,
                        score_queries=sq, config=cfg)
  f32 = lambda x: x.astype(jnp.float32)
  ref = quant_attention_reference(f32(q), qkv, bits, lq, f32(kf), f32(vf), lf, f32(kn),
                                  f32(vn), mask, return_lse=True, score_queries=sq)
  row = dict(device=jax.devices()[0].device_kind, seed=seed, b=b, tq=tq, hq=hq, hkv=hkv, d=d,
             s=s, bits=bits, lengths_quantized=list(map(int, lq)), score_queries=list(sq))
  for name, x, y in zip(["out", "lse", "probs"], got, ref):
    x, y = np.asarray(f32(x)), np.asarray(y)
    fin = np.isfinite(y)
    row[name + "_max_abs_err"] = float(np.max(np.abs(np.where(fin, x, 0) - np.where(fin, y, 0))))
    row[name + "_nan"] = int(np.isnan(x).sum())
  print(row, flush=True)
  rows.append(row)
  save()


CASES = [  # seed, B, Tq, Hq, Hkv, D, S, Rf, bits, lengths_quantized, lengths_full[, scores]
    (1, 1, 1, 32, 8, 128, 4096, 256, 4, [4000], [100]),
    (1, 1, 1, 32, 8, 128, 4096, 256, 8, [4000], [100]),
    (2, 2, 16, 32, 8, 128, 2048, 256, 4, [2048, 77], [3, 256]),
    (3, 2, 16, 32, 8, 128, 2048, 256, 8, [1000, 2048], [0, 5]),
    (4, 1, 1, 8, 2, 64, 1024, 128, 4, [900], [50]),
    (5, 1, 1, 8, 2, 64, 1024, 128, 8, [900], [50]),
    (6, 1, 3, 32, 8, 128, 1024, 128, 8, [1000], [9], (2, 0)),
    (7, 1, 1, 32, 8, 128, 4096, 256, 4, [4000], [100], (0,)),
    # Explicit stage sizes (the defaults above pick 128 keys per stage up to N = 32 rows, else 64).
    (8, 2, 1, 32, 8, 128, 4096, 256, 8, [3000, 4096], [7, 0], (),
     QuantAttentionConfig(block_kv=64)),
    (9, 1, 5, 32, 8, 128, 4096, 256, 8, [4033], [20], (), QuantAttentionConfig(block_kv=128)),
    (10, 1, 3, 32, 8, 128, 4096, 256, 4, [1111], [20], (1,), QuantAttentionConfig(block_kv=256)),
]

def word_tile_case(planes, dtype, centered=False):
  """The compiled word_tile (inline Mosaic GPU) against its jnp definition, exactly."""
  codes = jax.random.randint(jax.random.key(planes), (planes, 64, 64), -8, 8)
  words = pack_words(codes).reshape(planes, 16, 32)
  got = np.asarray(word_tile_kernel(planes, dtype, centered=centered)(words))
  value = (codes[0] if planes == 1 else 16 * codes[0] + codes[1])
  want = np.asarray(value + (0 if centered else word_offset(dtype, planes)), np.float32)
  row = dict(device=jax.devices()[0].device_kind, word_tile_planes=planes, centered=centered,
             dtype=jnp.dtype(dtype).name, mismatches=int((got != want).sum()))
  print(row, flush=True)
  rows.append(row)
  save()


if __name__ == "__main__":
  for planes, centered in ((1, False), (2, False), (1, True)):
    for dtype in (jnp.bfloat16, jnp.float16):
      try:
        word_tile_case(planes, dtype, centered)
      except Exception as e:  # noqa: BLE001 - record and go on
        traceback.print_exc()
        rows.append(dict(word_tile_planes=planes, error=repr(e)[:800]))
        save()
  for args in CASES:
    try:
      case(*args)
    except Exception as e:  # noqa: BLE001 - record and go on
      traceback.print_exc()
      rows.append(dict(args=str(args), error=repr(e)[:800]))
      save()
