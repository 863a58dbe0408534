"""LoRA adapters on a Hugging Face causal LM, built on PEFT, with verl's keys.

Each targeted layer computes ``y = W x + s · B A x`` with s = ``lora_alpha / lora_rank``: the base weight W
stays frozen and untouched; only A [r, in] and B [out, r] train. A is drawn from the seed and the layer's
name alone (uniform in ±1/√in, PEFT's default distribution), B starts at 0, so the adapter — and every
step after it — is the same whatever the process layout. The reference policy is the same model with
the adapter disabled (:func:`adapter_disabled`): no second copy of the model. The merged model
(W + s·B·A) is computed into a fresh state dict and written as a Hugging Face directory
(:func:`export_merged`); the live base weights are never merged into, so they stay bitwise as loaded
(:func:`base_digest` hashes them).

PEFT is the optional extra ``lora`` (``pip install 'splitproof[lora]'``).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import warnings
import zlib
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

from splitproof.hf_models import base_model_of
from splitproof.lora_settings import DEFAULT_ALPHA, LoraSettings  # noqa: F401 (the settings, torch-free)
from splitproof.loss_config import ConfigError

ADAPTER = "default"  # PEFT's adapter name; a run trains one adapter
DIGEST_KEY = "splitproof_base_digest"  # safetensors metadata of an adapter saved here
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"


def _peft():
    try:
        import peft
    except ImportError:
        raise ImportError("LoRA needs PEFT, the optional extra 'lora': pip install 'splitproof[lora]'") from None
    return peft


def _adaptable_types() -> tuple[type, ...]:
    from transformers.pytorch_utils import Conv1D

    return (nn.Linear, nn.Embedding, Conv1D)


def adaptable_modules(model: nn.Module) -> dict[str, nn.Module]:
    """Leaf modules PEFT's LoRA can adapt (Linear, Embedding, GPT-2's Conv1D), by full name."""
    types = _adaptable_types()
    return {name: m for name, m in model.named_modules() if name and isinstance(m, types)}


def _matches(name: str, key: str) -> bool:
    """PEFT's rule for a list entry: the module's full name is ``key`` or ends with ``.key``."""
    return name == key or name.endswith("." + key)


def check_targets(model: nn.Module, settings: LoraSettings) -> None:
    """Every ``target_modules`` / ``exclude_modules`` entry names a module of the model (a typo would
    silently adapt nothing); the error names the modules found."""
    found = adaptable_modules(model)
    short = sorted({n.rsplit(".", 1)[-1] for n in found})
    p = settings.prefix
    if not found:
        raise ConfigError(
            f"{p}lora_rank", f"the model ({type(model).__name__}) has no linear or embedding module for LoRA to adapt"
        )
    entries = (
        [] if isinstance(settings.target_modules, str) else [("target_modules", t) for t in settings.target_modules]
    )
    entries += [("exclude_modules", t) for t in settings.exclude_modules or ()]
    for key, entry in entries:
        if not any(_matches(n, entry) for n in found):
            raise ConfigError(
                f"{p}{key}",
                f"{entry!r} matches no module of the model ({type(model).__name__}); modules found: {', '.join(short)}",
            )


def check_before_loading(settings: LoraSettings, model_dir: str, *, trust_remote_code: bool = False) -> None:
    """Everything about the LoRA keys that needs no weights: PEFT installed, the targets against the
    model's modules (built from its config on the meta device, nothing allocated), a saved adapter's
    files, rank and alpha."""
    if not settings.enabled:
        return
    _peft()
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir, local_files_only=True, trust_remote_code=trust_remote_code)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    check_targets(skeleton, settings)
    if settings.lora_adapter_path:
        read_adapter_config(settings.lora_adapter_path, settings)


# --- applying an adapter -------------------------------------------------------------------------------------


def _lora_config(settings: LoraSettings):
    peft = _peft()
    targets = settings.target_modules if isinstance(settings.target_modules, str) else list(settings.target_modules)
    excluded = list(settings.exclude_modules) if settings.exclude_modules else None
    return peft.LoraConfig(
        r=settings.lora_rank,
        lora_alpha=settings.lora_alpha,
        target_modules=targets,
        exclude_modules=excluded,
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
    )


def lora_layers(model: nn.Module) -> dict[str, nn.Module]:
    """The LoRA layers of a model, by the name of the layer they adapt in the Hugging Face model."""
    from peft.tuners.lora import LoraLayer

    return {_hf_name(name): m for name, m in model.named_modules() if isinstance(m, LoraLayer)}


def _hf_name(name: str) -> str:
    """A PEFT-wrapped module or parameter name as the plain Hugging Face model names it."""
    for wrapper in ("module.", "base_model.model."):  # DDP, PeftModel
        while name.startswith(wrapper):
            name = name[len(wrapper) :]
    return name.replace(".base_layer.", ".").replace(".base_layer", "")


def _layer_seed(seed: int, name: str) -> int:
    return zlib.crc32(f"{seed}:{name}".encode())


@torch.no_grad()
def init_adapter(model: nn.Module, seed: int) -> None:
    """Draw every adapter from ``seed`` and its layer's name alone: A ~ U(±1/√in), B = 0 (an embedding:
    A = 0, B ~ N(0, 1), PEFT's convention). No global RNG is read or advanced."""
    for name, layer in sorted(lora_layers(model).items()):
        g = torch.Generator().manual_seed(_layer_seed(seed, name))
        if ADAPTER in layer.lora_A:
            a, b = layer.lora_A[ADAPTER].weight, layer.lora_B[ADAPTER].weight
            bound = 1.0 / math.sqrt(a.shape[1])
            a.copy_(torch.empty(a.shape, dtype=torch.float64, device="cpu").uniform_(-bound, bound, generator=g))
            b.zero_()
        else:
            a, b = layer.lora_embedding_A[ADAPTER], layer.lora_embedding_B[ADAPTER]
            a.zero_()
            b.copy_(torch.randn(b.shape, dtype=torch.float64, generator=g))


