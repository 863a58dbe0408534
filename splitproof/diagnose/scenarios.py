"""The named scenarios (docs/diagnose.md, "Scenarios"): the two public bug reports, the sweep, the critic's value
loss, and a custom one from flags.

A scenario fixes the loss, the batch shape, the optimizer step and the splits to compare with one
microbatch on one rank. It also names its control — the same comparison with the split-sensitive term
disabled — and its legacy variant — the same comparison with per-microbatch statistics.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from splitproof.loss_config import AGG_MODES, LOSS_MODES, LossConfig, ValueLossConfig

from .context import BatchSpec
from .split_run import RunSettings

NAMED = ("gmpo", "klcov", "sweep", "value")
DEFAULT = ("gmpo", "klcov")

# Legacy variants: every statistic per microbatch (as verl 24f25b03 does for geo_mean, kl_cov and
# clip_cov, and as any local-fallback aggregation does), or only the Cov selection per microbatch.
LEGACY_STATISTICS = {"statistics_scope": "microbatch"}
LEGACY_SELECTION = {"cov_strategy": "microbatch"}

# Sweep columns: split kind -> spec (8 sequences; the token budget is set from the batch).
SWEEP_SPLITS = {"even": "even:4", "uneven": "sizes:1,2,5", "tokens": None, "shuffle": "shuffle:1+even:4", "dp": "dp:2"}


@dataclass(frozen=True)
class Upstream:
    """The public verl report (or change) a scenario reruns: named in the report's header and the record."""

    ref: str  # "verl #7913"
    summary: str  # one line: what the report found
    url: str

    def as_dict(self) -> dict:
        return {"ref": self.ref, "summary": self.summary, "url": self.url}


VERL = "https://github.com/verl-project/verl"
GMPO_ISSUE = Upstream(
    "verl #7913", "GMPO's geo_mean loss changes when a minibatch is split into more microbatches", f"{VERL}/issues/7913"
)
KLCOV_ISSUE = Upstream(
    "verl #7829", "KL-Cov's token selection changes with the PPO micro-batch size", f"{VERL}/issues/7829"
)
VALUE_PR = Upstream(
    "verl PR #6957", "before it, the critic's value loss was normalised per microbatch", f"{VERL}/pull/6957"
)


@dataclass(frozen=True)
class Scenario:
    name: str
    title: str
    loss: LossConfig | ValueLossConfig  # a policy loss, or the critic's value loss
    batch: BatchSpec
    settings: RunSettings
    splits: tuple[str, ...]
    control: LossConfig | ValueLossConfig
    control_note: str
    legacy: dict | None = None
    legacy_note: str = ""
    columns: tuple[str, ...] = ()  # sweep: the split kind of each split, for the summary table
    group: str = ""  # sweep scenarios share a group (one summary table)
    notes: tuple[str, ...] = field(default_factory=tuple)
    upstream: Upstream | None = None  # the verl report whose experiment this is (its legacy column reproduces it)


def control_loss(loss: LossConfig) -> tuple[LossConfig, str]:
    """The split-insensitive counterpart of ``loss``: its floating-point floor on the same comparison."""
    if loss.loss_mode == "kl_cov":
        return loss.replace(ppo_kl_coef=0.0), "kl_cov with the penalty disabled (ppo_kl_coef 0)"
    if loss.loss_mode == "clip_cov":
        return (
            loss.replace(clip_cov_lb=1e299, clip_cov_ub=1e300),
            "clip_cov with an empty candidate band (no token selected)",
        )
    control = LossConfig(loss_mode="gpg", loss_agg_mode="token-sum")
    return control, "gpg with token-sum, no KL or entropy term: a per-token sum, split-insensitive in any framework"


def _loss(**values) -> LossConfig:
    if values.get("loss_mode") == "dro" and values.get("dro_beta") is None:
        values["dro_beta"] = 0.1
    return LossConfig(**values)


