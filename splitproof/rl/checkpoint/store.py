"""Checkpoints of a `splitproof train` run: layout-free, atomic, safe to load.

Under ``trainer.default_local_dir``::

    latest_checkpointed_iteration.txt   the newest complete checkpoint's step (verl's name)
    global_step_N/
        actor/              a Hugging Face model directory (config, model.safetensors, tokenizer); with LoRA,
                            PEFT's adapter directory (adapter_config.json, adapter_model.safetensors, tokenizer)
        actor_state/        model and optimizer tensors, torch.distributed.checkpoint (sharded under FSDP2);
                            the trainable ones only (LoRA: the adapter and its optimizer state)
        critic/, critic_state/  the same for the critic (value model), when the run has one
        trainer_state.pt    step, the loop's trainer_state, LR schedules, optimizer hyper-parameters, RNGs
        config.yaml         the resolved config (resuming compares its result-affecting keys)
        complete            written last: the directory is whole

No data-parallel layout is stored: DCP keeps tensors by parameter name and global shape, so a
checkpoint written by any number of DDP/FSDP2 ranks loads on any other number, and on one process.
A save writes into ``.tmp-global_step_N``, fsyncs, renames it into place, then replaces the tracker
file atomically; a crash at any point leaves the previous checkpoint the newest, and the leftovers are
removed by the next save. Loading never unpickles code: ``trainer_state.pt`` through
``torch.load(weights_only=True)``, DCP's metadata through an allow-list, tensors only in DCP's data.
"""

from __future__ import annotations

import copy
import io
import os
import pickle
import random
import shutil
import warnings
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)

from ...hf_models import unwrap
from ...lora import adapter_state, base_digest, is_lora, write_adapter
from .resume import (
    COMPLETE,
    TRACKER,
    Resumed,
    checkpoint_dir,
    complete_steps,
    is_complete,
)

FORMAT = 1

# model tensors a checkpoint holds: the trainable ones (all of them, but LoRA's frozen base)
_TRAINABLE = StateDictOptions(ignore_frozen_params=True)


def _no_progress(stage: str) -> None:
    """The default progress hook: nothing."""


# test hook: called with a stage name after each piece of a save
_progress_hook: Callable[[str], None] = _no_progress


@dataclass(frozen=True)
class Trainable:
    """A model with its optimizer and LR schedule: what a checkpoint saves of the critic."""

    model: Any
    optimizer: Any
    lr_scheduler: Any = None


# ----------------------------------------------------------------------------------------------- helpers


def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


@contextmanager
def _single_process_quiet():
    """DCP warns that it assumes one process when torch.distributed is not initialised: that is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def _barrier() -> None:
    if _rank_world()[1] > 1:
        dist.barrier()


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    for folder, _, files in os.walk(root):
        for name in files:
            _fsync_file(Path(folder) / name)
        _fsync_dir(Path(folder))


def _write_atomic(path: Path, data: bytes) -> None:
    """Write a file so that readers see the old or the new content, never a part."""
    tmp = path.with_name(f".tmp-{path.name}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _discard(path: Path) -> None:
    """Remove a directory: renamed away first, so that no half-deleted checkpoint is ever visible."""
    trash = path.with_name(f".trash-{path.name}")
    if trash.exists():
        shutil.rmtree(trash)
    os.rename(path, trash)
    shutil.rmtree(trash)


def _remove_leftovers(root: Path) -> None:
    for entry in root.iterdir():
        if entry.name.startswith((".tmp-", ".trash-")):
            shutil.rmtree(entry) if entry.is_dir() else entry.unlink()


# ----------------------------------------------------------------------------------------------- state


def rng_state() -> dict:
    np_state = np.random.get_state()
    version, words, gauss = random.getstate()
    state = {
        "python": [version, list(words), gauss],
        "numpy": {
            "keys": torch.from_numpy(np_state[1].astype(np.int64)),
            "pos": int(np_state[2]),
            "has_gauss": int(np_state[3]),
            "cached_gaussian": float(np_state[4]),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    version, words, gauss = state["python"]
    random.setstate((version, tuple(words), gauss))
    nps = state["numpy"]
    np.random.set_state(
        ("MT19937", nps["keys"].numpy().astype(np.uint32), nps["pos"], nps["has_gauss"], nps["cached_gaussian"])
    )
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _weights_only_bytes(payload: dict, what: str) -> bytes:
    """``torch.save`` bytes that ``torch.load(weights_only=True)`` reads back; a clear error otherwise."""
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    data = buffer.getvalue()
    try:
        torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as e:
        raise TypeError(
            f"{what} must hold only tensors, numbers, strings, None, lists, tuples and dicts "
            f"(it is loaded with torch.load(weights_only=True)): {str(e).splitlines()[0]}"
        ) from None
    return data


def _split_optimizer(osd: dict) -> tuple[dict, dict]:
    """(tensor state for DCP, everything else): DCP then stores tensors only, never pickled objects."""
    tensors, scalars = {}, {}
    for fqn, entries in osd["state"].items():
        tensors[fqn] = {k: v for k, v in entries.items() if isinstance(v, torch.Tensor)}
        scalars[fqn] = {k: v for k, v in entries.items() if not isinstance(v, torch.Tensor)}
    return tensors, {"param_groups": osd["param_groups"], "scalars": scalars}


def _architecture(model) -> str:
    """The model's own class name (FSDP2 puts a generated ``FSDP<name>`` class in front of it)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - older torch
        FSDPModule = ()
    for cls in type(model).__mro__:
        if not (FSDPModule and issubclass(cls, FSDPModule)):
            return cls.__name__
    return type(model).__name__


