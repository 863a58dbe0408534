"""splitproof's counter-based sampling inside vLLM: a V1 logits processor that makes vLLM's greedy pick
exactly ``sampling.sample_tokens``'s token.

Each request sent by ``vllm_engine.VLLMRollout`` carries, in ``SamplingParams.extra_args["splitproof"]``,
its stream key (``stream_keys(seed, stream, step, uid, j)`` shifted to its first position) and the rule
``(temperature, top_k, top_p, greedy)``; vLLM is asked for greedy decoding (temperature 0), so its own
seeds and sampler never decide a token. For token t of a request (t = the tokens it has produced so far),
the processor computes the token and its log-prob from that request's logits row and the uniform of
position t of its stream alone, with the ``hf`` backend's rule, then sets the row to -inf everywhere but
that token, whose entry becomes the log-prob: vLLM's argmax picks the token, and with
``logprobs_mode="processed_logits"`` and ``logprobs=0`` the log-prob vLLM returns is ours, bit for bit.

Requests without the key (vLLM's own sampler, e.g. in the benchmark) pass through untouched.
"""

from __future__ import annotations

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality

from .sampling import sample_tokens, shift_keys, token_uniforms

EXTRA_KEY = "splitproof"


class CounterSampler(LogitsProcessor):
    """The per-request key and rule of each batch row (``update_state``), applied in ``apply``."""

    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool):
        self.rows: dict[int, tuple[int, tuple, list[int]]] = {}  # batch index -> (key, rule, output ids)

    def is_argmax_invariant(self) -> bool:
        return False  # it decides the argmax: it runs before vLLM's greedy pick

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        for index in batch_update.removed:
            self.rows.pop(index, None)
        for index, params, _, output_ids in batch_update.added:
            extra = (params.extra_args or {}).get(EXTRA_KEY) if params is not None else None
            if extra is None:
                self.rows.pop(index, None)
            else:
                key, *rule = extra
                self.rows[index] = (int(key), tuple(rule), output_ids)
        for a, b, direction in batch_update.moved:
            first, second = self.rows.pop(a, None), self.rows.pop(b, None)
            if first is not None:
                self.rows[b] = first
            if direction == MoveDirectionality.SWAP and second is not None:
                self.rows[a] = second

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        by_rule: dict[tuple, list[int]] = {}
        for index, (_, rule, _) in self.rows.items():
            if index < logits.shape[0]:
                by_rule.setdefault(rule, []).append(index)
        for (temperature, top_k, top_p, greedy), indices in by_rule.items():
            rows = torch.tensor(indices, dtype=torch.long, device=logits.device)
            keys = torch.tensor([self.rows[i][0] for i in indices], dtype=torch.int64)
            produced = torch.tensor([len(self.rows[i][2]) for i in indices], dtype=torch.int64)
            uniforms = token_uniforms(shift_keys(keys, produced), 0)
            tokens, log_probs = sample_tokens(
                logits[rows], uniforms, temperature=temperature, top_k=top_k, top_p=top_p, greedy=greedy
            )
            picked = torch.full(
                (len(indices), logits.shape[1]), float("-inf"), dtype=logits.dtype, device=logits.device
            )
            picked.scatter_(1, tokens.unsqueeze(1), log_probs.to(logits.dtype).unsqueeze(1))
            logits[rows] = picked
        return logits
