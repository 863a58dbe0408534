"""A verifiers MultiTurnEnv in the library's own API: the environment answers each guess with "higher",
"lower" or "correct" (env_response), stops on a correct guess (a vf.stop condition) or after max_turns,
and draws its secret from the episode's seed (state["info"]["seed"]). Two rubric functions: solved, and
closeness (the best guess's distance to the secret), which spreads the scores of a group from the first
step on, so that advantages are not all zero."""

import random

import verifiers as vf
from datasets import Dataset


class GuessEnv(vf.MultiTurnEnv):
    async def setup_state(self, state: vf.State) -> vf.State:
        state["secret"] = random.Random(state["info"]["seed"]).randint(0, 9)
        return state

    @vf.stop
    async def guessed(self, state: vf.State) -> bool:
        return state.get("solved", False)

    async def env_response(self, messages: vf.Messages, state: vf.State, **kwargs) -> vf.Messages:
        text = str(messages[-1]["content"] or "")
        digits = [int(c) for c in text if c.isdigit()]
        if digits:
            state["closeness"] = max(state.get("closeness", 0.0), 1 - abs(digits[0] - state["secret"]) / 10)
        if digits and digits[0] == state["secret"]:
            state["solved"] = True
            return [{"role": "user", "content": "correct"}]
        if not digits:
            return [{"role": "user", "content": "a digit"}]
        return [{"role": "user", "content": "higher" if digits[0] < state["secret"] else "lower"}]


def load_environment(max_turns: int = 3, **kwargs) -> vf.Environment:
    dataset = Dataset.from_list([{"question": f"guess a digit ({i})", "answer": ""} for i in range(4)])

    def solved(state, **kwargs) -> float:
        return 1.0 if state.get("solved") else 0.0

    def closeness(state, **kwargs) -> float:
        return state.get("closeness", 0.0)

    return GuessEnv(dataset=dataset, rubric=vf.Rubric(funcs=[solved, closeness]), max_turns=max_turns)
