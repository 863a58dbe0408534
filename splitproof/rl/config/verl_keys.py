"""verl keys that are not in splitproof's schema: which are accepted, which are errors.

A key a user sets is classified as follows (``classify``):

- ``ours``: a key of ``config.TrainConfig`` (or inside one of its mapping-valued keys);
- ``no_effect``: a verl key matching a pattern of ``NO_EFFECT`` — pure infrastructure (GPU memory,
  tensor/sequence parallelism, offload, compilation, node counts, Ray, profilers, ...). splitproof's
  results never depend on how work is laid out, so these are accepted and ignored, with a notice;
- ``off``: a verl key whose value means "off" (null, false, 0, empty), or equals ``SAME_AS_OURS``
  (the value that describes what splitproof does anyway), or that sits inside a verl feature which is
  switched off (``S.enable``/``S.enabled``/``SWITCHES``, off unless the user turns it on; turning it on
  is itself an error), or whose value is an interpolation (verl's plumbing copying another key, which
  is checked on its own): accepted silently;
- ``unsupported``: any other verl key (an error: "verl key X is not supported by splitproof");
- ``unknown``: anything else (an error suggesting the nearest known key).
"""

from __future__ import annotations

import difflib
import fnmatch
from collections.abc import Mapping
from functools import lru_cache
from importlib import resources

from .schema import schema_keys, schema_sections

# pattern (fnmatch over the dotted key) -> why it has no effect here
NO_EFFECT: dict[str, str] = {
    "*.pipeline_model_parallel_size": "pipeline parallelism",
    "*.data_parallel_size": "an inference engine's data parallelism",
    "*.expert_parallel_size": "expert parallelism",
    "*.ulysses_sequence_parallel_size": "sequence parallelism",
    "*.param_offload": "offload",
    "*.optimizer_offload": "offload",
    "*.offload_policy": "offload",
    "*.enable_activation_offload": "offload",
    "*.use_torch_compile": "torch.compile",
    "*.use_liger": "fused kernels",
    "*.use_fused_kernels": "fused kernels",
    "*.fused_kernel_options.*": "fused kernels",
    "*.tiled_mlp.*": "memory layout",
    "*.fsdp_size": "FSDP sharding layout",
    "*.forward_prefetch": "FSDP prefetching",
    "*.reshard_after_forward": "FSDP memory layout",
    "*.wrap_policy.*": "FSDP wrapping",
    "*.use_orig_params": "FSDP parameter layout",
    "*.use_no_sync_for_gradient_accumulation": "gradient-sync scheduling",
    "*.entropy_checkpointing": "activation memory",
    "*.entropy_from_logits_with_chunking": "activation memory",
    "*.entropy_from_logits_chunk_size": "activation memory",
    "*.pad_to_length": "padding layout",
    "*.pad_to_length_bucket": "padding layout",
    "*.full_determinism": "splitproof is always deterministic",
    "*.fsdp_config.seed": "splitproof seeds from trainer.seed and rollout.seed",
    "*.fsdp_config.strategy": "strategy is actor_rollout_ref.actor.strategy",
    "*.fsdp_config.forward_only": "engine role",
    "actor_rollout_ref.ref.fsdp_config.dtype": "the reference model computes in the actor's "
    "actor_rollout_ref.actor.fsdp_config.dtype",
    "*.cudagraph_capture_sizes": "CUDA graphs",
    "*.load_format": "inference-engine weight loading",
    "*.layered_summon": "weight synchronisation",
    "*.multi_stage_wake_up": "weight synchronisation",
    "*.disable_log_stats": "inference-engine logging",
    "*.use_shm": "model loading through shared memory",
    "actor_rollout_ref.rollout.mode": "sync or async rollout workers",
    "actor_rollout_ref.rollout.scheduling_policy": "inference-engine scheduling",
    "actor_rollout_ref.rollout.logprobs_mode": "an inference engine's log-prob mode (the hf rollout keeps "
    "log-probs of the temperature-scaled distribution)",
    "actor_rollout_ref.rollout.skip_tokenizer_init": "inference-engine start-up",
    "actor_rollout_ref.rollout.checkpoint_engine.*": "weight synchronisation",
    "actor_rollout_ref.rollout.trace.*": "rollout tracing",
    "actor_rollout_ref.actor.calculate_entropy": "the entropy metric is always computed",
    "*.checkpoint.*": "splitproof always saves model, optimizer and trainer state",
    "*.nnodes": "node count (torchrun sets the processes)",
    "*.n_gpus_per_node": "GPU count (torchrun sets the processes)",
    "reward.num_workers": "worker-process count",
    "reward_model.num_workers": "worker-process count",
    "actor_rollout_ref.hybrid_engine": "worker colocation",
    "critic.model.target_modules": "the critic's LoRA (critic.model.lora_rank is 0)",
    "critic.model.exclude_modules": "the critic's LoRA (critic.model.lora_rank is 0)",
    "critic.model.lora_alpha": "the critic's LoRA (critic.model.lora_rank is 0)",
    "*profiler.*": "profiling",
    "ray_kwargs.*": "Ray",
    "trainer.ray_wait_register_center_timeout": "Ray",
    "trainer.balance_batch": "sequence balancing across ranks (a layout)",
    "trainer.esi_redundant_time": "preemption timing",
    "trainer.use_v1": "trainer implementation",
    "trainer.log_val_generations": "logging of generations",
    "data.dataloader_num_workers": "data-loader processes",
    "data.filter_overlong_prompts_workers": "data-loader processes",
    "data.return_raw_chat": "verl dataset internals",
    "data.return_raw_input_ids": "verl dataset internals",
    "data.return_full_prompt": "verl dataset internals",
    "data.return_multi_modal_inputs": "no multi-modal inputs",
    "data.image_key": "no multi-modal inputs",
    "data.video_key": "no multi-modal inputs",
    "data.audio_key": "no multi-modal inputs",
    "data.image_patch_size": "no multi-modal inputs",
    "*.turbo_config.*": "verl's engine distribution plan",
    "*.rollout_n": "verl's copy of actor_rollout_ref.rollout.n",
    "actor_rollout_ref.ref.strategy": "the reference model runs like the actor",
    "actor_rollout_ref.ref.fsdp_config.model_dtype": "the reference model uses the actor's model_dtype",
}

