"""The ``vllm`` rollout backend: vLLM generates, splitproof's counter-based rule picks every token.

Same contract as ``hf.HFRollout.generate``: requests ``(uid, j, prompt_ids)``, one ``Sample`` per request in
request order, token t of sample j of prompt uid drawn from the uniform of (seed, stream, step, uid, j,
position + t), log-probs of the temperature-scaled distribution. Token in, token out: ``TokensPrompt`` and
``LLM(skip_tokenizer_init=True)``; vLLM decodes greedily over the logits that ``vllm_sampler.CounterSampler``
leaves (only splitproof's token), so vLLM's seeds never decide a token.

Weights: the engine starts with dummy weights (verl's ``load_format: dummy``) and serves the trainer's
model: before a generation, when any parameter of the trainer's model changed since the last sync (an
optimizer step, a loaded checkpoint: torch's in-place version counters say so), every weight is saved to
a file in /dev/shm, and vLLM's worker applies it (``collective_rpc``) with ``model_runner.reload_weights``
(on vLLM's CPU backend ``model.load_weights`` changes nothing: the linear layers are prepacked); then the
prefix cache is reset. A LoRA policy is sent merged (W + s·B·A, ``splitproof.lora.merged_state``).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from splitproof.hf_models import unwrap, vocab_size_of
from splitproof.lora import is_lora, merged_state
from splitproof.loss_config import ConfigError
from splitproof.rl.config.vllm_keys import INSTALL_HINT, vllm_installed
from splitproof.rl.rollout.hf import Request, Sample, SamplingParams, check_generate_args, check_requests
from splitproof.rl.rollout.sampling import shift_keys, stream_keys

_SHARED_MEMORY = "/dev/shm"  # the weights travel to the engine's worker as a file in memory


@dataclass(frozen=True)
class VLLMSettings:
    """The engine's settings (verl's rollout keys that vLLM honours on this machine)."""

    model_path: str
    dtype: str = "float32"
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    enforce_eager: bool = True
    kv_cache_gib: int = 1  # VLLM_CPU_KVCACHE_SPACE when the environment does not set it
    trust_remote_code: bool = False
    gpu: bool = False  # a CUDA device: gpu_memory_utilization passed, vLLM's batch-invariant mode set
    gpu_memory_utilization: float = 0.5
    in_process: bool = False  # the engine core in this process (a daemonic rollout process cannot start one)


def start_engine(settings: VLLMSettings):
    """A ``vllm.LLM`` with dummy weights, no tokenizer, splitproof's sampler, the sampled token's
    processed logit as its log-prob."""
    if not vllm_installed():
        raise ConfigError("actor_rollout_ref.rollout.name", f"vllm is not installed: {INSTALL_HINT}")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(settings.kv_cache_gib))
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc sends our functions
    if settings.in_process:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if settings.gpu:  # vLLM's batch-invariant kernels (NVIDIA); the CPU backend crashes with it
        os.environ.setdefault("VLLM_BATCH_INVARIANT", "1")
    memory = {"gpu_memory_utilization": settings.gpu_memory_utilization} if settings.gpu else {}
    from vllm import LLM
    from vllm import SamplingParams as VLLMParams
    from vllm.inputs import TokensPrompt

    from .vllm_sampler import CounterSampler

    try:
        llm = LLM(
            model=settings.model_path,
            skip_tokenizer_init=True,
            load_format="dummy",
            dtype=settings.dtype,
            max_num_seqs=settings.max_num_seqs,
            max_num_batched_tokens=settings.max_num_batched_tokens,
            max_model_len=settings.max_model_len,
            enable_prefix_caching=settings.enable_prefix_caching,
            enable_chunked_prefill=settings.enable_chunked_prefill,
            enforce_eager=settings.enforce_eager,
            tensor_parallel_size=1,
            distributed_executor_backend="uni" if settings.in_process else None,
            logits_processors=[CounterSampler],
            logprobs_mode="processed_logits",
            trust_remote_code=settings.trust_remote_code,
            seed=0,
            **memory,
        )
        # one token: some models fail only at their first forward (the CPU attention's head sizes)
        llm.generate([TokensPrompt(prompt_token_ids=[0])], VLLMParams(max_tokens=1, temperature=0.0), use_tqdm=False)
        return llm
    except Exception as e:  # vLLM's reason, one line
        reason = " ".join(str(e).split()) or type(e).__name__
        if "stack trace" in reason:  # the engine process died: its log (stderr, above) holds the cause
            reason = f"{reason.split('.')[0]} (vLLM's log above names the cause)"
        raise ConfigError(
            "actor_rollout_ref.rollout.name", f"vllm cannot start an engine for {settings.model_path}: {reason}"
        ) from e


def vllm_settings(cfg) -> VLLMSettings:
    """The engine's settings from a ``TrainConfig`` (verl's rollout keys; ``max_model_len`` null: prompt +
    response length). The CPU engine always runs eagerly."""
    from splitproof.rl.config.vllm_keys import engine_dtype
    from splitproof.rl.models.policy import model_directory

    r, model = cfg.actor_rollout_ref.rollout, cfg.actor_rollout_ref.model
    return VLLMSettings(
        model_path=model_directory(model.path),
        dtype=engine_dtype(cfg),
        max_num_seqs=r.max_num_seqs,
        max_num_batched_tokens=r.max_num_batched_tokens,
        max_model_len=r.max_model_len or cfg.data.max_prompt_length + cfg.data.max_response_length,
        enable_prefix_caching=r.enable_prefix_caching,
        enable_chunked_prefill=r.enable_chunked_prefill,
        enforce_eager=r.enforce_eager or cfg.trainer.device == "cpu",
        trust_remote_code=bool(getattr(model, "trust_remote_code", False)),
        gpu=cfg.trainer.device != "cpu",
        gpu_memory_utilization=r.gpu_memory_utilization,
    )


def weights_of(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The policy's weights under Hugging Face names (a LoRA policy merged), every name of a tied weight
    included: vLLM's CPU backend keeps its own copy of a tied ``lm_head`` (measured: sent once, under the
    embedding's name only, the engine's output layer keeps its old values)."""
    model = unwrap(model)
    state = merged_state(model) if is_lora(model) else model.state_dict()
    return [(name, t.detach()) for name, t in state.items()]


