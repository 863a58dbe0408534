"""Run scenarios: plan every split first, then, baseline by baseline, the runs compared with it.

Every run needed by any scenario is a *case* (context, loss, settings, split), deduplicated, so that the
sweep's shared controls run once. Cases are grouped by their baseline: the baseline runs, then its
single-process cases here, then its ``dp:D`` cases — one :func:`run_data_parallel` call each, whose
forked workers train their inherited template in place and compare against the baseline they inherit —
and the baseline is released. So the process holds the template model and one baseline (two model-sized
vectors) between runs, whatever the number of splits and scenarios, and DP workers are forked from a
process that holds no more.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass

from splitproof.engine.launch import run_data_parallel

from .compare import DIFF_FIELDS, eps_of, mask_agreement, objective_tolerance, tolerance, verdict
from .context import BatchSpec, Context, ModelSpec, build_critic, build_model
from .scenarios import Scenario
from .split_run import (
    Baseline,
    Loss,
    RunResult,
    RunSettings,
    describe_loss,
    is_cov,
    is_value,
    run_baseline,
    run_compared,
)
from .splits import SplitError, SplitPlan, baseline_plan, parse_split, plan_split

Progress = Callable[[int, int, str], None]


@dataclass(frozen=True)
class Case:
    batch: BatchSpec
    loss: Loss
    settings: RunSettings
    split: str  # spec, or the baseline label


def _outcome(result: RunResult) -> dict:
    out = dict(result.differences)
    out.update(
        objective=result.objective,
        metrics=result.metrics,
        selected=result.selected,
        skipped=result.skipped,
        microbatches=result.microbatches,
        strategy=result.strategy,
    )
    return out


def _dp_worker(job: tuple, baseline: Baseline) -> dict | None:
    """On each rank of a fresh fork: run the job on the rank's own copy-on-write template, in place (its
    pages stay shared with the parent until the optimizer step writes them); rank 0 returns the comparison."""
    import torch.distributed as dist

    model, batch, loss, settings, plan = job
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = run_compared(model, batch, loss, plan, settings, baseline, in_place=True)
    return _outcome(result) if dist.get_rank() == 0 else None


class Diagnosis:
    """Plans and runs a list of scenarios on one model; ``results()`` per scenario and split."""

    def __init__(
        self, scenarios: list[Scenario], model_spec: ModelSpec, *, progress: Progress | None = None, model=None
    ):
        self.scenarios = scenarios
        self.model_spec = model_spec
        self.progress = progress
        self.model = model if model is not None else build_model(model_spec)
        self.critic = None
        if any(is_value(sc.loss) for sc in scenarios):
            self.critic = build_critic(self.model, model_spec.seed)
        self.contexts: dict[BatchSpec, Context] = {}
        self.plans: dict[tuple[BatchSpec, str], SplitPlan] = {}
        self.outcomes: dict[Case, dict] = {}
        self.baselines: dict[Case, RunResult] = {}
        self._plan_all()

    # ---------------------------------------------------------------------------------------- planning
    def context(self, spec: BatchSpec) -> Context:
        if spec not in self.contexts:
            self.contexts[spec] = Context.create(self.model, spec, critic=self.critic)
        return self.contexts[spec]

    def template(self, loss: Loss):
        """The model a run of ``loss`` updates: the critic for a value loss, else the policy."""
        return self.critic if is_value(loss) else self.model

    def _plan_all(self) -> None:
        """Parse and plan every split of every scenario before anything runs (user errors first)."""
        for sc in self.scenarios:
            ctx = self.context(sc.batch)
            for spec in sc.splits:
                split = parse_split(spec)
                if split.ranks > 1 and self.model_spec.device != "cpu":
                    raise SplitError(f"split {split.spec!r}: dp runs on CPU processes (gloo); use --device cpu")
                key = (sc.batch, split.spec)
                if key not in self.plans:
                    self.plans[key] = plan_split(split, ctx.batch)

    def cases(self, sc: Scenario):
        """(role, split spec, case, baseline case) for every comparison of a scenario."""
        base = Case(sc.batch, sc.loss, sc.settings, "baseline")
        control_base = Case(sc.batch, sc.control, sc.settings, "baseline")
        for spec in sc.splits:
            label = parse_split(spec).spec
            yield "candidate", label, Case(sc.batch, sc.loss, sc.settings, label), base
            yield "control", label, Case(sc.batch, sc.control, sc.settings, label), control_base
            if sc.legacy:
                yield "legacy", label, Case(sc.batch, sc.loss, sc.settings.with_(**sc.legacy), label), base

    # ----------------------------------------------------------------------------------------- running
    def run(self) -> Diagnosis:
        todo: dict[Case, Case] = {}
        for sc in self.scenarios:
            for _, _, case, base in self.cases(sc):
                todo.setdefault(case, base)
        by_base: dict[Case, list[Case]] = {}
        for case, base in todo.items():
            by_base.setdefault(base, []).append(case)
        total, done = len(by_base) + len(todo), 0

        def tick(label: str, n: int = 1) -> None:
            nonlocal done
            done += n
            if self.progress:
                self.progress(done, total, label)

        for base, cases in by_base.items():
            ctx = self.context(base.batch)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # forced-aggregation and legacy-strategy warnings: documented
                template = self.template(base.loss)
                baseline = run_baseline(template, ctx.batch, base.loss, baseline_plan(ctx.batch), base.settings)
                self.baselines[base] = baseline.result
                tick(f"baseline {describe_loss(base.loss)}")
                for case in cases:
                    plan = self.plans[(case.batch, case.split)]
                    if plan.ranks == 1:
                        result = run_compared(template, ctx.batch, case.loss, plan, case.settings, baseline)
                        self.outcomes[case] = _outcome(result)
                        tick(f"{describe_loss(case.loss)} {case.split}")
            for case in cases:
                plan = self.plans[(case.batch, case.split)]
                if plan.ranks > 1:
                    job = (template, ctx.batch, case.loss, case.settings, plan)
                    self.outcomes[case] = run_data_parallel(_dp_worker, plan.ranks, job, baseline, timeout=1800.0)[0]
                    tick(f"{describe_loss(case.loss)} {case.split} ({case.settings.wrapper})")
            baseline.release()
            del baseline
        return self

    # ----------------------------------------------------------------------------------------- results
    def results(self, sc: Scenario) -> dict:
        """One scenario's record: baseline, reference, and per split the comparison, control and legacy."""
        ctx = self.context(sc.batch)
        dtype = self.model_spec.dtype
        base = self.baselines[Case(sc.batch, sc.loss, sc.settings, "baseline")]
        control_base = self.baselines[Case(sc.batch, sc.control, sc.settings, "baseline")]
        ref = ctx.reference(sc.loss)
        reference, control_reference = ref.value, ctx.reference(sc.control).value

        def objective_bound(control_objective: float) -> float:
            # KL-Cov/Clip-Cov: the control is the same objective without the selection, a measured floor
            deviation = abs(control_objective - control_reference) if is_cov(sc.loss) else None
            return objective_tolerance(ref.value, ref.rounding, ref.scale, dtype, deviation)

        rows: dict[str, dict] = {}
        for role, label, case, _ in self.cases(sc):
            rows.setdefault(label, {})[role] = self.outcomes[case]
        splits = []
        for spec, column in zip(sc.splits, sc.columns or (None,) * len(sc.splits)):
            label = parse_split(spec).spec
            got = rows[label]
            bounds = tolerance(got["control"], dtype)
            bounds["objective_abs_diff"] = objective_bound(got["control"]["objective"])
            plan = self.plans[(sc.batch, label)]
            entry = {"split": label}
            if column:
                entry["kind"] = column
            entry.update(ranks=plan.ranks, microbatches=plan.microbatches, microbatch_sizes=plan.describe())
            entry.update(_figures(got["candidate"], base, reference))
            entry["verdict"] = verdict(entry, bounds)
            entry["tolerance"] = bounds
            if got["candidate"]["skipped"]:
                entry["verdict"] = "fail"
                entry["note"] = "non-finite gradient norm: the step was skipped"
            entry["control"] = _figures(got["control"], control_base, control_reference)
            if "legacy" in got:
                entry["legacy"] = _figures(got["legacy"], base, reference)
                entry["legacy"]["verdict"] = verdict(entry["legacy"], bounds)
            for block, outcome in ((entry, got["candidate"]), (entry.get("legacy"), got.get("legacy"))):
                if block is not None and is_cov(sc.loss):
                    block["selected_tokens"] = {"baseline": _count(base.metrics), "split": _count(outcome["metrics"])}
                    block["mask_agreement"] = mask_agreement(base.selected, outcome["selected"])
            splits.append(entry)
        record = {
            "name": sc.name,
            "title": sc.title,
            "passed": all(s["verdict"] == "pass" for s in splits),
            "settings": _settings(sc, ctx, dtype),
            "baseline": {
                "split": "one microbatch, one rank",
                "objective": base.objective,
                "objective_reference": reference,
                "objective_tolerance": objective_bound(control_base.objective),
                "metrics": base.metrics,
            },
            "control": sc.control_note,
            "legacy": sc.legacy_note if sc.legacy else None,
            "upstream": sc.upstream.as_dict() if sc.upstream else None,
            "splits": splits,
        }
        if record["baseline"]["objective_tolerance"] >= abs(reference):
            record["notes"] = [
                f"the objective check is not informative here: its precision floor in {dtype} "
                f"({record['baseline']['objective_tolerance']:.1e}) is not below |J| ({abs(reference):.1e}), "
                "so it catches only gross errors; the gradient and update comparisons carry the verdict"
            ]
        if is_cov(sc.loss):
            record["baseline"]["selected_tokens"] = _count(base.metrics)
            record["baseline"]["cov_strategy"] = base.strategy
        if sc.group:
            record["group"] = sc.group
        if sc.notes:
            record["notes"] = list(sc.notes) + record.get("notes", [])
        return record