# an inference engine's keys -> what they set; the rollout's are in the schema (read with rollout.name=vllm,
# no effect with the hf rollout), the other engines' (a teacher's, a reward model's) have no effect
ENGINE_REASONS = {
    "gpu_memory_utilization": "GPU memory of an inference engine",
    "tensor_model_parallel_size": "tensor parallelism",
    "enable_chunked_prefill": "inference-engine scheduling",
    "enable_prefix_caching": "inference-engine caching",
    "enforce_eager": "CUDA graphs",
    "free_cache_engine": "inference-engine memory",
    "max_num_batched_tokens": "inference-engine batching",
    "max_model_len": "inference-engine memory",
}
for _name, _reason in ENGINE_REASONS.items():
    NO_EFFECT[f"distillation.*.{_name}"] = _reason
    NO_EFFECT[f"*reward_model.rollout.{_name}"] = _reason
ENGINE_SWITCH = "actor_rollout_ref.rollout.name"
ENGINE_KEYS = {
    f"actor_rollout_ref.rollout.{name}": f"{reason}; read with {ENGINE_SWITCH}=vllm"
    for name, reason in {**ENGINE_REASONS, "dtype": "the hf rollout decodes with the actor's weights"}.items()
}

# feature section -> the key that switches it on, where it is not SECTION.enable / SECTION.enabled
SWITCHES: dict[str, str] = {
    "algorithm.pf_ppo": "algorithm.use_pf_ppo",
    "actor_rollout_ref.model.lora": "actor_rollout_ref.model.lora.rank",
    "critic.model.lora": "critic.model.lora.rank",
    "sandbox_fusion": "sandbox_fusion.url",
    "reward.sandbox_fusion": "reward.sandbox_fusion.url",
    "reward.reward_manager.module": "reward.reward_manager.source",
    "trainer.v1.colocate_async": "trainer.v1.trainer_mode",
    "trainer.v1.separate_async": "trainer.v1.trainer_mode",
    "trainer.v1.sampler": "trainer.v1.trainer_mode",
}

