"""Session 47 (CPU, fp32): FAFO's fumble subsequences at other positions: token i of subsequence j
at p + offset, offset 1 + i (aligned), 1 + j + i (the diagonal, fafo_layout's), 1 + j // 2 + i
(half), 1 + 2 j + i (double); `_setting.py` otherwise. Writes /tmp/fumble_positions_MODE.json.
  PYTHONPATH=. python benchmarks/results/s47/fumble_positions_tau.py aligned [NUM_PROMPTS]"""
import sys

import _setting

mode = sys.argv[1]
_setting.patch_fumble_offsets(mode)
_setting.per_prompt_taus(_setting.fafo(), f"/tmp/fumble_positions_{mode}.json",
                         int(sys.argv[2]) if len(sys.argv) > 2 else 10)
