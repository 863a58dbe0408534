"""One policy update of a tiny causal LM — on one process, or data-parallel under torchrun.

    python examples/update_step.py --loss-mode geo_mean --agg-mode seq-mean-token-mean
    torchrun --standalone --nproc_per_node 2 examples/update_step.py --loss-mode kl_cov --strategy fsdp2

Every rank builds the same model and rollout batch (plain per-sequence lists through
``RolloutBatch.from_sequences``, old log-probs recomputed by the current policy); the engine takes each
rank's shard of every minibatch. Rank 0 prints the step metrics and writes them (with the updated
parameters) to --out.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

from splitproof import LossConfig, RolloutBatch
from splitproof.engine import UpdateConfig, compute_log_probs, update_policy, wrap_model
from splitproof.hf_models import tiny_causal_lm


def rollout(model, dtype: torch.dtype, *, prompts: int = 2, group: int = 4, seed: int = 1) -> RolloutBatch:
    """A stand-in for generation and rewards: random prompts and responses (``group`` per prompt), a 0/1
    reward per response, GRPO advantages per group, the prompt's number as each response's group id, and the
    policy's own log-probs as the old ones."""
    g = torch.Generator().manual_seed(seed)
    prompt_ids, response_ids, advantages, index = [], [], [], []
    for p in range(prompts):
        prompt = torch.randint(3, 256, (int(torch.randint(4, 9, (1,), generator=g)),), generator=g).tolist()
        rewards = torch.tensor([0.0, 1.0] + torch.randint(0, 2, (group - 2,), generator=g).tolist())
        advantages += ((rewards - rewards.mean()) / (rewards.std() + 1e-6)).tolist()
        for _ in range(group):
            length = int(torch.randint(1, 17, (1,), generator=g))
            prompt_ids.append(prompt)
            index.append(p)
            response_ids.append(torch.randint(3, 256, (length,), generator=g).tolist())
    zeros = [[0.0] * len(r) for r in response_ids]
    batch = RolloutBatch.from_sequences(
        prompt_ids, response_ids, zeros, advantages, ref_log_probs=zeros, index=index, dtype=dtype
    )
    old, _ = compute_log_probs(model, batch, micro_batch_size=4)  # no micro-batching changes them
    batch.old_log_probs = old
    batch.ref_log_probs = old.clone()  # the reference policy is the initial policy
    return batch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--loss-mode", default="vanilla")
    parser.add_argument("--agg-mode", default="token-mean")
    parser.add_argument("--strategy", default="ddp", choices=["ddp", "fsdp2"], help="used when WORLD_SIZE > 1")
    parser.add_argument("--dtype", default="float64", choices=["float32", "float64"])
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--out", help="write metrics and parameters here (torch.save), rank 0 only")
    args = parser.parse_args()

    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if distributed:
        dist.init_process_group("gloo")
    torch.set_num_threads(1)
    model = tiny_causal_lm("llama", dtype=getattr(torch, args.dtype), seed=0)
    batch = rollout(model, getattr(torch, args.dtype))
    if distributed:
        model = wrap_model(model, args.strategy)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.02)
    loss = LossConfig(
        loss_mode=args.loss_mode,
        loss_agg_mode=args.agg_mode,
        use_kl_loss=True,
        dro_beta=0.1 if args.loss_mode == "dro" else None,
    )
    config = UpdateConfig(
        loss=loss, ppo_mini_batch_size=4, ppo_epochs=2, shuffle=True, ppo_micro_batch_size_per_gpu=args.micro_batch_size
    )
    steps = update_policy(model, optimizer, batch, config)
    state = {
        k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
        for k, v in (model.module if hasattr(model, "module") else model).state_dict().items()
    }
    if not distributed or dist.get_rank() == 0:
        for i, step in enumerate(steps):
            print(f"step {i}: " + ", ".join(f"{k}={v:.6g}" for k, v in sorted(step.metrics.items())))
        if args.out:
            torch.save({"metrics": [s.metrics for s in steps], "state": state}, args.out)
    if distributed:
        dist.barrier()
        del model
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
