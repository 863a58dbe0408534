"""A verifiers EnvGroup in the library's own API: a SingleTurnEnv (reverse a word, XMLParser format reward)
and a MultiTurnEnv (guess a digit, env_response) as one environment; each row is routed to its environment
by the group (info["env_id"]) and scored by that environment's rubric."""

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
        digits = [int(c) for c in str(messages[-1]["content"] or "") if c.isdigit()]
        if digits and digits[0] == state["secret"]:
            state["solved"] = True
            return [{"role": "user", "content": "correct"}]
        return [{"role": "user", "content": "higher" if digits and digits[0] < state["secret"] else "lower"}]


def load_environment(**kwargs) -> vf.Environment:
    parser = vf.XMLParser(["answer"], answer_field="answer")

    def reversed_word(completion, answer, **kwargs) -> float:
        return 1.0 if (parser.parse_answer(completion) or "").strip() == answer else 0.0

    reverse = vf.SingleTurnEnv(
        dataset=Dataset.from_list([{"question": f"reverse {w}", "answer": w[::-1]} for w in ("cat", "dog")]),
        system_prompt="Reverse the word.",
        parser=parser,
        rubric=vf.Rubric(funcs=[reversed_word, parser.get_format_reward_func()], weights=[1.0, 0.2], parser=parser),
    )

    def solved(state, **kwargs) -> float:
        return 1.0 if state.get("solved") else 0.0

    guess = GuessEnv(
        dataset=Dataset.from_list([{"question": f"guess a digit ({i})", "answer": ""} for i in range(2)]),
        rubric=vf.Rubric(funcs=[solved]),
        max_turns=3,
    )
    return vf.EnvGroup(envs=[reverse, guess], env_names=["reverse", "guess"])
