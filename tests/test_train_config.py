"""`splitproof train` config: verl-style merging, interpolations, the recipe rule, printing and config files
(errors and notices: tests/test_train_config_errors.py)."""

import dataclasses
import fnmatch
from types import SimpleNamespace

import pytest

from splitproof import LossConfig
from splitproof.rl.config import verl_keys
from splitproof.rl.config.check import GROUP_ESTIMATORS, KNOWN_ESTIMATORS
from splitproof.rl.config.derive import critic_enabled, critic_strategy, dp_strategy, reward_function, to_update_config
from splitproof.rl.config.load import config_dict, dump_config, parse_override, recipe_items
from splitproof.rl.config.schema import BUILTIN_MODEL, TrainConfig, schema_keys

from .config_helpers import USER_MODEL, VERL_LINE, error_of, load


def test_verl_command_line_resolves():
    cfg, notices = load(*VERL_LINE)
    arr = cfg.actor_rollout_ref
    # your own data with the built-in model: the recipe's task keys you did not set fall back to verl's, said so
    assert len(notices) == 2 and "data.max_prompt_length=512, data.max_response_length=512;" in notices[0]
    assert notices[1].startswith("data.val_files=null: ") and cfg.data.val_files is None
    assert cfg.data.train_files == "x.parquet"
    assert cfg.data.train_batch_size == 16
    assert arr.rollout.n == 8
    assert arr.actor.ppo_mini_batch_size == 8
    assert arr.actor.policy_loss.loss_mode == "geo_mean"
    assert cfg.algorithm.adv_estimator == "grpo"
    assert cfg.trainer.total_training_steps == 20
    update = to_update_config(cfg)
    assert update.minibatch_sequences == 64
    assert update.loss.loss_mode == "geo_mean"


def test_verl_grpo_example_script_loads_with_notices():
    """verl's GRPO example script (gsm8k, Qwen2-7B), minus the vLLM backend."""
    args = [
        "algorithm.adv_estimator=grpo",
        "data.train_files=/data/gsm8k/train.parquet",
        "data.val_files=/data/gsm8k/test.parquet",
        "data.train_batch_size=1024",
        "data.max_prompt_length=512",
        "data.max_response_length=1024",
        "data.filter_overlong_prompts=True",
        "data.truncation=error",
        "actor_rollout_ref.model.path=Qwen/Qwen2-7B-Instruct",
        "actor_rollout_ref.actor.optim.lr=1e-6",
        "actor_rollout_ref.model.use_remove_padding=True",
        "actor_rollout_ref.actor.ppo_mini_batch_size=256",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=40",
        "actor_rollout_ref.actor.use_kl_loss=True",
        "actor_rollout_ref.actor.kl_loss_coef=0.001",
        "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
        "actor_rollout_ref.actor.entropy_coeff=0",
        "actor_rollout_ref.model.enable_gradient_checkpointing=True",
        "actor_rollout_ref.actor.fsdp_config.param_offload=False",
        "actor_rollout_ref.actor.fsdp_config.optimizer_offload=False",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=40",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
        "actor_rollout_ref.rollout.gpu_memory_utilization=0.6",
        "actor_rollout_ref.rollout.n=5",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=40",
        "actor_rollout_ref.ref.fsdp_config.param_offload=True",
        "algorithm.use_kl_in_reward=False",
        "trainer.critic_warmup=0",
        'trainer.logger=["console","wandb"]',
        "trainer.project_name=verl_grpo_example_gsm8k",
        "trainer.experiment_name=qwen2_7b_function_rm",
        "trainer.n_gpus_per_node=8",
        "trainer.nnodes=1",
        "trainer.save_freq=20",
        "trainer.test_freq=5",
        "trainer.total_epochs=15",
    ]
    cfg, notices = load(*args)
    noticed = {line.split(":")[0] for line in notices}
    assert noticed == {
        "actor_rollout_ref.actor.fsdp_config.param_offload",
        "actor_rollout_ref.actor.fsdp_config.optimizer_offload",
        "actor_rollout_ref.rollout.tensor_model_parallel_size",
        "actor_rollout_ref.rollout.gpu_memory_utilization",
        "actor_rollout_ref.ref.fsdp_config.param_offload",
        "trainer.n_gpus_per_node",
        "trainer.nnodes",
    }
    assert all("no effect" in line for line in notices)
    arr = cfg.actor_rollout_ref
    assert arr.actor.use_remove_padding is True  # follows model.use_remove_padding
    assert arr.actor.ppo_micro_batch_size_per_gpu == 40
    assert arr.ref.log_prob_micro_batch_size_per_gpu == 40
    assert cfg.trainer.logger == ["console", "wandb"]
    assert cfg.trainer.default_local_dir == "checkpoints/verl_grpo_example_gsm8k/qwen2_7b_function_rm"
    assert arr.rollout.response_length == 1024  # follows data.max_response_length
    assert cfg.data.train_batch_size == 1024 and arr.actor.optim.lr == 1e-6
    assert error_of(*args, "actor_rollout_ref.rollout.name=sglang").field == "actor_rollout_ref.rollout.name"
    assert "not supported yet" in str(error_of(*args, "actor_rollout_ref.rollout.name=sglang"))