def apply_lora(model: nn.Module, settings: LoraSettings, *, seed: int = 0) -> nn.Module:
    """``model`` (a plain Hugging Face causal LM) with a LoRA adapter: PEFT's ``PeftModelForCausalLM``, base
    weights frozen, only the adapter trainable. A fresh adapter is drawn from ``seed``
    (:func:`init_adapter`); with ``lora_adapter_path`` the saved adapter is loaded with PEFT's loader
    after :func:`check_adapter`. Call before wrapping for DDP/FSDP2; the model's own weights are not copied."""
    if not settings.enabled:
        raise ConfigError(f"{settings.prefix}lora_rank", "is 0: LoRA is off")
    peft = _peft()
    check_targets(model, settings)
    if settings.lora_adapter_path:
        path = settings.lora_adapter_path
        check_adapter(path, model, settings)
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing", category=FutureWarning)
                return peft.PeftModel.from_pretrained(model, path, is_trainable=True, autocast_adapter_dtype=False)
        except (RuntimeError, ValueError, KeyError) as exc:
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise ConfigError(
                f"{settings.prefix}lora_adapter_path", f"{path}: PEFT cannot load it onto this model: {first}"
            ) from None
    with warnings.catch_warnings():  # PEFT calls a transformers method deprecated in v5: not the user's concern
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing", category=FutureWarning)
        peft_model = peft.get_peft_model(model, _lora_config(settings), autocast_adapter_dtype=False)
    init_adapter(peft_model, seed)
    return peft_model


def is_lora(model: nn.Module) -> bool:
    """Whether the model (possibly wrapped for DDP) holds LoRA layers."""
    try:
        from peft.tuners.lora import LoraLayer
    except ImportError:
        return False
    return any(isinstance(m, LoraLayer) for m in model.modules())


def trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters the optimizer gets: with LoRA, the adapter's alone."""
    return [p for p in model.parameters() if p.requires_grad]


