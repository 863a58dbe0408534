"""A remote judge: an OpenAI-compatible chat endpoint asked about each response, every call recorded.

Call c about sample j of prompt uid at step s sends ``POST {url}/chat/completions`` with the question as one
user message, the judge's sampling settings and a ``seed`` derived from (seed, step, uid, j, c); its record
key is that tuple with the SHA-256 of the request body. Before asking, the judge looks the key up in the
run folder's records (``judge_calls.rank<r>.jsonl``, every rank's file read, so a resume under another DP
size finds them all); a recorded call is replayed, never re-asked. So a resumed run, or a rerun with the
same seed in the same folder, gets the same answers — and the same rewards — even when the endpoint does
not answer the same twice. A changed question (another seed, another response) is a new key.

Calls run on ``max_concurrent`` threads and their answers are applied in the order of the questions, so
concurrency and latency never change a result. Each answer is appended to the records (flushed and
synced) as it arrives. A call that fails ``retries`` + 1 times (connection refused, a timeout, an HTTP
error, a reply that is not a chat completion) is a ``RemoteJudgeError`` naming the endpoint and the
attempts: the step fails, nothing of it is saved, the newest checkpoint stays as it was. An answer that
states no score is a parse failure (``judge.parse_answer``): a defined score and a count, never an error.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from .functions import RewardError
from .judge import JudgeSettings, judge_samples, verdict_of

RECORDS_GLOB = "judge_calls.rank*.jsonl"


class RemoteJudgeError(RewardError):
    """The remote judge gave no answer after its retries."""


@dataclass(frozen=True)
class RemoteSettings:
    """Where the endpoint is and how it is called (the key is read from the environment variable named)."""

    url: str  # the API base, e.g. http://127.0.0.1:8000/v1
    model: str = "judge"
    api_key_env: str | None = None
    timeout_s: float = 60.0
    retries: int = 2
    max_concurrent: int = 8


@dataclass(frozen=True)
class RemoteJudgeSettings:
    """A remote judge: the question's settings (its ``path`` is the URL) and the endpoint's."""

    judge: JudgeSettings
    remote: RemoteSettings


def load_records(folder: Path) -> dict[str, str]:
    """Every recorded answer under ``folder`` by key (a torn last line, from a crash, is skipped)."""
    records = {}
    for path in sorted(folder.glob(RECORDS_GLOB)):
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                entry = json.loads(line)
            except json.JSONDecodeError:
                continue
            records[entry["key"]] = entry["answer"]
    return records


def call_seed(seed: int, step: int, uid: int, sample_index: int, call: int) -> int:
    """The request's ``seed``: 63 bits of SHA-256 of the key."""
    digest = hashlib.sha256(f"{seed}/{step}/{uid}/{sample_index}/{call}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


class RemoteJudge:
    """The judge behind an endpoint, with the records of its calls in ``folder`` (this rank's file)."""

    def __init__(self, settings: JudgeSettings, remote: RemoteSettings, folder: str | os.PathLike, rank: int = 0):
        self.settings, self.remote = settings, remote
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.path = self.folder / f"judge_calls.rank{rank}.jsonl"
        self.records = load_records(self.folder)  # owned here: what this run asked or found recorded
        self.asked = 0  # calls sent to the endpoint by this process
        self._lock = threading.Lock()

    def body(self, question: str, step: int, uid: int, sample_index: int, call: int) -> dict:
        p = self.settings.sampling
        return {
            "model": self.remote.model,
            "messages": [{"role": "user", "content": question}],
            "temperature": p.temperature if not p.greedy else 0.0,
            "top_p": p.top_p,
            "max_tokens": p.max_response_length,
            "seed": call_seed(p.seed, step, uid, sample_index, call),
        }

    def post(self, body: dict) -> str:
        """The answer's text; retried ``retries`` times, then a ``RemoteJudgeError``."""
        url = self.remote.url.rstrip("/") + "/chat/completions"
        headers = {"Content-Type": "application/json"}
        if self.remote.api_key_env and os.environ.get(self.remote.api_key_env):
            headers["Authorization"] = f"Bearer {os.environ[self.remote.api_key_env]}"
        data, last = json.dumps(body).encode(), None
        attempts = self.remote.retries + 1
        for attempt in range(attempts):
            try:
                request = urllib.request.Request(url, data=data, headers=headers, method="POST")
                with urllib.request.urlopen(request, timeout=self.remote.timeout_s) as reply:
                    return str(json.loads(reply.read())["choices"][0]["message"]["content"])
            except (OSError, ValueError, KeyError, IndexError, TypeError) as err:
                last = err
                if attempt + 1 < attempts:
                    time.sleep(min(0.1 * 2**attempt, 2.0))
        raise RemoteJudgeError(
            f"remote judge {url}: no answer after {attempts} attempts (reward.reward_model.remote.retries="
            f"{self.remote.retries}); last: {type(last).__name__}: {last}"
        )

    def record(self, key: str, meta: dict, body: dict, answer: str) -> None:
        line = json.dumps({"key": key, **meta, "request": body, "answer": answer}) + "\n"
        with self._lock, open(self.path, "a", encoding="utf-8") as f:
            f.write(line)
            f.flush()
            os.fsync(f.fileno())
            self.records[key] = answer

    def ask(self, keys: Sequence[tuple[int, int]], questions: Sequence[str], *, step: int, call: int = 0) -> list:
        """The ``Verdict`` on each question, replayed where recorded (see the module docstring)."""
        bodies = [self.body(q, step, uid, j, call) for (uid, j), q in zip(keys, questions)]
        ids = [
            f"{step}/{uid}/{j}/{call}/" + hashlib.sha256(json.dumps(b, sort_keys=True).encode()).hexdigest()
            for (uid, j), b in zip(keys, bodies)
        ]
        missing = [i for i, key in enumerate(ids) if key not in self.records]

        def fetch(i: int) -> None:
            uid, j = keys[i]
            self.record(
                ids[i], {"step": step, "uid": uid, "sample_index": j, "call": call}, bodies[i], self.post(bodies[i])
            )

        if missing:
            with ThreadPoolExecutor(max_workers=max(1, min(self.remote.max_concurrent, len(missing)))) as pool:
                for future in [pool.submit(fetch, i) for i in missing]:
                    future.result()  # the first failure, in question order
            self.asked += len(missing)
        return [verdict_of(self.records[key], self.settings) for key in ids]

    def score(self, records, samples, texts: Sequence[str], *, step: int) -> list:
        """The verdict on every sample under the settings' template (``records[i]``: sample i's prompt)."""
        return judge_samples(self, records, samples, texts, step)