def reload_in_worker(worker, path: str) -> int:
    """Runs in vLLM's worker: the weights saved at ``path`` applied with ``model_runner.reload_weights``."""
    weights = torch.load(path, mmap=True, weights_only=True)
    worker.model_runner.reload_weights(weights_iterator=iter(weights.items()))
    return len(weights)


def fingerprint(model: nn.Module) -> tuple:
    """Changes whenever a parameter is replaced or written in place (torch's version counters)."""
    return tuple((id(p), p._version) for p in unwrap(model).parameters())


class VLLMRollout:
    """Generation with vLLM on the trainer's ``model`` (see the module docstring)."""

    def __init__(
        self,
        model: nn.Module,
        settings: VLLMSettings,
        *,
        eos_token_ids: int | Iterable[int] | None,
        pad_token_id: int | None,
        llm=None,
    ):
        self.model = model
        self.settings = settings
        self.vocab_size = vocab_size_of(model)
        ids = () if eos_token_ids is None else (eos_token_ids,) if isinstance(eos_token_ids, int) else eos_token_ids
        self.eos_token_ids = tuple(int(i) for i in ids)
        self.pad_token_id = pad_token_id
        self.max_num_seqs = settings.max_num_seqs
        self.llm = llm if llm is not None else start_engine(settings)
        self._synced: tuple | None = None
        self.syncs = 0

    def sync_weights(self, force: bool = False) -> bool:
        """Send the model's weights to the engine when they changed since the last sync; True if sent."""
        now = fingerprint(self.model)
        if not force and now == self._synced:
            return False
        with tempfile.TemporaryDirectory(dir=_SHARED_MEMORY if os.path.isdir(_SHARED_MEMORY) else None) as folder:
            path = os.path.join(folder, "weights.pt")
            torch.save({name: t.contiguous() for name, t in weights_of(self.model)}, path)
            self.llm.collective_rpc(reload_in_worker, args=(path,))
        self.llm.reset_prefix_cache()
        self._synced, self.syncs = now, self.syncs + 1
        return True

    def generate(
        self,
        requests: Sequence[Request],
        params: SamplingParams,
        *,
        step: int,
        stream: int = 0,
        positions: Sequence[int] | None = None,
        budgets: Sequence[int] | None = None,
    ) -> list[Sample]:
        """One :class:`Sample` per request, in request order (``HFRollout.generate``'s contract)."""
        positions, budgets = check_generate_args(requests, params, step, stream, positions, budgets)
        check_requests(requests, params, self.vocab_size)
        if not requests:
            return []
        self.sync_weights()
        from vllm import SamplingParams as VLLMParams
        from vllm.inputs import TokensPrompt

        from .vllm_sampler import EXTRA_KEY

        keys = stream_keys(
            params.seed,
            stream,
            step,
            torch.tensor([int(u) for u, _, _ in requests]),
            torch.tensor([int(j) for _, j, _ in requests]),
        )
        keys = shift_keys(keys, torch.tensor(positions, dtype=torch.long)).tolist()
        rule = (float(params.temperature), int(params.top_k), float(params.top_p), bool(params.greedy))
        prompts = [TokensPrompt(prompt_token_ids=[int(t) for t in ids]) for _, _, ids in requests]
        sampling = [
            VLLMParams(
                temperature=0.0,
                max_tokens=budget,
                ignore_eos=True,
                stop_token_ids=list(self.eos_token_ids),
                logprobs=0,
                detokenize=False,
                extra_args={EXTRA_KEY: (key, *rule)},
            )
            for key, budget in zip(keys, budgets)
        ]
        outputs = self.llm.generate(prompts, sampling_params=sampling, use_tqdm=False)
        return [
            _sample_of(request, output.outputs[0], self.eos_token_ids) for request, output in zip(requests, outputs)
        ]


