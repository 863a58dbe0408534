"""A discriminative reward model: a Hugging Face sequence classifier scoring each (prompt, response).

The model is an ``AutoModelForSequenceClassification`` with one label, read from a local directory. Its
input is, with ``chat_template = "policy"``, the sample's own token ids (prompt + response, the policy's
chat template, as verl's reward model reads them when it shares the policy's tokenizer); with ``"own"`` the
response is decoded with the policy's tokenizer and the conversation re-rendered with the reward model's
chat template (verl's ``input_tokenizer``). The score is the head on the hidden state of the input's last
token:

    r(x) = wᵀ h_L(x) (+ b)

Rows are left-padded to the width of their micro-batch (so the last token sits in the last column), with
``position_ids = cumsum(mask) - 1`` and the engine's own attention mask, and every linear layer computes
fixed-row products (``engine.row_invariant``): a row's score is a function of the row and the weights
alone, whatever micro-batch size, token budget, DP size or order it was computed in.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from ...engine.attention import attention_mask, check_attention
from ...engine.microbatch import budget_microbatches, fixed_microbatches
from ...engine.row_invariant import row_invariant
from ...hf_models import local_checkpoint
from ...loss_config import ConfigError

CHAT_TEMPLATES = ("policy", "own")


@dataclass(frozen=True)
class RewardModelSettings:
    """Where the model is and how its pass is split (``micro_batch_size`` or ``max_token_len``, never both)."""

    path: str
    chat_template: str = "policy"
    micro_batch_size: int | None = None
    max_token_len: int | None = None
    dtype: torch.dtype = torch.float32
    trust_remote_code: bool = False
    key: str = "reward.reward_model.model_path"  # the config key named in errors


def check_classifier_directory(path: str, key: str) -> None:
    """A sequence classifier with one label at ``path``, read from its config.json alone (no weights)."""
    config_file = os.path.join(path, "config.json")
    if not os.path.isfile(config_file):
        raise ConfigError(key, f"{path!r} is not a Hugging Face model directory (no config.json)")
    with open(config_file, encoding="utf-8") as f:
        config = json.load(f)
    architectures = config.get("architectures") or []
    if not any(str(a).endswith("ForSequenceClassification") for a in architectures):
        raise ConfigError(
            key,
            f"{path!r} is not a sequence classifier (architectures: {', '.join(map(str, architectures)) or 'none'}); "
            "a reward model is an AutoModelForSequenceClassification with num_labels=1",
        )
    labels = config.get("num_labels", len(config.get("id2label") or {}) or None)
    if labels not in (None, 1):
        raise ConfigError(key, f"{path!r} has {labels} labels; a reward model has one (num_labels=1)")


def load_classifier(settings: RewardModelSettings) -> nn.Module:
    """The sequence classifier at ``settings.path`` in ``settings.dtype``, in eval mode (local files only)."""
    from transformers import AutoModelForSequenceClassification

    check_classifier_directory(settings.path, settings.key)
    path, kwargs = local_checkpoint(settings.path, dtype=settings.dtype, trust_remote_code=settings.trust_remote_code)
    model = AutoModelForSequenceClassification.from_pretrained(path, **kwargs)
    model.config.use_cache = False
    return model.eval()


def head_of(model: nn.Module) -> nn.Module:
    """The classifier's scoring head (``score``, as Hugging Face's decoder classifiers name it)."""
    head = getattr(model, "score", None) or getattr(model, "classifier", None)
    if head is None:
        raise ConfigError("reward.reward_model.model_path", f"{type(model).__name__} has no score head")
    return head


@torch.no_grad()
def last_token_scores(
    model: nn.Module, sequences: Sequence[Sequence[int]], *, micro_batch_size: int | None, max_token_len: int | None
) -> Tensor:
    """r(x) of every token sequence (float64 [n], in order), computed in micro-batches of
    ``micro_batch_size`` rows or under a ``max_token_len`` token budget (rows × width); the split never
    changes a score (see the module docstring)."""
    check_attention(model)
    n = len(sequences)
    empty = [i for i, s in enumerate(sequences) if not len(s)]
    if empty:
        raise ValueError(f"reward model: sequence {empty[0]} has no token")
    rows = list(range(n))
    if max_token_len:
        microbatches = budget_microbatches(rows, [len(s) for s in sequences], max_token_len)
    else:
        microbatches = fixed_microbatches(rows, micro_batch_size or max(n, 1))
    scores = torch.zeros(n, dtype=torch.float64)
    was_training = model.training
    model.eval()
    try:
        with row_invariant(model):
            for mb in microbatches:
                scores[mb] = forward_scores(model, [sequences[i] for i in mb])
    finally:
        model.train(was_training)
    return scores


def forward_scores(model: nn.Module, sequences: Sequence[Sequence[int]]) -> Tensor:
    """r(x) of each sequence (float64 [n]) in one forward, the rows left-padded to the longest;
    differentiable (training a reward model) unless called inside ``last_token_scores``."""
    body, head, dtype = getattr(model, model.base_model_prefix), head_of(model), next(model.parameters()).dtype
    width = max(len(s) for s in sequences)
    ids = torch.zeros(len(sequences), width, dtype=torch.long)
    real = torch.zeros(len(sequences), width, dtype=torch.bool)
    for row, seq in enumerate(sequences):
        ids[row, width - len(seq) :] = torch.as_tensor(list(seq), dtype=torch.long)
        real[row, width - len(seq) :] = True
    position_ids = (real.long().cumsum(-1) - 1).clamp(min=0)
    mask = None if bool(real.all()) else attention_mask(None, real, model, dtype)
    hidden = body(input_ids=ids, attention_mask=mask, position_ids=position_ids, use_cache=False).last_hidden_state
    return head(hidden[:, -1]).to(torch.float64)[:, 0]


@dataclass(frozen=True)
class RewardModel:
    """A loaded reward model with what building its inputs needs (``policy_tokenizer`` decodes responses
    for the ``own`` template)."""

    model: nn.Module
    settings: RewardModelSettings
    tokenizer: Any  # the reward model's own tokenizer (``own`` template), else None
    policy_tokenizer: Any

    def inputs(self, records, samples, texts: Sequence[str]) -> list[list[int]]:
        """Each sample's reward-model input ids (``records[i]`` is sample i's prompt record)."""
        if self.settings.chat_template == "policy":
            return [list(s.prompt_ids) + list(s.response_ids) for s in samples]
        return [own_template_ids(self.tokenizer, r.prompt, t) for r, t in zip(records, texts)]

    def score(self, records, samples, texts: Sequence[str]) -> Tensor:
        """float64 [n]: the reward model's score of each sample."""
        return last_token_scores(
            self.model,
            self.inputs(records, samples, texts),
            micro_batch_size=self.settings.micro_batch_size,
            max_token_len=self.settings.max_token_len,
        )