@contextmanager
def adapter_disabled(model: nn.Module):
    """Run ``model`` as its base model (the reference policy): every LoRA layer computes ``W x`` alone.
    Nothing is copied or merged; each parameter's ``requires_grad`` is restored afterwards."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
    if not layers:
        raise ValueError("model: no LoRA adapter to disable")
    trainable = {p: p.requires_grad for p in model.parameters()}
    was_disabled = [m.disable_adapters for m in layers]
    try:
        for m in layers:
            m.enable_adapters(False)
        yield model
    finally:
        for m, disabled in zip(layers, was_disabled):
            m.enable_adapters(not disabled)
        for p, flag in trainable.items():
            p.requires_grad_(flag)


# --- base weights, merged export -----------------------------------------------------------------------------


def base_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The base model's tensors under their Hugging Face names (the adapter's left out): the live tensors,
    not copies. A plain model gives its own state dict."""
    out = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        if ".lora_" not in name:
            out[_hf_name(name)] = tensor.detach()
    return out


def digest_of(state: dict[str, torch.Tensor]) -> str:
    """sha256 of a state dict: every tensor's name, dtype, shape and bytes, by sorted name."""
    h = hashlib.sha256()
    for name in sorted(state):
        t = state[name]
        t = t.full_tensor() if hasattr(t, "full_tensor") else t
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def base_digest(model: nn.Module) -> str:
    """The digest of the base weights: equal for a model and the same model with an adapter."""
    return digest_of(base_state(model))


@torch.no_grad()
def merged_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The merged model's state dict under Hugging Face names: W + s·B·A for each adapted weight, a fresh
    tensor; every other tensor is the live one (read, never written)."""
    state = base_state(model)
    for name, layer in lora_layers(model).items():
        if layer.disable_adapters or ADAPTER not in layer.active_adapters:
            continue
        key = f"{name}.weight"
        state[key] = state[key] + layer.get_delta_weight(ADAPTER).to(state[key].dtype)
    return state


@torch.no_grad()
def export_merged(model: nn.Module, path: str | os.PathLike) -> Path:
    """Write the merged model (W + s·B·A) as a Hugging Face directory loadable by
    ``AutoModelForCausalLM.from_pretrained``; the live model is not modified."""
    from transformers import AutoModelForCausalLM

    inner = base_model_of(model)
    state = merged_state(model)
    with torch.device("meta"):
        fresh = AutoModelForCausalLM.from_config(inner.config, dtype=next(iter(state.values())).dtype)
    fresh.load_state_dict(state, strict=True, assign=True)
    path = Path(path)
    fresh.save_pretrained(path)
    if getattr(inner, "generation_config", None) is not None:
        inner.generation_config.save_pretrained(path)
    return path


# --- saving and checking adapters ----------------------------------------------------------------------------


def adapter_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapter's tensors as PEFT saves them (``base_model.model.<name>.lora_A.weight``, ...)."""
    peft = _peft()
    inner = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
    state = peft.get_peft_model_state_dict(inner, adapter_name=ADAPTER)
    return {
        k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().cpu().contiguous() for k, v in state.items()
    }


def save_adapter(model: nn.Module, path: str | os.PathLike) -> Path:
    """The adapter in PEFT's format (``adapter_model.safetensors`` + ``adapter_config.json``, loadable by
    ``PeftModel.from_pretrained``), with the base weights' digest in the safetensors metadata."""
    return write_adapter(path, model, adapter_state(model), base_digest(model))


def write_adapter(path: str | os.PathLike, model: nn.Module, tensors: dict[str, torch.Tensor], digest: str) -> Path:
    """Write ``tensors`` (:func:`adapter_state`) and the model's adapter config at ``path``: one process
    (the tensors and digest are gathered on every rank first under FSDP2)."""
    from safetensors.torch import save_file

    inner = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / ADAPTER_WEIGHTS), metadata={"format": "pt", DIGEST_KEY: digest})
    inner.peft_config[ADAPTER].save_pretrained(str(path))
    return path


