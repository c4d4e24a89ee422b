"""sparsedec checkpoints: convert once (HF dir or GGUF file), then load fast with orbax.

A checkpoint directory `checkpoints/NAME/` holds:

  params/                  the params pytree, saved with orbax
  sparsedec_config.json    ModelConfig.to_dict()
  tokenizer.json, tokenizer_config.json (chat_template inside), generation_config.json

It is written into a hidden temporary sibling directory and renamed into place at the end, so
an interrupted or failed save never leaves a directory that looks like a checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import uuid
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from etils import epath
from tqdm import tqdm

from sparsedec.errors import (CheckpointError, UnsupportedConfigError, read_json,
                             unwritable_reason)
from sparsedec.model.config import ModelConfig
from sparsedec.model.params import Params, abstract_params, cast_params, check_params
from sparsedec.tokenizer import GENERATION_CONFIG_FILE, Tokenizer
from sparsedec.weights.gguf_file import load_gguf
from sparsedec.weights.hf import CONFIG_FILE, load_hf

CONFIG_NAME = "sparsedec_config.json"
PARAMS_DIR = "params"
GGUF_MAGIC = b"GGUF"

# What tokenizer files save_checkpoint accepts: a Tokenizer, or {file name: text/bytes/dict}.
TokenizerFiles = Tokenizer | Mapping[str, Any] | None


def is_checkpoint(path: str | os.PathLike) -> bool:
  return os.path.isfile(os.path.join(path, CONFIG_NAME))


def _write_tokenizer_files(dir_: str, tokenizer_files: TokenizerFiles) -> None:
  if tokenizer_files is None:
    return
  if isinstance(tokenizer_files, Tokenizer):
    tokenizer_files.save(dir_)
    return
  for name, content in tokenizer_files.items():
    if os.path.basename(name) != name:
      raise CheckpointError(f"tokenizer file name {name!r} must be a plain file name")
    mode = "wb" if isinstance(content, bytes) else "w"
    with open(os.path.join(dir_, name), mode) as f:
      if isinstance(content, (dict, list)):
        json.dump(content, f, indent=2, ensure_ascii=False)
      else:
        f.write(content)


def check_output_dir(out_dir: str | os.PathLike, overwrite: bool) -> str:
  """The absolute path of a checkpoint directory to write: refused when something is there and
  overwrite is off, and, with overwrite, unless it is a sparsedec checkpoint or an empty
  directory (replacing is deleting: never another directory's files, nor a plain file)."""
  out_dir = os.path.abspath(os.fspath(out_dir))
  reason = unwritable_reason(out_dir)
  if reason:
    raise CheckpointError(f"cannot write the checkpoint {out_dir}: {reason}")
  if not os.path.lexists(out_dir):
    return out_dir
  if not overwrite:
    raise CheckpointError(f"{out_dir} already exists (pass overwrite=True, or --overwrite on the "
                          f"command line, to replace it)")
  if not os.path.isdir(out_dir) or os.path.islink(out_dir) or not (
      is_checkpoint(out_dir) or not os.listdir(out_dir)):
    raise CheckpointError(f"{out_dir} exists and is not a sparsedec checkpoint: overwrite only "
                          f"replaces a checkpoint directory (or an empty one), nothing else")
  return out_dir


def _temporary(parent: str, name: str, kind: str) -> str:
  """`.NAME.KIND-PID-HEX`: the saving process's id, so that another save can tell a live
  temporary (a concurrent save's) from a stale one."""
  return os.path.join(parent, f".{name}.{kind}-{os.getpid()}-{uuid.uuid4().hex[:8]}")


def _process_alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:        # alive, another user's
    return True
  return True


def _remove_stale_temporaries(parent: str, name: str) -> None:
  """`.NAME.tmp-*` / `.NAME.old-*` siblings an interrupted save left behind; those of a save
  still running on this machine (its process alive) are left alone."""
  for entry in os.listdir(parent):
    for prefix in (f".{name}.tmp-", f".{name}.old-"):
      if entry.startswith(prefix):
        pid_hex = entry[len(prefix):].split("-")
        if not (len(pid_hex) == 2 and pid_hex[0].isdigit() and _process_alive(int(pid_hex[0]))):
          shutil.rmtree(os.path.join(parent, entry), ignore_errors=True)


def save_checkpoint(out_dir: str | os.PathLike, cfg: ModelConfig, params: Params,
                    tokenizer_files: TokenizerFiles = None, overwrite: bool = False) -> str:
  """Write a checkpoint directory atomically; returns its absolute path.

  tokenizer_files: a Tokenizer, or {file name: str | bytes | json-able dict}. A
  generation_config.json with cfg's bos/eos ids is added when none is given.
  Refuses to replace an existing directory unless overwrite=True, and then replaces only a
  checkpoint directory or an empty one (`check_output_dir`).
  """
  out_dir = check_output_dir(out_dir, overwrite)
  check_params(cfg, params)
  parent, name = os.path.split(out_dir)
  os.makedirs(parent, exist_ok=True)
  _remove_stale_temporaries(parent, name)
  tmp = _temporary(parent, name, "tmp")
  os.makedirs(tmp)
  try:
    params = jax.tree.map(lambda x: jnp.asarray(x, cfg.dtype), params)
    # Synchronous: when save returns or raises (Ctrl-C included), no background write into tmp
    # is left running, so the cleanup below removes everything.
    with ocp.Checkpointer(ocp.StandardCheckpointHandler()) as ckptr:
      ckptr.save(os.path.join(tmp, PARAMS_DIR), args=ocp.args.StandardSave(params))
    _write_tokenizer_files(tmp, tokenizer_files)
    gen_file = os.path.join(tmp, GENERATION_CONFIG_FILE)
    if not os.path.exists(gen_file):
      gen = {"bos_token_id": cfg.bos_token_id, "eos_token_id": list(cfg.eos_token_ids)}
      with open(gen_file, "w") as f:
        json.dump({k: v for k, v in gen.items() if v not in (None, [])}, f, indent=2)
    # The config goes last: a directory without it is not a checkpoint.
    with open(os.path.join(tmp, CONFIG_NAME), "w") as f:
      json.dump(cfg.to_dict(), f, indent=2)
    if os.path.exists(out_dir):
      old = _temporary(parent, name, "old")
      os.rename(out_dir, old)
      try:
        os.rename(tmp, out_dir)
      except BaseException:
        os.rename(old, out_dir)            # the old checkpoint back where it was
        raise
      shutil.rmtree(old, ignore_errors=True)
    else:
      os.rename(tmp, out_dir)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise
  return out_dir


def load_config(path: str | os.PathLike) -> ModelConfig:
  config_file = os.path.join(path, CONFIG_NAME)
  if not os.path.isfile(config_file):
    raise CheckpointError(f"{path} is not a sparsedec checkpoint ({CONFIG_NAME} not found)")
  d = read_json(config_file)
  # A corrupt or hand-edited file (a field missing, of the wrong type, not an object) raised a
  # bare TypeError from the dataclass constructor that named neither the file nor the field.
  if not isinstance(d, Mapping):
    raise CheckpointError(f"{config_file} is not a JSON object (got a {type(d).__name__})")
  try:
    return ModelConfig.from_dict(d)
  except UnsupportedConfigError as e:
    raise UnsupportedConfigError(f"{config_file}: {e}") from e
  except (TypeError, ValueError) as e:
    raise CheckpointError(f"{config_file} is not a valid sparsedec config: {e}") from e


def _check_stored_shapes(path: str, cfg: ModelConfig) -> None:
  """Raise a CheckpointError when the arrays saved under `path/params` (their orbax metadata,
  no array is read) are not the ones `cfg` needs: params saved with another config, or an edited
  sparsedec_config.json. orbax's own refusal named neither the config nor the field, suggested
  orbax restore options (`strict=False`, `partial_restore=True`) and printed asyncio tracebacks.
  Metadata that cannot be read is left to the restore, whose error names the directory."""
  params_dir = os.path.join(path, PARAMS_DIR)
  handler = ocp.StandardCheckpointHandler()
  try:
    stored = handler.metadata(epath.Path(params_dir))
    stored = getattr(stored, "tree", stored)
  except Exception:                       # noqa: BLE001 (corrupt metadata: the restore names it)
    return
  finally:
    handler.close()
  try:
    check_params(cfg, stored)
  except CheckpointError as e:
    raise CheckpointError(f"checkpoint {path}: the params saved in {PARAMS_DIR}/ do not fit its "
                          f"{CONFIG_NAME}: {e} (saved with another config, or the config was "
                          f"edited?)") from None


def default_device() -> jax.Device:
  """The device jax puts new arrays on: the one `jax.default_device(...)` names (a device or a
  platform name) where a caller set one, else the default backend's first device."""
  device = jax.config.jax_default_device
  if device is None:
    return jax.devices()[0]
  return jax.devices(device)[0] if isinstance(device, str) else device


def load_checkpoint(path: str | os.PathLike, dtype: str | None = None
                    ) -> tuple[ModelConfig, Params]:
  """Restore (cfg, params as jax arrays) from a checkpoint directory; dtype casts on restore.
  The params are committed to the default device (`jax.default_device(...)` where a caller
  sets one, as a GGUF or HF load's arrays are made there; `jax.device_put` them elsewhere)."""
  path = os.path.abspath(os.fspath(path))
  if not os.path.isdir(path):
    raise CheckpointError(f"checkpoint directory not found: {path}")
  cfg = load_config(path)
  params_dir = os.path.join(path, PARAMS_DIR)
  if not os.path.isdir(params_dir):
    raise CheckpointError(f"checkpoint {path} has no {PARAMS_DIR}/ directory")
  _check_stored_shapes(path, cfg)
  stored = abstract_params(cfg)
  sharding = jax.sharding.SingleDeviceSharding(default_device())
  target = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding),
                        stored)
  try:
    with ocp.StandardCheckpointer() as ckptr:
      params = ckptr.restore(params_dir, target)
  except Exception as e:                  # orbax / tensorstore raise plain Exceptions too
    raise CheckpointError(f"cannot restore params from {params_dir}: {e}") from e
  params = {**params, "layers": list(params["layers"])}
  check_params(cfg, params)
  if dtype is not None and dtype != cfg.dtype:
    cfg = cfg.replace(dtype=dtype)
    params = cast_params(params, dtype)
  return cfg, params


