"""A verifiers environment in the library's own API (its documented SingleTurnEnv shape): an XMLParser,
a Rubric of a correctness function and the parser's format reward, weighted. Runs unchanged."""

import verifiers as vf
from datasets import Dataset


def load_environment(num_examples: int = 6, **kwargs) -> vf.Environment:
    words = ["cat", "dog", "sun", "map", "pen", "box", "cup", "hat", "jam", "kit"][:num_examples]
    dataset = Dataset.from_list([{"question": f"reverse {w}", "answer": w[::-1]} for w in words])
    eval_dataset = Dataset.from_list([{"question": f"reverse {w}", "answer": w[::-1]} for w in ("ant", "bee")])
    parser = vf.XMLParser(["answer"], answer_field="answer")

    def correct_answer(completion, answer, **kwargs) -> float:
        response = parser.parse_answer(completion) or ""
        return 1.0 if response.strip() == answer else 0.0

    def answer_length(completion, **kwargs) -> float:
        return float(len(parser.parse_answer(completion) or ""))

    rubric = vf.Rubric(
        funcs=[correct_answer, parser.get_format_reward_func(), answer_length], weights=[1.0, 0.2, 0.0], parser=parser
    )
    return vf.SingleTurnEnv(
        dataset=dataset,
        eval_dataset=eval_dataset,
        system_prompt="Reverse the word. Answer in <answer> tags.",
        parser=parser,
        rubric=rubric,
    )
