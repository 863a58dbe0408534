"""A generative judge: a causal LM asked about each response, its answer parsed into a score.

The question is the user's template with ``{response}`` (the response text) and optionally ``{prompt}``
(the prompt, its last message's content for a chat prompt) and ``{ground_truth}``, sent as one user turn
through the judge's chat template (plain text when its tokenizer has none). The judge answers with
splitproof's ``hf`` rollout engine, and the answer of call c about sample j of prompt uid at step s draws
its tokens from the counter-based stream (seed, ``JUDGE_STREAM + c``, s, uid, j) — so a verdict is a
function of the question, the judge's weights and that key alone: the judge's batch size, the number of
processes, the order of the questions and a restart never change it. ``do_sample=false`` (or temperature
0) judges greedily.

Parsing, as verl's and verifiers' examples do:

- ``score``: the last number in the answer (verl's GenRM example reads the number its template asks for);
- ``verdict``: 1.0 when the first of the words "yes" / "no" in the answer is "yes", 0.0 when it is "no"
  (verifiers' ``JudgeRubric`` asks a yes/no question).

An answer that holds neither is a parse failure: the score is ``failure_score`` (0.0 unless set) and the
failure is counted, never raised.
"""

from __future__ import annotations

import re
import string
from collections.abc import Sequence
from dataclasses import dataclass, replace

from ...loss_config import ConfigError
from ..rollout.hf import HFRollout, SamplingParams
from .functions import ground_truth_of
from .rules import last_number

JUDGE_STREAM = 1 << 20  # call c draws from stream JUDGE_STREAM + c (training 0, validation 1, remax 2, repeats 16+k)
PARSERS = ("score", "verdict")
FIELDS = ("response", "prompt", "ground_truth")
_VERDICT = re.compile(r"\b(yes|no)\b", re.IGNORECASE)


@dataclass(frozen=True)
class JudgeSettings:
    """The judge's model, its question, how its answer is parsed and how it samples."""

    path: str
    template: str | None
    parser: str = "score"
    failure_score: float = 0.0
    sampling: SamplingParams = SamplingParams(max_response_length=64)
    max_num_seqs: int = 256
    trust_remote_code: bool = False


@dataclass(frozen=True)
class Verdict:
    """A judge's answer text, its score (``failure_score`` when unparsed) and whether it parsed."""

    answer: str
    score: float
    parsed: bool


def check_template(template: str, key: str) -> None:
    """``{response}`` present, no other field than ``FIELDS``, well-formed braces: else a ``ConfigError``."""
    try:
        names = [name for _, name, _, _ in string.Formatter().parse(template) if name is not None]
    except ValueError as err:
        raise ConfigError(key, f"not a valid template ({err}); write literal braces as {{{{ and }}}}") from None
    unknown = sorted(set(names) - set(FIELDS))
    if unknown:
        raise ConfigError(
            key, f"names {{{unknown[0]}}}; a template may name {', '.join('{' + f + '}' for f in FIELDS)}"
        )
    if "response" not in names:
        raise ConfigError(key, "has no {response} placeholder: the judge would never see the response")


def parse_answer(answer: str, parser: str) -> float | None:
    """The score an answer states under ``parser`` (see the module docstring), or None."""
    if parser == "verdict":
        found = _VERDICT.search(answer)
        return None if found is None else float(found.group(1).lower() == "yes")
    number = last_number(answer)
    try:
        return float(number) if number is not None else None
    except ValueError:
        return None


def question_text(template: str, record, response: str) -> str:
    prompt = record.prompt if isinstance(record.prompt, str) else str(record.prompt[-1].get("content", ""))
    return template.format(response=response, prompt=prompt, ground_truth=ground_truth_of(record.columns))


