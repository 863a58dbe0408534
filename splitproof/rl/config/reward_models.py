"""The reward model's settings from verl's keys: ``reward.reward_model.*`` (verl 0.9.1) and the older
``reward_model.*`` spelling (``enable``, ``model.path``, ``model.input_tokenizer``, ``model.trust_remote_code``,
``micro_batch_size_per_gpu``, ``use_dynamic_bsz``, ``forward_max_token_len_per_gpu``), checked before any
model is loaded: a key set in both spellings to different values is an error naming both.
"""

from __future__ import annotations

import os

from ...loss_config import ConfigError
from ..models.policy import MODEL_DTYPES
from ..rewards.judge import PARSERS, JudgeSettings, check_causal_lm_directory, check_template
from ..rewards.remote_judge import RemoteJudgeSettings, RemoteSettings
from ..rewards.reward_model import CHAT_TEMPLATES, RewardModelSettings, check_classifier_directory
from ..rollout.hf import SamplingParams
from .schema import RewardModelConfig, TrainConfig

NEW, OLD = "reward.reward_model", "reward_model"


def _merged(new_key: str, new_value, old_key: str, old_value):
    """The older spelling's value where it is set (not null), else the new one's; both set and different
    (the new one off its default) is an error."""
    if old_value is None:
        return new_value
    default = getattr(RewardModelConfig(), new_key.rsplit(".", 1)[-1], None)
    if new_value != old_value and new_value != default:
        raise ConfigError(
            old_key, f"{old_value!r} conflicts with {new_key}={new_value!r}; set the reward model in one spelling"
        )
    return old_value


def reward_model_enabled(cfg: TrainConfig) -> bool:
    return bool(_merged(f"{NEW}.enable", cfg.reward.reward_model.enable, f"{OLD}.enable", cfg.reward_model.enable))


def reward_model_settings(cfg: TrainConfig) -> RewardModelSettings | JudgeSettings | RemoteJudgeSettings | None:
    """The checked settings of the run's reward model or judge (``kind``), or None when it is off."""
    if not reward_model_enabled(cfg):
        return None
    new, old = cfg.reward.reward_model, cfg.reward_model
    check_unused_sections(new)
    if new.kind == "remote":
        return remote_judge_settings(new)
    path = _merged(f"{NEW}.model_path", new.model_path, f"{OLD}.model.path", old.model.path)
    key = f"{OLD}.model.path" if old.model.path is not None else f"{NEW}.model_path"
    if not path:
        raise ConfigError(f"{NEW}.model_path", "the reward model is enabled but no model_path is given")
    if not os.path.isdir(path):
        raise ConfigError(key, f"{path!r} is not a local directory (only local checkpoints are loaded)")
    if new.kind == "judge":
        return judge_settings(
            new,
            path,
            key,
            _merged(
                f"{NEW}.trust_remote_code",
                new.trust_remote_code,
                f"{OLD}.model.trust_remote_code",
                old.model.trust_remote_code,
            ),
        )
    if new.kind != "classifier":
        raise ConfigError(f"{NEW}.kind", f"must be classifier, judge or remote, got {new.kind!r}")
    check_classifier_directory(path, key)
    template = new.chat_template
    if old.model.input_tokenizer is not None:  # verl: set when the reward model's chat template differs
        template = _merged(f"{NEW}.chat_template", new.chat_template, f"{OLD}.model.input_tokenizer", "own")
    if template not in CHAT_TEMPLATES:
        raise ConfigError(f"{NEW}.chat_template", f"must be one of {', '.join(CHAT_TEMPLATES)}, got {template!r}")
    micro = _merged(
        f"{NEW}.micro_batch_size_per_gpu",
        new.micro_batch_size_per_gpu,
        f"{OLD}.micro_batch_size_per_gpu",
        old.micro_batch_size_per_gpu,
    )
    dynamic = _merged(f"{NEW}.use_dynamic_bsz", new.use_dynamic_bsz, f"{OLD}.use_dynamic_bsz", old.use_dynamic_bsz)
    budget = _merged(
        f"{NEW}.forward_max_token_len_per_gpu",
        new.forward_max_token_len_per_gpu,
        f"{OLD}.forward_max_token_len_per_gpu",
        old.forward_max_token_len_per_gpu,
    )
    if micro is not None and micro < 1:
        raise ConfigError(f"{NEW}.micro_batch_size_per_gpu", f"must be >= 1 or null, got {micro}")
    if dynamic and budget < 1:
        raise ConfigError(f"{NEW}.forward_max_token_len_per_gpu", f"must be >= 1, got {budget}")
    if new.model_dtype not in MODEL_DTYPES:
        raise ConfigError(f"{NEW}.model_dtype", f"must be one of {', '.join(MODEL_DTYPES)}, got {new.model_dtype!r}")
    trust = _merged(
        f"{NEW}.trust_remote_code", new.trust_remote_code, f"{OLD}.model.trust_remote_code", old.model.trust_remote_code
    )
    return RewardModelSettings(
        path=path,
        chat_template=template,
        micro_batch_size=None if dynamic else micro,
        max_token_len=budget if dynamic else None,
        dtype=MODEL_DTYPES[new.model_dtype],
        trust_remote_code=bool(trust),
        key=key,
    )