def gmpo(seed: int = 0) -> Scenario:
    """GMPO through micro-batches: verl issue #7913's experiment (docs/diagnose.md, "Scenarios")."""
    loss = _loss(loss_mode="geo_mean", use_kl_loss=True, kl_loss_coef=0.001)
    control, note = control_loss(loss)
    # rollout seed + 3: with the default --seed both groups of four hold mixed rewards (no zero advantages)
    batch = BatchSpec(sequences=8, prompt_length=8, response_length=16, full_length=True, seed=seed + 3)
    # prompts of 4..8 tokens + 16 response tokens: a budget of 48 padded tokens holds two sequences.
    splits = ("even:8", "sizes:3,5", "sizes:1,2,5", "tokens:48", "shuffle:1+even:8", "dp:2", "dp:2+even:4")
    return Scenario(
        "gmpo",
        "GMPO (geo_mean) + KL loss 0.001: 8 sequences x 16 response tokens, SGD lr 0.02, clip 1.0",
        loss,
        batch,
        RunSettings(optimizer="sgd", lr=0.02, grad_clip=1.0),
        splits,
        control,
        note,
        legacy=LEGACY_STATISTICS,
        legacy_note="every statistic per microbatch (verl 24f25b03's torch.mean)",
        upstream=GMPO_ISSUE,
    )


def klcov(seed: int = 0) -> Scenario:
    """KL-Cov selection under a token budget: verl issue #7829's experiment (docs/diagnose.md, "Scenarios")."""
    loss = _loss(loss_mode="kl_cov", kl_cov_ratio=2e-4)
    control, note = control_loss(loss)
    batch = BatchSpec(sequences=64, prompt_length=8, response_length=128, full_length=True, seed=seed + 1)
    # 64 x (4..8 prompt + 128 response) tokens; a budget of 8 x 136 = 1,088 padded tokens holds 8 sequences
    # (1,024 response tokens) per microbatch: eight dynamic microbatches.
    splits = ("tokens:1088", "dp:2+tokens:1088")
    return Scenario(
        "klcov",
        "KL-Cov, kl_cov_ratio 2e-4: 64 sequences x 128 response tokens (8,192 valid), SGD lr 0.02, clip 0.05",
        loss,
        batch,
        RunSettings(optimizer="sgd", lr=0.02, grad_clip=0.05),
        splits,
        control,
        note,
        legacy=LEGACY_SELECTION,
        legacy_note="cov_strategy 'microbatch': tokens selected per microbatch",
        upstream=KLCOV_ISSUE,
    )


def value(seed: int = 0) -> Scenario:
    """The critic's clipped value loss through microbatches, token budgets, packing, orders and DP, next to
    verl's per-microbatch normalisation before its PR #6957 (docs/diagnose.md, "Scenarios")."""
    loss = ValueLossConfig(cliprange_value=0.2, loss_agg_mode="token-mean")
    control = ValueLossConfig(cliprange_value=0.2, loss_agg_mode="token-sum")
    # responses of 1..16 tokens: microbatches hold different token counts, so per-microbatch means differ
    # rollout seed + 4: with the default --seed the two dp:2 shards hold 39 and 43 valid tokens (not equal)
    batch = BatchSpec(sequences=8, prompt_length=8, response_length=16, seed=seed + 4, with_values=True)
    splits = ("even:8", "sizes:3,5", "sizes:1,2,5", "tokens:48", "packed:48", "shuffle:1+even:4", "dp:2", "dp:2+even:4")
    return Scenario(
        "value",
        "critic value loss (cliprange_value 0.2, token-mean): 8 sequences x 1-16 response tokens, "
        "SGD lr 0.02, clip 1.0",
        loss,
        batch,
        RunSettings(optimizer="sgd", lr=0.02, grad_clip=1.0),
        splits,
        control,
        "the value loss with token-sum: a per-token sum, split-insensitive in any framework",
        legacy=LEGACY_STATISTICS,
        legacy_note="verl before its PR #6957: each microbatch normalised by its own token count, ranks averaged",
        upstream=VALUE_PR,
    )


def sweep_loss(loss_mode: str, agg_mode: str) -> LossConfig:
    """Every term on, so that every aggregation mode matters even where the policy term forces its own."""
    return _loss(
        loss_mode=loss_mode,
        loss_agg_mode=agg_mode,
        use_kl_loss=True,
        kl_loss_coef=0.01,
        entropy_coeff=0.01,
        kl_cov_ratio=0.1,
        clip_cov_ratio=0.1,
        clip_cov_lb=-5.0,
        clip_cov_ub=5.0,
    )


