"""`splitproof train` config errors and notices: unknown and unsupported keys, keys without effect, wrong types,
semantic checks, each error naming the dotted key (and a notice naming the key, the value and where it came from)."""

import pytest

from splitproof import ConfigError
from splitproof.rl.config.check import critic_enabled

from .config_helpers import USER_MODEL, error_of, load


def test_unknown_key_suggests_nearest():
    error = error_of("data.train_batch_sise=8")
    assert error.field == "data.train_batch_sise"
    assert "did you mean data.train_batch_size?" in str(error)
    error = error_of("actor_rollout_ref.actor.lr=1e-5")
    assert "did you mean actor_rollout_ref.actor.optim.lr?" in str(error)
    assert "did you mean data.train_batch_size?" in str(error_of("trainer.train_batch_size=8"))
    assert "unknown key" in str(error_of("nonsense.entirely=1"))
    assert "is a section" in str(error_of("data=3"))


def test_unsupported_verl_key_and_off_values():
    error = error_of("actor_rollout_ref.model.lora.rank=8")
    assert error.field == "actor_rollout_ref.model.lora.rank"
    assert "verl key is not supported by splitproof" in str(error) and "lora_rank" in str(error)
    assert "ppo_micro_batch_size_per_gpu" in str(error_of("actor_rollout_ref.actor.ppo_micro_batch_size=4"))
    assert "not supported" in str(error_of("algorithm.use_pf_ppo=true"))
    # "off" values, and settings inside a feature that stays off, are accepted silently
    cfg, notices = load(
        "actor_rollout_ref.model.lora_rank=0",
        "algorithm.use_pf_ppo=false",
        "algorithm.pf_ppo.reweight_method=max_min",
        "trainer.critic_warmup=0",
        "actor_rollout_ref.actor.ppo_micro_batch_size=null",
        "reward_model.enable_resource_pool=False",
    )
    assert notices == [] and cfg == load()[0]
    # the critic is such a feature: off under grpo (the recipe's), on under gae unless critic.enable=false
    assert load("critic.model.tokenizer_path=/tok", "critic.model.lora_rank=8")[0] == load()[0]
    assert error_of(USER_MODEL, "critic.model.lora_rank=8").field == "critic.model.lora_rank"  # verl's gae
    assert (
        load("algorithm.adv_estimator=rloo", "critic.enable=false", "critic.model.lora_rank=8")[0].critic.enable
        is False
    )
    # ... but not once the feature is switched on
    assert error_of("algorithm.use_pf_ppo=true", "algorithm.pf_ppo.reweight_method=max_min").field in (
        "algorithm.use_pf_ppo",
        "algorithm.pf_ppo.reweight_method",
    )


def test_no_effect_keys_give_a_notice_and_change_nothing():
    cfg, notices = load(
        "actor_rollout_ref.rollout.gpu_memory_utilization=0.6",
        "trainer.balance_batch=false",
        "actor_rollout_ref.actor.use_torch_compile=false",
        "+ray_kwargs.ray_init.num_cpus=4",
    )
    assert cfg == load()[0]
    assert len(notices) == 4
    assert notices[0].startswith("actor_rollout_ref.rollout.gpu_memory_utilization: no effect in splitproof")


def test_wrong_types_name_the_key():
    error = error_of("data.train_batch_size=abc")
    assert error.field == "data.train_batch_size"
    assert "expected an integer" in str(error) and "'abc'" in str(error)
    assert error_of("actor_rollout_ref.actor.use_kl_loss=maybe").field == "actor_rollout_ref.actor.use_kl_loss"
    assert error_of("actor_rollout_ref.actor.optim.lr=fast").field == "actor_rollout_ref.actor.optim.lr"
    assert "or null" in str(error_of("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=x"))
    assert error_of("data.max_prompt_length=null").field == "data.max_prompt_length"