def _write_hf_dir(path: Path, model, state_dict: dict, tokenizer) -> None:
    from safetensors.torch import save_file

    path.mkdir()
    config = copy.deepcopy(model.config)
    config.architectures = [_architecture(model)]
    config.save_pretrained(path)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(path)
    seen, tensors = set(), {}
    for name, tensor in state_dict.items():
        tensor = tensor.detach().cpu().contiguous()
        if tensor.untyped_storage().data_ptr() in seen:  # tied weights: safetensors wants separate storage
            tensor = tensor.clone()
        seen.add(tensor.untyped_storage().data_ptr())
        tensors[name] = tensor
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    if tokenizer is not None:
        tokenizer.save_pretrained(path)


def _gather_to_rank0(obj) -> list:
    rank, world = _rank_world()
    if world == 1:
        return [obj]
    out = [None] * world if rank == 0 else None
    dist.gather_object(obj, out, dst=0)
    return out


# ----------------------------------------------------------------------------------------------- save


def save_checkpoint(
    root: str | os.PathLike,
    step: int,
    *,
    model,
    optimizer,
    trainer_state: dict,
    lr_scheduler=None,
    config_yaml: str = "",
    tokenizer=None,
    max_to_keep: int | None = None,
    critic: Trainable | None = None,
) -> Path:
    """Write ``global_step_{step}`` atomically and point the tracker at it; every rank calls it.

    ``trainer_state`` is the loop's own (data cursor, KL controller, ...): tensors, numbers, strings,
    lists and dicts only. ``max_to_keep`` (``trainer.max_actor_ckpt_to_keep``) prunes older checkpoints.
    ``critic`` adds ``critic/`` and ``critic_state/`` beside the actor's.
    """
    rank, world = _rank_world()
    root = Path(root)
    final, tmp = checkpoint_dir(root, step), root / f".tmp-global_step_{step}"
    parts = {"actor": Trainable(model, optimizer, lr_scheduler), **({"critic": critic} if critic else {})}
    states = {name: get_state_dict(part.model, part.optimizer, options=_TRAINABLE) for name, part in parts.items()}
    split = {name: _split_optimizer(osd) for name, (_, osd) in states.items()}
    payload = {"format": FORMAT, "step": step, "trainer_state": trainer_state, "world_size": world}
    for name, part in parts.items():
        prefix = "" if name == "actor" else f"{name}_"
        payload[f"{prefix}optimizer"] = split[name][1]
        payload[f"{prefix}lr_scheduler"] = part.lr_scheduler.state_dict() if part.lr_scheduler is not None else None
    _weights_only_bytes(payload, "trainer_state")  # on every rank, before any file or collective
    rngs = _gather_to_rank0(rng_state())
    if rank == 0:
        state_bytes = _weights_only_bytes({**payload, "rng": rngs}, "trainer_state")
        root.mkdir(parents=True, exist_ok=True)
        _remove_leftovers(root)
        tmp.mkdir()
    _barrier()
    for name, part in parts.items():
        with _single_process_quiet():
            dcp.save(
                {"model": states[name][0], "optimizer": split[name][0]},
                storage_writer=FileSystemWriter(tmp / f"{name}_state", sync_files=True),
                no_dist=world == 1,
            )
        _progress_hook(f"{name}_state")
        if is_lora(part.model):  # PEFT's adapter directory: the base weights are the model path's, unchanged
            tensors, digest = adapter_state(part.model), base_digest(part.model)  # collective under FSDP2
            if rank == 0:
                write_adapter(tmp / name, unwrap(part.model), tensors, digest)
                if tokenizer is not None:
                    tokenizer.save_pretrained(tmp / name)
                _progress_hook(name)
            continue
        full = get_model_state_dict(part.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if rank == 0:
            _write_hf_dir(tmp / name, unwrap(part.model), full, tokenizer)
            _progress_hook(name)
    if rank == 0:
        (tmp / "trainer_state.pt").write_bytes(state_bytes)
        _progress_hook("trainer_state")
        (tmp / "config.yaml").write_text(config_yaml)
        _fsync_tree(tmp)
        _write_atomic(tmp / COMPLETE, f"{step}\n".encode())
        _progress_hook("complete")
        if final.exists():
            _discard(final)
        os.rename(tmp, final)
        _fsync_dir(root)
        _progress_hook("renamed")
        _write_atomic(root / TRACKER, f"{step}\n".encode())
        _progress_hook("tracker")
        if max_to_keep is not None:
            older = [s for s in complete_steps(root) if s < step]
            for old in older[: max(0, len(older) - (max_to_keep - 1))]:
                _discard(checkpoint_dir(root, old))
    _barrier()
    return final


# ----------------------------------------------------------------------------------------------- load

_DCP_METADATA_MODULES = ("torch.distributed.checkpoint.metadata",)
_SAFE_GLOBALS = {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("collections", "OrderedDict"),
    ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
}


class _MetadataUnpickler(pickle.Unpickler):
    """DCP's metadata file, unpickled with an allow-list of the classes that describe tensors."""

    def find_class(self, module: str, name: str):
        allowed = (
            module in _DCP_METADATA_MODULES
            or (module, name) in _SAFE_GLOBALS
            or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype))
        )
        if not allowed:
            raise pickle.UnpicklingError(
                f"checkpoint metadata refers to {module}.{name}: refused (not a tensor description)"
            )
        return super().find_class(module, name)


