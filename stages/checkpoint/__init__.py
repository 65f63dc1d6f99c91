"""Finding a checkpoint and loading its tensors strictly, straight onto the target device.

A checkpoint is a directory in the Hugging Face layout (config.json, generation_config.json,
model.safetensors, tokenizer files, speech_tokenizer/{config.json, model.safetensors, ...}) or a
model id resolved from the local Hugging Face cache.

The command line (`python -m stages.checkpoint random|check ...`) lives in `__main__.py`, outside the
import graph of the library.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

REQUIRED_FILES = ("config.json", "model.safetensors", "speech_tokenizer/config.json", "speech_tokenizer/model.safetensors")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used as it is; the message names the file or tensor."""


def resolve_checkpoint(path_or_id: str | os.PathLike, required: tuple[str, ...] = REQUIRED_FILES) -> Path:
    """A local directory, or a `Org/Name` model id found in the local Hugging Face cache, holding the `required`
    files (a TTS checkpoint's by default).

    When the id is not cached and the hub is reachable (HF_HUB_OFFLINE unset), it is downloaded.
    """
    path = Path(path_or_id).expanduser()
    if path.is_dir():
        _check_layout(path, required)
        return path
    model_id = str(path_or_id)
    if model_id.count("/") != 1 or model_id.startswith((".", "/", "~")):
        raise CheckpointError(f"checkpoint {model_id!r} is neither a directory nor a Hugging Face model id")
    from huggingface_hub import snapshot_download

    try:
        found = Path(snapshot_download(model_id, local_files_only=True))
    except Exception as cached_error:
        if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False"):
            raise CheckpointError(
                f"model id {model_id!r} is not in the local Hugging Face cache and HF_HUB_OFFLINE is set"
            ) from cached_error
        try:
            found = Path(snapshot_download(model_id))
        except Exception as download_error:
            raise CheckpointError(
                f"model id {model_id!r} is not in the local Hugging Face cache and could not be downloaded: "
                f"{download_error}"
            ) from download_error
    _check_layout(found, required)
    return found


def _check_layout(path: Path, required: tuple[str, ...] = REQUIRED_FILES) -> None:
    missing = [f for f in required if not (path / f).exists()]
    if missing:
        raise CheckpointError(f"checkpoint {path} is missing {', '.join(missing)}")


@contextmanager
def open_safetensors(path: Path, device: torch.device | str) -> Iterator[object]:
    try:
        with safe_open(str(path), framework="pt", device=str(device)) as f:
            yield f
    except CheckpointError:
        raise
    except Exception as e:  # a truncated or corrupted file
        raise CheckpointError(f"cannot read {path}: {e}") from e


def load_module_strict(
    module: nn.Module,
    file: Path,
    prefix: str,
    device: torch.device | str,
    dtype: torch.dtype,
    skip_prefixes: tuple[str, ...] = (),
) -> nn.Module:
    """Fill `module` (built on the meta device or anywhere) from tensors `prefix + name` of `file`.

    Strict: every tensor of the module must be in the file with the same shape, and every tensor in
    the file under `prefix` must be used (except `skip_prefixes`). Tensors are read one at a time onto
    `device`, so no full CPU copy of the model is made. Floating tensors are cast to `dtype`.
    """
    expected = {**dict(module.named_parameters()), **dict(module.named_buffers())}
    persistent = set(module.state_dict(keep_vars=True).keys())
    expected = {k: v for k, v in expected.items() if k in persistent}
    if any(t.is_meta for t in (*module.parameters(), *module.buffers())):
        module.to_empty(device=device)  # allocation only; every persistent tensor is overwritten below
    targets = {**dict(module.named_parameters()), **dict(module.named_buffers())}
    with open_safetensors(file, device) as f:
        available = {k[len(prefix):] for k in f.keys() if k.startswith(prefix)}
        missing = sorted(set(expected) - available)
        unexpected = sorted(k for k in available - set(expected) if not k.startswith(skip_prefixes))
        if missing:
            raise CheckpointError(
                f"{file}: missing tensor(s) {', '.join(prefix + k for k in missing[:8])}"
                + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
            )
        if unexpected:
            raise CheckpointError(
                f"{file}: unexpected tensor(s) {', '.join(prefix + k for k in unexpected[:8])}"
                + (f" and {len(unexpected) - 8} more" if len(unexpected) > 8 else "")
            )
        for name in expected:
            tensor = f.get_tensor(prefix + name)
            target = targets[name]
            if tuple(tensor.shape) != tuple(target.shape):
                raise CheckpointError(
                    f"{file}: tensor {prefix + name} has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}"
                )
            with torch.no_grad():
                if target.is_floating_point():
                    target.data = tensor.to(device=device, dtype=dtype)
                else:
                    target.data = tensor.to(device=device)
    for sub in module.modules():  # non-persistent buffers (RoPE tables) are recomputed, not loaded
        reset = getattr(sub, "reset_buffers", None)
        if callable(reset):
            reset()
    return module.eval().requires_grad_(False)


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    table = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16,
             "float32": torch.float32, "fp32": torch.float32}
    if name not in table:
        raise ValueError(f"unknown dtype {name!r}; expected one of {sorted(table)}")
    return table[name]