def _count(metrics: dict) -> int:
    return int(round(metrics.get("cov_selected", 0.0)))


def _figures(outcome: dict, baseline: RunResult, reference: float) -> dict:
    out = {k: outcome[k] for k in DIFF_FIELDS}
    out.update(
        objective=outcome["objective"],
        objective_baseline=baseline.objective,
        objective_reference=reference,
        objective_abs_diff=abs(outcome["objective"] - reference),
    )
    return out


def _settings(sc: Scenario, ctx: Context, dtype: str) -> dict:
    return {
        "loss": dict(sc.loss.__dict__),
        "sequences": sc.batch.sequences,
        "prompt_length": sc.batch.prompt_length,
        "response_length": sc.batch.response_length,
        "valid_tokens": ctx.valid_tokens,
        "full_length": sc.batch.full_length,
        "rollout_is_weights": sc.batch.with_is_weights,
        "batch_seed": sc.batch.seed,
        "dtype": dtype,
        "eps": eps_of(dtype),
        "optimizer": sc.settings.optimizer,
        "lr": sc.settings.lr,
        "grad_clip": sc.settings.grad_clip,
        "cov_strategy": sc.settings.cov_strategy,
        "statistics_scope": sc.settings.statistics_scope,
        "dp_wrapper": sc.settings.wrapper,
        "legacy_overrides": sc.legacy,
    }