def sweep(seed: int = 0, token_budget: int = 24) -> list[Scenario]:
    """Every loss mode x every aggregation mode x {even, uneven, tokens, shuffle, dp:2}."""
    batch = BatchSpec(sequences=8, prompt_length=6, response_length=8, with_is_weights=True, seed=seed + 3)
    specs = dict(SWEEP_SPLITS, tokens=f"tokens:{token_budget}")
    out = []
    for loss_mode in LOSS_MODES:
        for agg_mode in AGG_MODES:
            loss = sweep_loss(loss_mode, agg_mode)
            control, note = control_loss(loss)
            out.append(
                Scenario(
                    f"sweep/{loss_mode}/{agg_mode}",
                    f"{loss_mode} x {agg_mode}",
                    loss,
                    batch,
                    RunSettings(optimizer="sgd", lr=0.02, grad_clip=1.0),
                    tuple(specs.values()),
                    control,
                    note,
                    legacy=LEGACY_STATISTICS,
                    legacy_note="every statistic per microbatch",
                    columns=tuple(specs),
                    group="sweep",
                )
            )
    return out


def custom(
    *,
    loss_mode="vanilla",
    agg_mode="token-mean",
    sequences=8,
    response_length=16,
    prompt_length=8,
    lr=0.02,
    grad_clip=1.0,
    optimizer="sgd",
    seed=0,
    splits=(),
    kl_cov_ratio=None,
    clip_cov_ratio=None,
    cov_strategy="auto",
    statistics_scope="minibatch",
    kl_loss_coef=None,
    entropy_coeff=None,
    full_length=False,
    legacy=False,
) -> Scenario:
    """A scenario from command-line flags (unset = the defaults in the signature)."""
    values = dict(loss_mode=loss_mode, loss_agg_mode=agg_mode)
    if kl_cov_ratio is not None:
        values["kl_cov_ratio"] = kl_cov_ratio
    if clip_cov_ratio is not None:
        values["clip_cov_ratio"] = clip_cov_ratio
    if kl_loss_coef:
        values.update(use_kl_loss=True, kl_loss_coef=kl_loss_coef)
    if entropy_coeff:
        values["entropy_coeff"] = entropy_coeff
    loss = _loss(**values)
    control, note = control_loss(loss)
    batch = BatchSpec(sequences, prompt_length, response_length, full_length=full_length, seed=seed + 1)
    if not splits:
        splits = default_custom_splits(sequences, prompt_length, response_length)
    settings = RunSettings(
        optimizer=optimizer, lr=lr, grad_clip=grad_clip, cov_strategy=cov_strategy, statistics_scope=statistics_scope
    )
    title = (
        f"{loss_mode} x {agg_mode}: {sequences} sequences x {response_length} response tokens, "
        f"{optimizer} lr {lr:g}, clip {grad_clip:g}"
    )
    if statistics_scope != "minibatch" or cov_strategy == "microbatch":
        title += " [candidate uses per-microbatch statistics]"
    return Scenario(
        "custom",
        title,
        loss,
        batch,
        settings,
        tuple(splits),
        control,
        note,
        legacy=LEGACY_STATISTICS if legacy else None,
        legacy_note="every statistic per microbatch",
    )


def default_custom_splits(sequences: int, prompt_length: int, response_length: int) -> tuple[str, ...]:
    """Each split kind once, sized for the batch."""
    splits = [f"even:{sequences}"]
    if sequences >= 3:
        first = max(1, sequences // 4)
        splits.append(f"sizes:{first},{sequences - first}")
    # room for about a third of the sequences at the longest length
    splits.append(f"tokens:{max(1, sequences // 3) * (prompt_length + response_length)}")
    splits.append(f"shuffle:1+even:{max(1, sequences // 2)}")
    if sequences >= 2:
        splits.append("dp:2")
    return tuple(splits)


def without_dp(scenario: Scenario, note: str) -> Scenario:
    """The scenario without its dp:D splits (they need CPU processes), with a note saying so."""
    from .splits import parse_split

    keep = [i for i, spec in enumerate(scenario.splits) if parse_split(spec).ranks == 1]
    if len(keep) == len(scenario.splits):
        return scenario
    columns = tuple(scenario.columns[i] for i in keep) if scenario.columns else ()
    return replace(
        scenario, splits=tuple(scenario.splits[i] for i in keep), columns=columns, notes=scenario.notes + (note,)
    )


def with_overrides(scenario: Scenario, *, splits=None, settings: dict | None = None) -> Scenario:
    changes = {}
    if splits:
        changes["splits"] = tuple(splits)
        changes["columns"] = ()
    if settings:
        changes["settings"] = scenario.settings.with_(**settings)
    return replace(scenario, **changes)