def saved_digest(path: str | os.PathLike) -> str | None:
    """The base weights' digest a saved adapter carries (None: saved elsewhere)."""
    from safetensors import safe_open

    with safe_open(str(Path(path) / ADAPTER_WEIGHTS), framework="pt") as f:
        return (f.metadata() or {}).get(DIGEST_KEY)


def read_adapter_config(path: str | os.PathLike, settings: LoraSettings | None) -> dict:
    """The adapter directory's ``adapter_config.json``, checked against the LoRA keys when given (no model
    needed)."""
    key = f"{settings.prefix if settings else ''}lora_adapter_path"
    path = Path(path)
    for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
        if not (path / name).is_file():
            raise ConfigError(
                key, f"{path}: no {name} (a PEFT adapter directory holds {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS})"
            )
    try:
        config = json.loads((path / ADAPTER_CONFIG).read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(key, f"{path / ADAPTER_CONFIG}: cannot read it: {exc}") from None
    if config.get("peft_type", "LORA") != "LORA":
        raise ConfigError(key, f"{path}: a {config.get('peft_type')} adapter, not LoRA")
    if settings is None:
        return config
    p = settings.prefix
    if config.get("r") != settings.lora_rank:
        raise ConfigError(
            f"{p}lora_rank", f"is {settings.lora_rank} but the adapter at {path} has rank {config.get('r')}"
        )
    if float(config.get("lora_alpha", 8)) != float(settings.lora_alpha):
        raise ConfigError(
            f"{p}lora_alpha",
            f"is {settings.lora_alpha} but the adapter at {path} has lora_alpha {config.get('lora_alpha')}",
        )
    return config


def _same_model_name(a: str, b: str) -> bool:
    if os.path.exists(a) and os.path.exists(b):
        return os.path.realpath(a) == os.path.realpath(b)
    return a.rstrip("/") == b.rstrip("/")


def check_adapter(path: str | os.PathLike, model: nn.Module, settings: LoraSettings) -> None:
    """A saved adapter fits ``model``: rank and alpha as configured, and the same base model — the base
    weights' digest when the adapter was saved here, else the base model's name in its config."""
    config = read_adapter_config(path, settings)
    key = f"{settings.prefix}lora_adapter_path"
    saved = saved_digest(path)
    if saved is not None:
        ours = base_digest(model)
        if saved != ours:
            raise ConfigError(
                key,
                f"{path}: the adapter was trained on other base weights (digest {saved[:12]}, "
                f"this model's {ours[:12]})",
            )
        return
    theirs = config.get("base_model_name_or_path") or ""
    mine = getattr(getattr(model, "config", None), "_name_or_path", "") or ""
    if theirs and mine and not _same_model_name(theirs, mine):
        raise ConfigError(key, f"{path}: the adapter's base model is {theirs!r}, the model is {mine!r}")


def merge_adapter(
    adapter_path: str | os.PathLike,
    out: str | os.PathLike,
    *,
    model_path: str | os.PathLike | None = None,
    dtype: torch.dtype | None = None,
) -> Path:
    """Write the merged model of a saved adapter (PEFT's format) as a Hugging Face directory at ``out``.
    The base model is ``model_path``, else the adapter config's ``base_model_name_or_path`` (local only);
    the adapter must fit it (:func:`check_adapter`). Everything that can be checked without the model is
    checked first."""
    from splitproof.hf_models import load_causal_lm

    adapter_path = Path(adapter_path)
    config = read_adapter_config(adapter_path, None)
    base = model_path or config.get("base_model_name_or_path")
    if not base:
        raise ConfigError("model", f"the adapter at {adapter_path} names no base model: give it explicitly")
    if not os.path.isdir(base):
        raise ConfigError("model", f"{base}: not a local model directory")
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise ConfigError("out", f"{out} exists and is not empty")
    settings = LoraSettings(
        lora_rank=int(config["r"]), lora_alpha=float(config.get("lora_alpha", 8)), lora_adapter_path=str(adapter_path)
    )
    model = apply_lora(load_causal_lm(base, dtype=dtype), settings)
    return export_merged(model, out)
