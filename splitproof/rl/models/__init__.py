"""The models a run trains and how: the policy and its tokenizer (``policy``), PPO's critic beside it
(``critic``), and the optimizer with its learning-rate schedule (``optim``)."""