def test_hydra_override_forms():
    assert parse_override("+data.seed=3") == ("data.seed", 3)
    assert parse_override("++actor_rollout_ref.actor.optim.lr=1e-5") == ("actor_rollout_ref.actor.optim.lr", 1e-5)
    assert parse_override("trainer.logger=[console,file]") == ("trainer.logger", ["console", "file"])
    assert parse_override("trainer.resume_from_path=null") == ("trainer.resume_from_path", None)
    assert parse_override("trainer.experiment_name=") == ("trainer.experiment_name", "")
    assert parse_override("trainer.experiment_name='007'") == ("trainer.experiment_name", "007")
    assert parse_override("data.apply_chat_template_kwargs={enable_thinking: false}") == (
        "data.apply_chat_template_kwargs",
        {"enable_thinking": False},
    )
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    assert parse_override(f"actor_rollout_ref.model.custom_chat_template={template}")[1] == template
    assert error_of("~data.seed").field == "data.seed"
    assert "key=value" in str(error_of("data.seed"))
    cfg, _ = load("trainer.logger=console", "+data.seed=3", "data.apply_chat_template_kwargs.enable_thinking=false")
    assert cfg.trainer.logger == ["console"]
    assert cfg.data.seed == 3
    assert cfg.data.apply_chat_template_kwargs == {"enable_thinking": False}


def test_spellings_and_combined_keys():
    cfg, _ = load(
        "actor_rollout_ref.actor.fsdp_config.model_dtype=bfloat16",
        "actor_rollout_ref.actor.strategy=fsdp",
        "actor_rollout_ref.actor.optim.clip_grad=0.5",
        "actor_rollout_ref.actor.optim.warmup_style=cosine",
    )
    actor = cfg.actor_rollout_ref.actor
    assert actor.fsdp_config.model_dtype == "bf16"
    assert dp_strategy(cfg) == "fsdp2"
    assert actor.grad_clip == actor.optim.clip_grad == 0.5
    assert to_update_config(cfg).grad_clip == 0.5
    assert actor.optim.lr_scheduler_type == "cosine" and actor.optim.warmup_style is None
    cfg, _ = load("actor_rollout_ref.actor.grad_clip=0.25")
    assert cfg.actor_rollout_ref.actor.optim.clip_grad == 0.25
    cfg, _ = load("actor_rollout_ref.actor.fsdp_config.model_dtype=float64", "actor_rollout_ref.actor.strategy=ddp")
    assert cfg.actor_rollout_ref.actor.fsdp_config.model_dtype == "fp64" and dp_strategy(cfg) == "ddp"


def test_interpolations_follow_unless_set(monkeypatch):
    cfg, _ = load("actor_rollout_ref.model.use_remove_padding=true")
    assert cfg.actor_rollout_ref.actor.use_remove_padding is True
    cfg, _ = load("actor_rollout_ref.model.use_remove_padding=true", "actor_rollout_ref.actor.use_remove_padding=false")
    assert cfg.actor_rollout_ref.actor.use_remove_padding is False
    cfg, _ = load(
        "actor_rollout_ref.actor.ppo_mini_batch_size=16",
        "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean",
        "actor_rollout_ref.actor.strategy=ddp",
        "actor_rollout_ref.actor.use_dynamic_bsz=true",
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=64",
    )
    critic, rollout, ref = cfg.critic, cfg.actor_rollout_ref.rollout, cfg.actor_rollout_ref.ref
    assert (critic.ppo_mini_batch_size, critic.loss_agg_mode, critic.strategy) == (16, "seq-mean-token-mean", "ddp")
    assert critic.use_dynamic_bsz and rollout.log_prob_use_dynamic_bsz and ref.log_prob_use_dynamic_bsz
    assert rollout.log_prob_max_token_len_per_gpu == ref.log_prob_max_token_len_per_gpu == 64
    cfg, _ = load("critic.ppo_micro_batch_size_per_gpu=4")
    assert cfg.critic.forward_micro_batch_size_per_gpu == 4
    monkeypatch.setenv("SPLITPROOF_TEST_RUN", "run7")
    cfg, _ = load(
        "trainer.experiment_name=${oc.env:SPLITPROOF_TEST_RUN}",
        "trainer.project_name=p",
        "data.max_response_length=${data.max_prompt_length}",
    )
    assert cfg.trainer.default_local_dir == "checkpoints/p/run7"
    assert cfg.actor_rollout_ref.rollout.response_length == cfg.data.max_prompt_length
    error = error_of("trainer.experiment_name=${trainer.nothing_here}")
    assert error.field == "trainer.experiment_name" and "interpolation" in str(error)