@dataclass(frozen=True)
class Judge:
    """A loaded judge: the rollout engine on its model, its tokenizer and its settings."""

    engine: HFRollout
    tokenizer: object
    settings: JudgeSettings

    def question_ids(self, text: str) -> list[int]:
        tokenizer = self.tokenizer
        if getattr(tokenizer, "chat_template", None):
            rendered = tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
            )
            return list(tokenizer(rendered, add_special_tokens=False)["input_ids"])
        return list(tokenizer(text)["input_ids"])

    def ask(self, keys: Sequence[tuple[int, int]], questions: Sequence[str], *, step: int, call: int = 0) -> list:
        """The judge's ``Verdict`` on each question; ``keys[i]`` = (uid, sample index) of what question i is
        about, which with ``step`` and ``call`` keys its sampling stream."""
        if not 0 <= call < JUDGE_STREAM:
            raise ValueError(f"judge call must be in [0, {JUDGE_STREAM}), got {call}")
        requests = [(uid, j, self.question_ids(q)) for (uid, j), q in zip(keys, questions)]
        if not requests:
            return []
        params = replace(self.settings.sampling, n=max(j for _, j, _ in requests) + 1)  # n: the engine's index bound
        samples = self.engine.generate(requests, params, step=step, stream=JUDGE_STREAM + call)
        answers = [
            self.tokenizer.decode(list(s.response_ids)[: -1 if s.finished else None], skip_special_tokens=True)
            for s in samples
        ]
        return [verdict_of(answer, self.settings) for answer in answers]

    def score(self, records, samples, texts: Sequence[str], *, step: int) -> list:
        """The verdict on every sample under the settings' template (``records[i]``: sample i's prompt)."""
        return judge_samples(self, records, samples, texts, step)


def verdict_of(answer: str, settings: JudgeSettings) -> Verdict:
    """The answer parsed under ``settings.parser``; ``failure_score`` when it states no score."""
    value = parse_answer(answer, settings.parser)
    return Verdict(answer, settings.failure_score if value is None else value, value is not None)


def judge_samples(judge, records, samples, texts: Sequence[str], step: int) -> list:
    """``judge.ask`` the settings' template about every sample (``records[i]``: sample i's prompt)."""
    questions = [question_text(judge.settings.template, r, t) for r, t in zip(records, texts)]
    return judge.ask([(s.uid, s.sample_index) for s in samples], questions, step=step)


@dataclass(frozen=True)
class JudgeCall:
    """The judge bound to one sample (step, uid, sample index): what a reward function receives as its
    ``judge`` keyword. ``judge(question, call=0)`` → ``Verdict``; several questions about one sample take
    distinct ``call`` numbers. ``ask_all(judges, questions)`` asks many in one batch, with the same verdicts."""

    judge: Judge
    step: int
    uid: int
    sample_index: int

    def __call__(self, question: str, call: int = 0) -> Verdict:
        return self.judge.ask([(self.uid, self.sample_index)], [question], step=self.step, call=call)[0]


def ask_all(judges: Sequence[JudgeCall], questions: Sequence[str], call: int = 0) -> list[Verdict]:
    """Each ``judges[i](questions[i], call)`` in one batch of the judge's engine (the same verdicts)."""
    if not judges:
        return []
    judge, step = judges[0].judge, judges[0].step
    if any(j.judge is not judge or j.step != step for j in judges):
        raise ValueError("ask_all: the judges must be of one judge and one step")
    return judge.ask([(j.uid, j.sample_index) for j in judges], list(questions), step=step, call=call)


def check_causal_lm_directory(path: str, key: str) -> None:
    """A causal LM at ``path``, read from its config.json alone (no weights)."""
    import json
    import os

    config_file = os.path.join(path, "config.json")
    if not os.path.isfile(config_file):
        raise ConfigError(key, f"{path!r} is not a Hugging Face model directory (no config.json)")
    with open(config_file, encoding="utf-8") as f:
        architectures = json.load(f).get("architectures") or []
    if not any(str(a).endswith(("ForCausalLM", "LMHeadModel")) for a in architectures):
        raise ConfigError(
            key,
            f"{path!r} is not a causal LM (architectures: {', '.join(map(str, architectures)) or 'none'}); "
            "a judge generates its answer",
        )


def load_judge(settings: JudgeSettings, key: str = "reward.reward_model.model_path") -> Judge:
    """The judge's model (float32, local files only) and tokenizer on the ``hf`` rollout engine."""
    from transformers import AutoTokenizer

    from ...hf_models import load_causal_lm
    from ..models.policy import generation_eos_ids

    check_causal_lm_directory(settings.path, key)
    model = load_causal_lm(settings.path, trust_remote_code=settings.trust_remote_code).eval()
    tokenizer = AutoTokenizer.from_pretrained(
        settings.path, local_files_only=True, trust_remote_code=settings.trust_remote_code
    )
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    engine = HFRollout(
        model,
        eos_token_ids=generation_eos_ids(model, tokenizer),
        pad_token_id=int(pad),
        max_num_seqs=settings.max_num_seqs,
    )
    return Judge(engine, tokenizer, settings)