# verl keys whose value, when it is this one, describes what splitproof does anyway
SAME_AS_OURS: dict[str, object] = {
    "algorithm.rollout_correction.loss_type": "ppo_clip",
    "reward.reward_manager.name": "naive",
    "reward.reward_manager.source": "register",
    "trainer.v1.trainer_mode": "sync",
    "algorithm.filter_groups.max_inflight_gen_batches": 1,  # generation rounds run one after the other
    "algorithm.pf_ppo.reweight_method": "pow",
    "actor_rollout_ref.rollout.agent.default_agent_loop": "single_turn_agent",
    "actor_rollout_ref.actor.optim.optimizer_impl": "torch.optim",
    "critic.optim.optimizer_impl": "torch.optim",
    "actor_rollout_ref.actor.optim.zero_indexed_step": True,  # the LR schedule counts steps from 0
    "critic.optim.zero_indexed_step": True,
}

# more to say after "verl key X is not supported by splitproof"
HINTS: dict[str, str] = {
    "actor_rollout_ref.actor.ppo_micro_batch_size": "use actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size": (
        "use actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu"
    ),
    "actor_rollout_ref.ref.log_prob_micro_batch_size": "use actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu",
    "critic.ppo_micro_batch_size": "use critic.ppo_micro_batch_size_per_gpu",
    "critic.forward_micro_batch_size": "use critic.forward_micro_batch_size_per_gpu",
    "critic.model.tokenizer_path": "the critic reads the actor's tokens (actor_rollout_ref.model.tokenizer_path)",
    "trainer.max_critic_ckpt_to_keep": "the critic is saved in each global_step_N: use trainer.max_actor_ckpt_to_keep",
    "critic.model.lora_rank": "LoRA is supported for the actor (actor_rollout_ref.model.lora_rank)",
    "actor_rollout_ref.model.lora.rank": "Megatron's LoRA section: use actor_rollout_ref.model.lora_rank",
    "algorithm.rollout_correction.rollout_rs": "rejection sampling is not supported yet",
}

# Hydra's own top-level keys (a Hydra composition file is not a resolved config)
HYDRA_KEYS = {
    "defaults": (
        "Hydra defaults lists are not supported; pass a resolved config (e.g. verl's _generated_ppo_trainer.yaml)"
    ),
    "hydra": "Hydra's own settings have no meaning here",
}


@lru_cache(maxsize=1)
def verl_keys() -> frozenset[str]:
    """Key names of verl 0.9.1's PPO trainer config (package data ``verl_keys.txt``)."""
    text = resources.files("splitproof.rl.config").joinpath("verl_keys.txt").read_text(encoding="utf-8")
    return frozenset(line.strip() for line in text.splitlines() if line.strip() and not line.startswith("#"))


@lru_cache(maxsize=1)
def _verl_sections() -> frozenset[str]:
    sections = set()
    for key in verl_keys():
        parts = key.split(".")
        sections.update(".".join(parts[:i]) for i in range(1, len(parts)))
    return frozenset(sections)


@lru_cache(maxsize=1)
def _our_keys():
    return schema_keys(), frozenset(schema_sections())


def _prefixes(key: str):
    parts = key.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def is_ours(key: str) -> bool:
    """A schema leaf, or a key inside a mapping-valued leaf (``data.apply_chat_template_kwargs.x``)."""
    keys, _ = _our_keys()
    if key in keys:
        return True
    return any(p in keys and keys[p].type is dict for p in _prefixes(key))


def is_verl_key(key: str) -> bool:
    """A verl leaf, or a key below one (a mapping-valued leaf such as ``rollout.engine_kwargs.vllm``)."""
    names = verl_keys()
    return key in names or any(p in names for p in _prefixes(key))


