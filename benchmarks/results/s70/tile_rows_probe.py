"""Session 70: decode_attention / sparse_attention at Tq above 8 and not a multiple of 8, where the
in-flight tile now reads k_new / v_new zero-padded to a multiple of 8 (`hopper.tma_rows`; before,
Mosaic GPU's TMA lowering rejected the call). Device us a call from the profiler, "auto" (the
tile) against inflight="kernel" (the in-flight kernel merging the splits, what these Tq would
get without the tile), SmolLM2's heads (Hq 9, Hkv 3, D 64) and Llama-3.1-8B's (Hq 32, Hkv 8,
D 128), B 1, S 16K, and the largest output difference between the two.
Usage: python tile_rows_probe.py OUT.json"""
import json, sys
import jax, jax.numpy as jnp, numpy as np
sys.path.insert(0, ".")
from benchmarks._timing import time_loop, fresh_executables  # noqa: E402
from pallas_kernels.decode_attention import DecodeConfig, decode_attention  # noqa: E402
from pallas_kernels.sparse_attention import SparseConfig, sparse_attention  # noqa: E402

rows = []
for name, hq, hkv, d, tqs in (("smollm2", 9, 3, 64, (8, 9, 15, 16, 21)),
                              ("llama8b", 32, 8, 128, (8, 12, 16))):
  for s in (16384,):
    for tq in tqs:
      ks = jax.random.split(jax.random.key(tq), 5)
      q = jax.random.normal(ks[0], (1, tq, hq, d), jnp.bfloat16)
      kc = [jax.random.normal(ks[1 + i], (1, hkv, s, d), jnp.bfloat16) for i in range(2)]
      kn = jax.random.normal(ks[3], (1, tq, hkv, d), jnp.bfloat16)
      vn = jax.random.normal(ks[4], (1, tq, hkv, d), jnp.bfloat16)
      mask = jnp.tril(jnp.ones((tq, tq), bool))
      lengths = jnp.array([s - 100], jnp.int32)
      nb = max(1, s // 64 * 16 // 1000)                     # ~1.6% of the 64-slot blocks
      tables = jnp.broadcast_to(jnp.arange(nb, dtype=jnp.int32) * 7 % (s // 64), (1, hkv, nb))
      counts = jnp.full((1, hkv), nb, jnp.int32)
      for kernel in ("decode", "sparse"):
        outs = {}
        for mode in ("auto", "kernel"):
          fresh_executables()
          if kernel == "decode":
            f = lambda q, k, v, c=DecodeConfig(inflight=mode): decode_attention(q, k, v, lengths, kn, vn, mask, config=c)
          else:
            f = lambda q, k, v, c=SparseConfig(inflight=mode): sparse_attention(
                q, k, v, tables, counts, lengths, kn, vn, mask, block_size=64, config=c)
          try:
            outs[mode] = np.asarray(jax.jit(f)(q, kc[0], kc[0]), np.float32)
            t = time_loop(f, q, kc[0], kc[0], rotate=[(kc[1], kc[1])], num_calls=256, profile=True)
            us = t["device_s"] * 1e6
          except Exception as e:  # noqa: BLE001
            us = None; print("ERROR", name, s, tq, kernel, mode, str(e).splitlines()[0][:200])
          rows.append(dict(model=name, S=s, Tq=tq, kernel=kernel, mode=mode, device_us=us))
          print(name, s, tq, kernel, mode, us, flush=True)
        if len(outs) == 2:
          rows[-1]["max_abs_diff_vs_auto"] = float(np.max(np.abs(outs["auto"] - outs["kernel"])))
json.dump({"device": jax.devices()[0].device_kind, "rows": rows}, open(sys.argv[1], "w"), indent=1)