class _SafeReader(FileSystemReader):
    """A DCP reader whose metadata is read through ``_MetadataUnpickler``."""

    def read_metadata(self, *args: Any, **kwargs: Any):
        rank = kwargs.get("rank")
        with self.fs.create_stream(self._get_metadata_path(rank), "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        from torch.distributed.checkpoint.metadata import StorageMeta

        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def load_checkpoint(
    path: str | os.PathLike, *, model, optimizer, lr_scheduler=None, critic: Trainable | None = None
) -> Resumed:
    """Restore model, optimizer, LR schedule and RNGs from ``global_step_N`` (and the critic's, when given);
    every rank calls it. The models and optimizers may be wrapped for any strategy and DP size (none, DDP,
    FSDP2).
    """
    path = Path(path)
    if not is_complete(path):
        raise FileNotFoundError(f"{path} is not a complete checkpoint")
    rank, world = _rank_world()
    payload = torch.load(path / "trainer_state.pt", map_location="cpu", weights_only=True)
    if payload.get("format") != FORMAT:
        raise ValueError(f"{path}: checkpoint format {payload.get('format')!r}, expected {FORMAT}")
    parts = {"actor": Trainable(model, optimizer, lr_scheduler), **({"critic": critic} if critic else {})}
    for name, part in parts.items():
        prefix = "" if name == "actor" else f"{name}_"
        if not (path / f"{name}_state").is_dir():
            raise ValueError(f"{path}: the checkpoint holds no {name} (it was written by a run without one)")
        _load_part(path / f"{name}_state", part, payload[f"{prefix}optimizer"], world)
        if part.lr_scheduler is not None:
            if payload[f"{prefix}lr_scheduler"] is None:
                raise ValueError(f"{path}: the checkpoint holds no LR schedule state of the {name}")
            part.lr_scheduler.load_state_dict(payload[f"{prefix}lr_scheduler"])
    rngs = payload["rng"]
    set_rng_state(rngs[rank] if len(rngs) == world else rngs[0])
    return Resumed(
        path=path,
        step=int(payload["step"]),
        trainer_state=payload["trainer_state"],
        config_yaml=(path / "config.yaml").read_text(),
    )


def _load_part(folder: Path, part: Trainable, saved: dict, world: int) -> None:
    """A model and its optimizer from their DCP folder (``saved``: the optimizer's non-tensor state)."""
    msd, osd = get_state_dict(
        part.model, part.optimizer, options=_TRAINABLE
    )  # a fresh optimizer's state is initialised here
    optimizer_tensors, _ = _split_optimizer(osd)
    state = {"model": msd, "optimizer": optimizer_tensors}
    reader = _SafeReader(folder)
    reader.read_metadata()  # refuses unexpected pickled classes before DCP reads anything
    with _single_process_quiet():
        dcp.load(state, storage_reader=reader, no_dist=world == 1)
    merged = {fqn: {**state["optimizer"].get(fqn, {}), **saved["scalars"].get(fqn, {})} for fqn in saved["scalars"]}
    frozen = any(not p.requires_grad for p in part.model.parameters())  # LoRA's base: not in the checkpoint
    set_state_dict(
        part.model,
        part.optimizer,
        model_state_dict=state["model"],
        optim_state_dict={"state": merged, "param_groups": saved["param_groups"]},
        options=StateDictOptions(ignore_frozen_params=True, strict=not frozen),
    )