def _sample_of(request: Request, completion, eos_token_ids: tuple[int, ...]) -> Sample:
    uid, j, prompt = request
    tokens = [int(t) for t in completion.token_ids]
    log_probs = [float(entry[token].logprob) for entry, token in zip(completion.logprobs, tokens)]
    finished = bool(tokens) and tokens[-1] in eos_token_ids and completion.finish_reason == "stop"
    return Sample(
        uid=int(uid),
        sample_index=int(j),
        prompt_ids=[int(t) for t in prompt],
        response_ids=tokens,
        log_probs=log_probs,
        finished=finished,
    )


SYNC_METRIC = "rollout/engine_trainer_logprob_diff"


def sync_check(cfg, pipelined, rollout_log_probs: torch.Tensor, old_log_probs: torch.Tensor, response_mask) -> dict:
    """With ``rollout.name=vllm`` (synchronous, old log-probs recomputed): ``{SYNC_METRIC: max |engine −
    trainer| log-prob over the first sample's response tokens}``, the engine's log-probs (the rollout's)
    against the trainer's recomputation. A sync that did not take effect shows as a large value."""
    if (
        cfg.actor_rollout_ref.rollout.name != "vllm"
        or pipelined is not None
        or cfg.algorithm.rollout_correction.bypass_mode
        or not bool(response_mask[0].any())
    ):
        return {}
    mask = response_mask[0].bool()
    diff = (rollout_log_probs[0].double() - old_log_probs[0].double()).abs()[mask]
    return {SYNC_METRIC: float(diff.max())}