def test_critic_follows_the_actor_unless_set():
    """verl's rule for the critic (on for gae unless critic.enable says otherwise) and its defaults."""
    grpo, _ = load()
    assert not critic_enabled(grpo)
    cfg, _ = load(
        "algorithm.adv_estimator=gae",
        "actor_rollout_ref.actor.fsdp_config.model_dtype=float64",
        "actor_rollout_ref.actor.strategy=ddp",
        "actor_rollout_ref.model.use_remove_padding=true",
    )
    critic = cfg.critic
    assert critic_enabled(cfg) and critic_strategy(cfg) == "ddp"
    assert (critic.model.path, critic.fsdp.model_dtype, critic.model.use_remove_padding) == (
        BUILTIN_MODEL,
        "fp64",
        True,
    )
    assert critic.ppo_mini_batch_size == cfg.actor_rollout_ref.actor.ppo_mini_batch_size
    cfg, _ = load(
        "algorithm.adv_estimator=gae",
        "critic.fsdp.model_dtype=bfloat16",
        "critic.strategy=fsdp",
        "critic.model.path=~/critic",
        "critic.optim.clip_grad=0.5",
    )
    assert (cfg.critic.fsdp.model_dtype, critic_strategy(cfg)) == ("bf16", "fsdp2")
    assert cfg.critic.model.path.endswith("/critic") and not cfg.critic.model.path.startswith("~")
    assert cfg.critic.grad_clip == 0.5
    cfg, _ = load("critic.enable=true")  # verl trains a critic beside any estimator when asked
    assert critic_enabled(cfg) and cfg.algorithm.adv_estimator == "grpo"


def test_recipe_applies_only_to_the_builtin_model(tmp_path):
    recipe = dict(recipe_items(BUILTIN_MODEL))
    assert recipe["algorithm.adv_estimator"] == "grpo" and recipe_items("/models/x") == []
    builtin, _ = load()
    assert builtin.actor_rollout_ref.model.path == BUILTIN_MODEL
    for key, value in recipe.items():
        node = builtin
        for part in key.split("."):
            node = getattr(node, part)
        assert node == (builtin.data.train_batch_size if value == "${data.train_batch_size}" else value), key
    verl = TrainConfig()
    own, _ = load(USER_MODEL, "algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=4")
    assert own.data.train_batch_size == verl.data.train_batch_size == 1024  # verl's default, not the recipe's 64
    assert own.actor_rollout_ref.actor.optim.lr == 1e-6
    ppo, _ = load(USER_MODEL)  # verl's default estimator, gae: a critic built from the actor's model
    assert ppo.algorithm.adv_estimator == "gae" and critic_enabled(ppo)
    assert ppo.critic.model.path == "/models/my-model" and ppo.critic.optim.lr == 1e-5
    # the rule reads the model path after the file and the overrides
    config = tmp_path / "c.yaml"
    config.write_text("actor_rollout_ref:\n  model:\n    path: /models/mine\ndata:\n  train_batch_size: 32\n")
    cfg, _ = load(f"actor_rollout_ref.model.path={BUILTIN_MODEL}", config_file=str(config))
    assert cfg.data.train_batch_size == 32  # the file wins over the recipe
    assert cfg.actor_rollout_ref.rollout.n == recipe["actor_rollout_ref.rollout.n"]  # the recipe wins over verl
    config.write_text(f"actor_rollout_ref:\n  model:\n    path: {BUILTIN_MODEL}\n")
    cfg, _ = load(USER_MODEL, "algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=4", config_file=str(config))
    assert cfg.data.train_batch_size == 1024


def test_recipe_keys_are_schema_keys():
    keys = schema_keys()
    assert all(key in keys for key, _ in recipe_items(BUILTIN_MODEL))