# ------------------------------------------------------------------------------- conversion
def source_kind(src: str | os.PathLike) -> str:
  """"checkpoint", "hf" or "gguf"; CheckpointError when `src` is none of them."""
  src = os.fspath(src)
  if os.path.isdir(src):
    if is_checkpoint(src):
      return "checkpoint"
    if os.path.isfile(os.path.join(src, CONFIG_FILE)):
      return "hf"
    raise CheckpointError(f"{src} is neither a sparsedec checkpoint ({CONFIG_NAME}) nor an HF "
                          f"checkpoint directory ({CONFIG_FILE})")
  if os.path.isfile(src):
    with open(src, "rb") as f:
      if f.read(4) == GGUF_MAGIC:
        return "gguf"
    raise CheckpointError(f"{src} is not a GGUF file (no GGUF magic bytes)")
  raise CheckpointError(f"model path not found: {src}")


def _tqdm_progress(desc: str) -> tuple[Callable[[str, int], None], Callable[[], None]]:
  bar = tqdm(desc=desc, unit="tensor", file=sys.stderr, leave=False)

  def step(name: str, total: int) -> None:
    if bar.total != total:
      bar.total = total
    bar.set_postfix_str(name, refresh=False)
    bar.update(1)

  return step, bar.close


def _load_source(src: str, kind: str, dtype: str | None, progress=None
                 ) -> tuple[ModelConfig, Params, Tokenizer | None]:
  if kind == "gguf":
    return load_gguf(src, dtype, progress)
  # The tokenizer first: a broken tokenizer.json is named before the (long) weight load.
  has_tokenizer = os.path.isfile(os.path.join(src, "tokenizer.json"))
  tokenizer = Tokenizer.from_dir(src) if has_tokenizer else None
  cfg, params = load_hf(src, dtype, progress)
  return cfg, params, tokenizer