def own_template_ids(tokenizer, prompt, response: str) -> list[int]:
    """The conversation (the prompt's messages, or the prompt as one user turn, then the response as the
    assistant's) rendered with ``tokenizer``'s chat template, as token ids."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]
    messages.append({"role": "assistant", "content": response})
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def load_reward_model(settings: RewardModelSettings, policy_tokenizer) -> RewardModel:
    """The reward model of ``settings`` with its tokenizer (``own`` template: one with a chat template)."""
    if settings.chat_template not in CHAT_TEMPLATES:
        raise ConfigError(
            "reward.reward_model.chat_template",
            f"must be one of {', '.join(CHAT_TEMPLATES)}, got {settings.chat_template!r}",
        )
    tokenizer = None
    if settings.chat_template == "own":
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(
            settings.path, local_files_only=True, trust_remote_code=settings.trust_remote_code
        )
        if not getattr(tokenizer, "chat_template", None):
            raise ConfigError(
                "reward.reward_model.chat_template",
                f"'own': the reward model's tokenizer at {settings.path!r} has no chat template",
            )
    model = load_classifier(settings)
    vocab = int(model.get_input_embeddings().num_embeddings)
    if settings.chat_template == "policy" and vocab < len(policy_tokenizer):
        raise ConfigError(
            settings.key,
            f"the reward model's vocabulary ({vocab}) is smaller than the policy tokenizer's "
            f"({len(policy_tokenizer)}); it cannot read the policy's tokens: set reward.reward_model.chat_template=own",
        )
    return RewardModel(model, settings, tokenizer, policy_tokenizer)


def classifier_from_causal_lm(policy: nn.Module, *, seed: int = 0, dtype: torch.dtype | None = None) -> nn.Module:
    """A one-label sequence classifier with ``policy``'s body (copied) and a head drawn from ``seed`` alone:
    weight ~ N(0, initializer_range²), no bias — the start of a reward model trained from a causal LM."""
    import copy

    from transformers import AutoModelForSequenceClassification

    config = copy.deepcopy(policy.config)
    config.num_labels, config.architectures, config.use_cache = 1, None, False
    if getattr(config, "pad_token_id", None) is None:
        config.pad_token_id = 0
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForSequenceClassification.from_config(config)
    model = model.to(dtype or next(policy.parameters()).dtype)
    getattr(model, model.base_model_prefix).load_state_dict(getattr(policy, policy.base_model_prefix).state_dict())
    head = head_of(model)
    g = torch.Generator().manual_seed(int(seed))
    std = float(getattr(config, "initializer_range", 0.02))
    with torch.no_grad():
        head.weight.copy_(
            (torch.randn(head.weight.shape, generator=g, dtype=torch.float64) * std).to(head.weight.dtype)
        )
    return model