@pytest.mark.parametrize(
    "overrides",
    [[], VERL_LINE + [USER_MODEL, "actor_rollout_ref.actor.optim.clip_grad=0.3", "trainer.logger=[console]"]],
)
def test_print_config_round_trip(tmp_path, overrides):
    cfg, _ = load(*overrides)
    text = dump_config(cfg)
    path = tmp_path / "printed.yaml"
    path.write_text(text)
    again, notices = load(config_file=str(path))
    assert again == cfg and notices == []
    assert dump_config(again) == text


def test_config_file_layer_and_errors(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(
        "_target_: verl.Something\ndata:\n  _target_: x\n  train_batch_size: 32\n"
        "actor_rollout_ref:\n  actor:\n    ppo_mini_batch_size: 16\n"
    )
    cfg, _ = load("data.train_batch_size=64", config_file=str(path))
    assert cfg.data.train_batch_size == 64 and cfg.actor_rollout_ref.actor.ppo_mini_batch_size == 16
    assert error_of(config_file=str(tmp_path / "missing.yaml")).field == "--config"
    path.write_text("data: [1, 2\n")
    assert "not valid YAML" in str(error_of(config_file=str(path)))
    path.write_text("- a\n- b\n")
    assert "mapping" in str(error_of(config_file=str(path)))
    path.write_text("defaults:\n  - ppo_trainer\n")
    assert "Hydra defaults" in str(error_of(config_file=str(path)))
    path.write_text("data:\n  train_batch_sizes: 8\n")
    assert error_of(config_file=str(path)).field == "data.train_batch_sizes"


def test_update_config_from_actor_keys():
    cfg, _ = load(
        "actor_rollout_ref.rollout.temperature=0.7",
        "actor_rollout_ref.actor.data_loader_seed=5",
        "actor_rollout_ref.actor.policy_loss.loss_mode=clip_cov",
        "actor_rollout_ref.actor.clip_ratio_high=0.28",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.actor.ppo_epochs=2",
    )
    update = to_update_config(cfg)
    assert update.temperature == 0.7
    assert update.loss.seed == 5 and update.data_loader_seed == 5  # Clip-Cov's hash seed
    assert update.loss.loss_mode == "clip_cov" and update.loss.eps_high == 0.28 and update.loss.eps_low == 0.2
    assert (update.ppo_micro_batch_size_per_gpu, update.ppo_epochs, update.rollout_n) == (4, 2, 8)
    shared = {f.name for f in dataclasses.fields(LossConfig)} - {"seed"}
    actor = cfg.actor_rollout_ref.actor
    for name in shared:
        owner = actor.policy_loss if hasattr(actor.policy_loss, name) else actor
        assert getattr(update.loss, name) == getattr(owner, name), name


def test_group_mean_token_mean_is_accepted():
    cfg, _ = load("actor_rollout_ref.actor.loss_agg_mode=group-mean-token-mean")
    assert to_update_config(cfg).loss.loss_agg_mode == "group-mean-token-mean"
    assert cfg.critic.loss_agg_mode == "group-mean-token-mean"  # follows the actor, as in verl


def test_reward_function_from_either_place():
    cfg, _ = load("reward.custom_reward_function.path=r.py")
    assert reward_function(cfg) == ("r.py", "compute_score")
    cfg, _ = load("custom_reward_function.path=pkg://mine.rewards", "custom_reward_function.name=score")
    assert reward_function(cfg) == ("pkg://mine.rewards", "score")
    assert reward_function(load()[0]) == (None, "compute_score")


def test_the_recipes_task_keys_apply_to_builtin_tasks_only():
    cfg, notices = load("data.train_files=builtin://reversal/train")
    assert (cfg.data.train_batch_size, cfg.data.max_prompt_length, cfg.trainer.total_training_steps) == (128, 16, 100)
    assert notices == []
    cfg, notices = load("data.train_files=mine.parquet", "data.train_batch_size=512")
    assert (
        cfg.data.train_batch_size,
        cfg.data.max_prompt_length,
        cfg.actor_rollout_ref.actor.ppo_mini_batch_size,
        cfg.trainer.total_training_steps,
        cfg.data.val_files,
    ) == (512, 512, 256, None, None)
    assert cfg.actor_rollout_ref.actor.optim.lr == 5e-4 and cfg.algorithm.adv_estimator == "grpo"  # the model's keys
    assert (
        "verl's defaults: data.max_prompt_length=512, data.max_response_length=512, "
        "actor_rollout_ref.actor.ppo_mini_batch_size=256, trainer.total_training_steps=null;" in notices[0]
    )
    error = error_of("data.train_files=mine.parquet", "data.train_batch_size=8", "actor_rollout_ref.rollout.n=4")
    assert error.field == "actor_rollout_ref.actor.ppo_mini_batch_size"
    assert str(error).endswith("(actor_rollout_ref.actor.ppo_mini_batch_size=256 is verl's default)")
    error = error_of("actor_rollout_ref.actor.ppo_mini_batch_size=48")
    assert str(error).endswith("(data.train_batch_size=128 is the built-in model's recipe)")


def test_reward_kwargs_and_middle_truncation_are_accepted(tmp_path):
    """verl reads custom_reward_function.reward_kwargs (absent from its yaml: set with +key) and passes them on
    every call; data.truncation=middle keeps the prompt's two ends."""
    from splitproof.rl.rewards.functions import score
    from splitproof.rl.run import reward_function as load_reward

    path = tmp_path / "r.py"
    path.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None, scale=1.0):\n"
        "    return scale * len(solution_str)\n"
    )
    for place in ("custom_reward_function", "reward.custom_reward_function"):
        cfg, _ = load(f"{place}.path={path}", f"+{place}.reward_kwargs.scale=2.5", "data.truncation=middle")
        assert cfg.data.truncation == "middle"
        fn = load_reward(cfg)
        record = SimpleNamespace(uid=0, data_source="x", columns={"ground_truth": "1"}, prompt="p")
        sample = SimpleNamespace(uid=0, index=0, response_ids=[], finished=False)
        tokenizer = SimpleNamespace(decode=lambda ids, skip_special_tokens: "abcd")
        assert score(fn, [record], [sample], tokenizer, step=1, max_steps=1).scores.tolist() == [10.0]