def is_section(key: str) -> bool:
    """An inner node of our schema or of verl's tree (``data``, ``actor_rollout_ref.actor``)."""
    return key in _our_keys()[1] or key in _verl_sections()


def is_off(value) -> bool:
    """null, false, 0, an empty string, list or mapping: what verl uses for "feature off"."""
    if value is None or value is False:
        return True
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return value == 0
    if isinstance(value, (str, list, tuple, dict)):
        return len(value) == 0
    return False


def no_effect_reason(key: str) -> str | None:
    """Why a verl key has no effect here, or None when it does (a vLLM engine key: why it has none with
    the hf rollout)."""
    if key in ENGINE_KEYS:
        return ENGINE_KEYS[key]
    if not (is_verl_key(key) or any(p in _verl_sections() for p in _prefixes(key))):
        return None
    for pattern, reason in NO_EFFECT.items():
        if fnmatch.fnmatchcase(key, pattern):
            return reason
    return None


def feature_switches(key: str) -> list[str]:
    """The keys that switch on the verl features enclosing ``key`` (outermost first)."""
    switches = []
    for section in _prefixes(key):
        for switch in (SWITCHES.get(section), f"{section}.enable", f"{section}.enabled"):
            if switch and switch != key and (switch in verl_keys() or is_ours(switch)):
                switches.append(switch)
    return switches


def _switched_off(switch: str, settings: Mapping[str, object]) -> bool:
    value = settings.get(switch)
    return is_off(value) or (switch in SAME_AS_OURS and value == SAME_AS_OURS[switch])


def _is_interpolation(value) -> bool:
    return isinstance(value, str) and value.startswith("${") and value.endswith("}")


def classify(key: str, value, settings: Mapping[str, object] | None = None) -> str:
    """``ours`` | ``no_effect`` | ``off`` | ``unsupported`` | ``unknown`` (see the module docstring).

    ``settings`` holds every key the user set (dotted, the last value): it tells whether a feature
    switch was turned on. An unset switch is off (verl's defaults are).
    """
    settings = settings or {}
    if key in ENGINE_KEYS and settings.get(ENGINE_SWITCH) != "vllm":  # the hf rollout has no inference engine
        return "off" if value == _schema_default(key) else "no_effect"
    if is_ours(key):
        return "ours"
    if no_effect_reason(key) is not None:
        return "no_effect"
    if is_verl_key(key):
        if _switched_off(key, {key: value}) or _is_interpolation(value):
            return "off"
        if any(_switched_off(switch, settings) for switch in feature_switches(key)):
            return "off"
        return "unsupported"
    return "unknown"


def unsupported_message(key: str) -> str:
    hint = HINTS.get(key)
    return "verl key is not supported by splitproof" + (f" ({hint})" if hint else "")


def nearest_key(key: str) -> str | None:
    """The known key (ours first, then verl's) closest to a misspelt one, or None."""
    ours = sorted(_our_keys()[0])
    candidates = ours + sorted(verl_keys() - set(ours))
    match = difflib.get_close_matches(key, candidates, n=1, cutoff=0.6)
    if match:
        return match[0]
    # a right name in the wrong section: compare the last component alone
    last = key.rsplit(".", 1)[-1]
    by_last: dict[str, str] = {}
    for candidate in candidates:
        by_last.setdefault(candidate.rsplit(".", 1)[-1], candidate)
    match = difflib.get_close_matches(last, list(by_last), n=1, cutoff=0.8)
    return by_last[match[0]] if match else None


def unknown_message(key: str) -> str:
    if key in HYDRA_KEYS:
        return HYDRA_KEYS[key]
    suggestion = nearest_key(key)
    return "unknown key" + (f"; did you mean {suggestion}?" if suggestion else "")


@lru_cache(maxsize=1)
def _engine_defaults() -> dict:
    from .schema import TrainConfig, walk_defaults

    return {key: value for key, value, _ in walk_defaults(TrainConfig()) if key in ENGINE_KEYS}


def _schema_default(key: str):
    return _engine_defaults().get(key)