def judge_settings(new: RewardModelConfig, path: str, key: str, trust) -> JudgeSettings:
    """A judge's checked settings: a causal LM, a template with ``{response}``, a parser, its sampling."""
    check_causal_lm_directory(path, key)
    return question_settings(new, path, trust)


def remote_judge_settings(new: RewardModelConfig) -> RemoteJudgeSettings:
    """A remote judge's checked settings: an http(s) URL, the question's settings, the calls' limits."""
    remote = new.remote
    if not remote.url or not str(remote.url).startswith(("http://", "https://")):
        raise ConfigError(
            f"{NEW}.remote.url", f"an OpenAI-compatible API base (http://HOST:PORT/v1), got {remote.url!r}"
        )
    for name in ("retries", "max_concurrent"):
        low = 0 if name == "retries" else 1
        if getattr(remote, name) < low:
            raise ConfigError(f"{NEW}.remote.{name}", f"must be >= {low}, got {getattr(remote, name)}")
    if not remote.timeout_s > 0:
        raise ConfigError(f"{NEW}.remote.timeout_s", f"must be > 0, got {remote.timeout_s}")
    return RemoteJudgeSettings(
        question_settings(new, str(remote.url), False),
        RemoteSettings(
            url=str(remote.url),
            model=remote.model,
            api_key_env=remote.api_key_env,
            timeout_s=float(remote.timeout_s),
            retries=int(remote.retries),
            max_concurrent=int(remote.max_concurrent),
        ),
    )


def question_settings(new: RewardModelConfig, path: str, trust) -> JudgeSettings:
    """The template, parser and sampling a local or remote judge shares, checked."""
    judge, rollout = new.judge, new.rollout
    if judge.template is None:
        raise ConfigError(f"{NEW}.judge.template", "a judge needs its question: a template with {response}")
    check_template(judge.template, f"{NEW}.judge.template")
    if judge.parser not in PARSERS:
        raise ConfigError(f"{NEW}.judge.parser", f"must be one of {', '.join(PARSERS)}, got {judge.parser!r}")
    if rollout.name != "hf":
        raise ConfigError(f"{NEW}.rollout.name", f"the judge runs on splitproof's hf engine, got {rollout.name!r}")
    sampling = SamplingParams(
        temperature=rollout.temperature,
        top_k=rollout.top_k,
        top_p=rollout.top_p,
        do_sample=rollout.do_sample,
        max_response_length=rollout.response_length,
        seed=rollout.seed,
    )
    try:
        sampling.check()
    except ConfigError as err:
        name = {"max_response_length": "response_length"}.get(err.field, err.field)
        raise ConfigError(f"{NEW}.rollout.{name}", str(err).split(": ", 1)[-1]) from None
    if rollout.max_num_seqs < 1:
        raise ConfigError(f"{NEW}.rollout.max_num_seqs", f"must be >= 1, got {rollout.max_num_seqs}")
    return JudgeSettings(
        path=path,
        template=judge.template,
        parser=judge.parser,
        failure_score=float(judge.failure_score),
        sampling=sampling,
        max_num_seqs=rollout.max_num_seqs,
        trust_remote_code=bool(trust),
    )


CLASSIFIER_KEYS = ("chat_template", "micro_batch_size_per_gpu", "use_dynamic_bsz", "forward_max_token_len_per_gpu")
SECTIONS = {"judge": ("judge", "remote"), "rollout": ("judge", "remote"), "remote": ("remote",)}


def check_unused_sections(new: RewardModelConfig) -> None:
    """A judge's or endpoint's key set for a kind that does not read it is an error, not ignored."""
    defaults = RewardModelConfig()
    for name in CLASSIFIER_KEYS:
        if new.kind != "classifier" and getattr(new, name) != getattr(defaults, name):
            raise ConfigError(f"{NEW}.{name}", f"is read with kind=classifier, but {NEW}.kind is {new.kind!r}")
    for section, kinds in SECTIONS.items():
        if new.kind not in kinds and getattr(new, section) != getattr(defaults, section):
            raise ConfigError(
                f"{NEW}.{section}", f"is read with kind={' or '.join(kinds)}, but {NEW}.kind is {new.kind!r}"
            )