# (overrides, the key the error names, words its message holds)
SEMANTIC_ERRORS = [
    (["actor_rollout_ref.rollout.n=1"], "actor_rollout_ref.rollout.n", "grpo"),
    (["algorithm.adv_estimator=rloo", "actor_rollout_ref.rollout.n=1"], "actor_rollout_ref.rollout.n", "rloo"),
    (["algorithm.adv_estimator=ppo"], "algorithm.adv_estimator", "unknown"),
    (["algorithm.adv_estimator=gae", "critic.enable=false"], "critic.enable", "reads a critic's values"),
    (["algorithm.adv_estimator=gae", "critic.model.path=null"], "critic.model.path", "needs a model"),
    (["critic.enable=true", "critic.ppo_mini_batch_size=48"], "critic.ppo_mini_batch_size", "must divide"),
    (
        ["algorithm.adv_estimator=gae", "critic.ppo_micro_batch_size_per_gpu=0"],
        "critic.ppo_micro_batch_size_per_gpu",
        ">= 1",
    ),
    (
        ["algorithm.adv_estimator=gae", "critic.forward_micro_batch_size_per_gpu=0"],
        "critic.forward_micro_batch_size_per_gpu",
        ">= 1",
    ),
    (
        ["algorithm.adv_estimator=gae", "critic.use_dynamic_bsz=true", "critic.forward_max_token_len_per_gpu=10"],
        "critic.forward_max_token_len_per_gpu",
        "whole sequence",
    ),
    (["algorithm.adv_estimator=gae", "critic.cliprange_value=0"], "critic.cliprange_value", "> 0"),
    (["algorithm.adv_estimator=gae", "critic.strategy=megatron"], "critic.strategy", "not supported"),
    (["algorithm.adv_estimator=gae", "critic.fsdp.model_dtype=fp16"], "critic.fsdp.model_dtype", "loss scaling"),
    (["algorithm.adv_estimator=gae", "critic.optim.lr=0"], "critic.optim.lr", "> 0"),
    (["algorithm.adv_estimator=gae", "critic.ppo_epochs=0"], "critic.ppo_epochs", ">= 1"),
    (["trainer.critic_warmup=-1"], "trainer.critic_warmup", ">= 0"),
    (
        ["algorithm.adv_estimator=gae", "critic.model.tokenizer_path=/tok"],
        "critic.model.tokenizer_path",
        "actor's tokens",
    ),
    (["critic.enable=true", "critic.model.lora_rank=8"], "critic.model.lora_rank", "not supported"),
    (
        ["data.train_batch_size=60", "actor_rollout_ref.actor.ppo_mini_batch_size=16"],
        "actor_rollout_ref.actor.ppo_mini_batch_size",
        "must divide",
    ),
    (["data.gen_batch_size=96"], "data.gen_batch_size", "without algorithm.filter_groups.enable"),
    (
        ["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=0"],
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
        ">= 1",
    ),
    (
        ["actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=0"],
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu",
        ">= 1",
    ),
    (
        ["actor_rollout_ref.actor.use_dynamic_bsz=true", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=10"],
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu",
        "whole sequence",
    ),
    (
        ["actor_rollout_ref.actor.fsdp_config.model_dtype=fp16"],
        "actor_rollout_ref.actor.fsdp_config.model_dtype",
        "loss scaling",
    ),
    (
        ["actor_rollout_ref.actor.fsdp_config.model_dtype=int8"],
        "actor_rollout_ref.actor.fsdp_config.model_dtype",
        "unknown",
    ),
    (["actor_rollout_ref.actor.strategy=megatron"], "actor_rollout_ref.actor.strategy", "not supported"),
    (["actor_rollout_ref.rollout.name=sglang"], "actor_rollout_ref.rollout.name", "not supported yet"),
    (["trainer.resume_mode=sometimes"], "trainer.resume_mode", "unknown"),
    (["trainer.resume_mode=resume_path"], "trainer.resume_from_path", "must name"),
    (["trainer.resume_from_path=/ckpt/global_step_3"], "trainer.resume_from_path", "resume_mode=resume_path"),
    (["trainer.logger=[console,mlflow]"], "trainer.logger", "not supported"),
    (["trainer.logger=[console,console]"], "trainer.logger", "twice"),
    (["data.truncation=middle_out"], "data.truncation", "unknown"),
    (["+custom_reward_function.reward_kwargs.scale=2"], "custom_reward_function.reward_kwargs", "needs"),
    (["algorithm.rollout_correction.rollout_is=geometric"], "algorithm.rollout_correction.rollout_is", "unknown"),
    (
        ["algorithm.rollout_correction.rollout_is_threshold=0"],
        "algorithm.rollout_correction.rollout_is_threshold",
        "> 0",
    ),
    (
        ["algorithm.rollout_correction.rollout_is_threshold=-2"],
        "algorithm.rollout_correction.rollout_is_threshold",
        "> 0",
    ),
    (
        ["algorithm.rollout_correction.rollout_is_threshold=inf"],
        "algorithm.rollout_correction.rollout_is_threshold",
        "finite",
    ),
    (
        ["algorithm.rollout_correction.rollout_is_threshold=nan"],
        "algorithm.rollout_correction.rollout_is_threshold",
        "finite",
    ),
    (
        ["algorithm.rollout_correction.rollout_is_threshold=0.5_2.0"],
        "algorithm.rollout_correction.rollout_is_threshold",
        "expected a number",
    ),
    (
        ["algorithm.rollout_correction.bypass_mode=true", "algorithm.rollout_correction.rollout_is=token"],
        "algorithm.rollout_correction.rollout_is",
        "would all be 1",
    ),
    (
        ["algorithm.rollout_correction.bypass_mode=true", "actor_rollout_ref.rollout.calculate_log_probs=false"],
        "actor_rollout_ref.rollout.calculate_log_probs",
        "bypass_mode=true",
    ),
    (
        ["algorithm.rollout_correction.rollout_is=sequence", "actor_rollout_ref.rollout.calculate_log_probs=false"],
        "actor_rollout_ref.rollout.calculate_log_probs",
        "rollout_is=sequence",
    ),
    (
        ["algorithm.rollout_correction.rollout_is_batch_normalize=true"],
        "algorithm.rollout_correction.rollout_is_batch_normalize",
        "not supported",
    ),
    (["algorithm.rollout_correction.loss_type=reinforce"], "algorithm.rollout_correction.loss_type", "not supported"),
    (["actor_rollout_ref.actor.kl_loss_type=k9"], "actor_rollout_ref.actor.kl_loss_type", "unknown"),
    (["actor_rollout_ref.actor.loss_agg_mode=mean"], "actor_rollout_ref.actor.loss_agg_mode", "unknown"),
    (
        ["actor_rollout_ref.actor.policy_loss.loss_mode=ppo2"],
        "actor_rollout_ref.actor.policy_loss.loss_mode",
        "unknown",
    ),
    (["actor_rollout_ref.actor.policy_loss.loss_mode=dro"], "actor_rollout_ref.actor.policy_loss.dro_beta", "dro_beta"),
    (
        ["actor_rollout_ref.actor.policy_loss.cov_strategy=magic"],
        "actor_rollout_ref.actor.policy_loss.cov_strategy",
        "unknown",
    ),
    (["actor_rollout_ref.rollout.temperature=0"], "actor_rollout_ref.rollout.temperature", "> 0"),
    (["actor_rollout_ref.rollout.top_p=0"], "actor_rollout_ref.rollout.top_p", "(0, 1]"),
    (
        ["actor_rollout_ref.rollout.val_kwargs.do_sample=true"],
        "actor_rollout_ref.rollout.val_kwargs.temperature",
        "greedy",
    ),
    (["actor_rollout_ref.rollout.response_length=5"], "actor_rollout_ref.rollout.response_length", "must equal"),
    (["algorithm.kl_penalty=full"], "algorithm.kl_penalty", "not supported"),
    (["algorithm.kl_ctrl.type=pid"], "algorithm.kl_ctrl.type", "unknown"),
    (
        ["actor_rollout_ref.actor.optim.lr_scheduler_type=linear"],
        "actor_rollout_ref.actor.optim.lr_scheduler_type",
        "unknown",
    ),
    (["actor_rollout_ref.actor.optim.betas=[0.9]"], "actor_rollout_ref.actor.optim.betas", "two numbers"),
    (
        ["actor_rollout_ref.actor.grad_clip=0.5", "actor_rollout_ref.actor.optim.clip_grad=2.0"],
        "actor_rollout_ref.actor.grad_clip",
        "disagrees",
    ),
    (["trainer.device=tpu"], "trainer.device", "must be cpu, cuda or cuda:N"),
    (["data.train_files=[]"], "data.train_files", "at least one"),
    (["custom_reward_function.name=my_fn"], "custom_reward_function.name", "custom_reward_function.path"),
    (
        ["custom_reward_function.path=a.py", "reward.custom_reward_function.path=b.py"],
        "reward.custom_reward_function.path",
        "set one place",
    ),
]


@pytest.mark.parametrize("overrides, key, words", SEMANTIC_ERRORS)
def test_semantic_errors_name_the_key(overrides, key, words):
    error = error_of(*overrides)
    assert error.field == key
    assert words in str(error)


def test_a_setting_another_decides_gets_a_notice_naming_key_value_and_origin():
    _, notices = load("trainer.total_epochs=15")
    assert notices == [
        "trainer.total_epochs=15 (yours) has no effect: trainer.total_training_steps=100 (the built-in "
        "model's recipe) sets the run's length, as in verl; set trainer.total_training_steps=null to "
        "count epochs"
    ]
    cfg, notices = load(USER_MODEL)  # a model you bring: verl's default estimator, gae, trains a critic
    assert cfg.algorithm.adv_estimator == "gae" and critic_enabled(cfg)
    assert len(notices) == 1 and notices[0].startswith("algorithm.adv_estimator=gae is verl's default")
    assert "critic.model.path=/models/my-model" in notices[0]
    assert load(USER_MODEL, "algorithm.adv_estimator=gae")[1] == []  # chosen: nothing to say


def test_cuda_on_a_machine_without_it_is_named():
    import torch

    if torch.cuda.is_available():  # tests/test_devices.py fakes a machine without CUDA for the message
        assert load("trainer.device=cuda")[0].trainer.device == "cuda"
        return
    with pytest.raises(ConfigError, match="trainer.device") as info:
        load("trainer.device=cuda")
    assert "no CUDA device" in str(info.value)