def test_schema_is_verl_tree_plus_documented_additions():
    ours = set(schema_keys())
    assert ours - verl_keys.verl_keys() == {
        "actor_rollout_ref.actor.policy_loss.cov_strategy",
        "trainer.resume_allow_config_change",
        "trainer.seed",
        "trainer.cpu_threads",
        "trainer.cpu_keep_freed_memory",
        "async_training.staleness_steps",
        # verl reads these (get_custom_reward_fn); its yaml has no entry
        "custom_reward_function.reward_kwargs",
        "reward.custom_reward_function.reward_kwargs",
        "actor_rollout_ref.rollout.multi_turn.tool_timeout",
        "actor_rollout_ref.rollout.multi_turn.environment_factory",  # TRL's environment_factory (docs/environments.md)
        "actor_rollout_ref.rollout.multi_turn.verifiers_env",  # a verifiers environment module (docs/environments.md)
        "actor_rollout_ref.rollout.multi_turn.verifiers_env_args",
        # verl's reward managers read these; its scripts add them with +key
        "reward.reward_kwargs",
        "reward_model.reward_kwargs",
        # the reward model's (docs/reward-models.md): verl's older reward_model.* keys and our additions
        "reward.reward_model.chat_template",
        "reward.reward_model.micro_batch_size_per_gpu",
        "reward.reward_model.use_dynamic_bsz",
        "reward.reward_model.forward_max_token_len_per_gpu",
        "reward.reward_model.model_dtype",
        "reward.reward_model.trust_remote_code",
        "reward.reward_model.kind",
        "reward.reward_model.judge.template",
        "reward.reward_model.judge.parser",
        "reward.reward_model.judge.failure_score",
        "reward.reward_model.remote.url",
        "reward.reward_model.remote.model",
        "reward.reward_model.remote.api_key_env",
        "reward.reward_model.remote.timeout_s",
        "reward.reward_model.remote.retries",
        "reward.reward_model.remote.max_concurrent",
        "reward_model.model.input_tokenizer",
        "reward_model.micro_batch_size_per_gpu",
        "reward_model.use_dynamic_bsz",
        "reward_model.forward_max_token_len_per_gpu",
    }
    for pattern in verl_keys.NO_EFFECT:  # every pattern matches a verl key, none of ours
        assert any(fnmatch.fnmatchcase(k, pattern) for k in verl_keys.verl_keys()), pattern
        assert not any(fnmatch.fnmatchcase(k, pattern) for k in ours), pattern
    assert set(GROUP_ESTIMATORS) <= set(KNOWN_ESTIMATORS)


def test_config_dict_is_plain():
    cfg, _ = load()
    plain = config_dict(cfg)
    assert plain["data"]["train_batch_size"] == cfg.data.train_batch_size
    assert isinstance(plain["trainer"]["logger"], list)