def convert(src: str | os.PathLike, out: str | os.PathLike, dtype: str | None = None,
            overwrite: bool = False, show_progress: bool = True) -> str:
  """Convert an HF checkpoint directory or a .gguf file into a checkpoint directory `out`."""
  src = os.fspath(src)
  kind = source_kind(src)
  if kind == "checkpoint":
    raise CheckpointError(f"{src} is already a sparsedec checkpoint")
  # Before the (long) load: where it would write, and whether the result could be loaded.
  out = check_output_dir(out, overwrite)
  src_abs = os.path.abspath(src)
  if os.path.commonpath([src_abs, out]) == out:
    raise CheckpointError(f"the output {out} would hold the source {src_abs}: write elsewhere")
  if kind == "hf" and not os.path.isfile(os.path.join(src, "tokenizer.json")):
    raise CheckpointError(f"{src} has no tokenizer.json: sparsedec reads tokenizers only from "
                          f"tokenizer.json (or a GGUF file), so the checkpoint could not be loaded")
  step, close = _tqdm_progress(f"converting {os.path.basename(src)}") if show_progress else (
      None, lambda: None)
  try:
    cfg, params, tokenizer = _load_source(src, kind, dtype, step)
  finally:
    close()
  # From an HF directory the tokenizer files are copied byte for byte.
  files: TokenizerFiles = _hf_tokenizer_files(src) if kind == "hf" else tokenizer
  return save_checkpoint(out, cfg, params, files, overwrite=overwrite)


HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                      GENERATION_CONFIG_FILE)


def _hf_tokenizer_files(src: str) -> dict[str, bytes]:
  files = {}
  for name in HF_TOKENIZER_FILES:
    file = os.path.join(src, name)
    if os.path.isfile(file):
      with open(file, "rb") as f:
        files[name] = f.read()
  return files


def load_model(path: str | os.PathLike, dtype: str | None = None
               ) -> tuple[ModelConfig, Params, Tokenizer]:
  """(cfg, params as jax arrays, Tokenizer) from a checkpoint dir, an HF dir or a .gguf file."""
  path = os.fspath(path)
  kind = source_kind(path)
  # The tokenizer is read (or found missing) before the weights, whose load is the long part.
  if kind == "checkpoint":
    tokenizer = Tokenizer.from_dir(path)
    cfg, params = load_checkpoint(path, dtype)
    return cfg, params, tokenizer
  if kind == "hf" and not os.path.isfile(os.path.join(path, "tokenizer.json")):
    raise CheckpointError(f"no tokenizer.json in {path}")
  cfg, params, tokenizer = _load_source(path, kind, dtype)
  return cfg, jax.tree.map(jnp.asarray, params), tokenizer
