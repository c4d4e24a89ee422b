"""Run a test script in a subprocess with several host (CPU) devices: the device count is an
XLA flag read when jax starts, so it cannot be changed inside the test process."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
STORIES = ROOT / "checkpoints" / "stories260K"


def run_script(script: str, count: int = 4) -> None:
  """Run `script` (Python; CHECKPOINT in it names the embedded stories260K checkpoint) on
  `count` host devices and assert it printed "ok" last. JAX_PLATFORMS=cpu: on a GPU machine
  the default backend is the GPU, with its own device count."""
  flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={count}"
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": flags.strip(),
         "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
  proc = subprocess.run([sys.executable, "-c", script.replace("CHECKPOINT", repr(str(STORIES)))],
                        env=env, capture_output=True, text=True, timeout=300, check=False)
  assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-2000:]
