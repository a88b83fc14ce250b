"""The Hydra config composes, overrides apply, the schema rejects unknown keys, and
values that cannot work together are refused with the field and the fix."""

from __future__ import annotations

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from transformers import LlamaConfig

from alignment.compose import Composition, check_overrides, type_algorithm
from alignment.config import register, validate
from alignment.schema import ConfigError
from alignment.training.config import shares_prompts
from parallel.layout import LayoutError
from tests.conftest import ROOT

SMOLLM2 = LlamaConfig(num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, hidden_size=576,
                      intermediate_size=1536, vocab_size=49152, max_position_embeddings=8192)


def cfg(*overrides, name="grpo"):
    """The shipped job ``name`` composed with strict keys and typed by its algorithm's own section, but without
    :func:`alignment.compose.check_read`, so that :func:`alignment.config.validate`'s own checks are reached."""
    register()
    hydra_overrides, keys = check_overrides(list(overrides))
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base=None):
        composed = compose(name, overrides=hydra_overrides)
    type_algorithm(Composition(composed, name, ROOT / "configs" / f"{name}.yaml", user_keys=frozenset(keys)))
    return composed


def test_defaults_and_overrides():
    c = cfg("parallel.tensor_model_parallel_size=3", "algorithm.kl_coef=0.01")
    assert c.parallel.tensor_model_parallel_size == 3 and c.algorithm.kl_coef == 0.01
    assert c.model.path == "smollm2" and c.data.task == "arithmetic" and c.rollout.group_size == 8
    validate(cfg(), world_size=2, hf_config=SMOLLM2)
    validate(c, world_size=6, hf_config=SMOLLM2)
    g = cfg(name="grpo_gsm8k")
    assert g.data.task == "gsm8k" and g.rollout.max_tokens == 256
    validate(g, world_size=2, hf_config=SMOLLM2)


def test_algorithm_variant_configs():
    expected = {"grpo_dr": ("grpo_no_std", "seq-mean-token-sum-norm", None, 0.04),
                "dapo": ("grpo", "token-mean", 0.28, 0.0),
                "rloo": ("rloo", "token-mean", None, 0.04),
                "reinforce_pp": ("reinforce_plus_plus_baseline", "token-mean", None, 0.04),
                "gspo": ("grpo", "seq-mean-token-mean", 4e-4, 0.0),
                "cispo": ("grpo", "token-mean", 0.28, 0.0)}
    for name, (estimator, agg, high, kl) in expected.items():
        c = cfg(name=name)
        a = c.algorithm
        assert (a.advantage_estimator, a.loss_agg_mode, a.clip_ratio_high, a.kl_coef) == (estimator, agg, high, kl)
        assert a.policy_loss == (name if name in ("gspo", "cispo") else "ppo")
        assert c.run_name == f"{name}_smollm2_arithmetic" and c.trainer.steps == 12
        validate(c, world_size=2, hf_config=SMOLLM2)


def test_schema_rejects_unknown_keys_and_bad_types():
    with pytest.raises(ConfigError, match="algorithm.kl_coeff: algorithm.name=grpo has no such key; did you mean "
                                          "algorithm.kl_coef"):
        cfg("algorithm.kl_coeff=0.1")  # typo
    with pytest.raises(ConfigError, match="algorithm.clip_ratio=wide: algorithm.clip_ratio takes a number > 0"):
        cfg("algorithm.clip_ratio=wide")
    with pytest.raises(ConfigError, match="trainer.steps=many: trainer.steps takes an integer"):
        cfg("trainer.steps=many")


def test_layout_refused_before_start():
    with pytest.raises(LayoutError, match="tensor_model_parallel_size=3 does not divide the world size 2"):
        validate(cfg("parallel.tensor_model_parallel_size=3"), world_size=2, hf_config=SMOLLM2)
    # SmolLM2's 9 heads cannot be split by a Ulysses group of 2; ring attention can run them
    with pytest.raises(LayoutError, match=r"cp_comm_type=a2a \(Ulysses\): 9 query heads .* valid Ulysses sizes here: \[\]"):
        validate(cfg("parallel.context_parallel_size=2", "parallel.cp_comm_type=a2a"), world_size=2, hf_config=SMOLLM2)
    validate(cfg("parallel.context_parallel_size=2", "trainer.sequence_packing=true"), world_size=2, hf_config=SMOLLM2)
    with pytest.raises(ConfigError, match="needs trainer.sequence_packing=true"):
        validate(cfg("parallel.pipeline_model_parallel_size=2", "trainer.max_tokens_per_microbatch=1024",
                     "trainer.sequence_packing=false"), world_size=2, hf_config=SMOLLM2)


def test_shared_prompt_packing_is_on_where_it_runs_and_refused_where_it_cannot():
    assert shares_prompts(cfg())  # null: on with context_parallel_size=1, no sequence parallelism
    assert not shares_prompts(cfg("parallel.context_parallel_size=2"))
    assert not shares_prompts(cfg("parallel.tensor_model_parallel_size=2", "parallel.sequence_parallel=true"))
    assert not shares_prompts(cfg("trainer.shared_prompt_packing=false"))
    validate(cfg("parallel.context_parallel_size=2"), world_size=2, hf_config=SMOLLM2)  # null: off there
    with pytest.raises(ConfigError, match="trainer.shared_prompt_packing=true does not run with "
                                          "parallel.context_parallel_size=2"):
        validate(cfg("parallel.context_parallel_size=2", "trainer.shared_prompt_packing=true"), world_size=2,
                 hf_config=SMOLLM2)
    with pytest.raises(ConfigError, match="trainer.shared_prompt_packing=true: algorithm.name=sft does not use it"):
        validate(cfg("trainer.shared_prompt_packing=true", name="sft"), world_size=2, hf_config=SMOLLM2)


@pytest.mark.parametrize("override, world, message", [
    ("rollout.prompts_per_step=3", 2, r"rollout.prompts_per_step=3 must be a multiple of the data-parallel size 2"),
    ("trainer.micro_batch_size=5", 2, r"trainer.micro_batch_size=5 must divide the 32 samples .* \[1, 2, 4, 8, 16, 32\]"),
    ("rollout.group_size=1", 2, r"rollout.group_size=1: GRPO needs at least 2"),
    ("algorithm.kl_estimator=k4", 2, r"algorithm.kl_estimator='k4': valid values are k1, k2, k3, k3_clamped"),
    ("algorithm.advantage_estimator=gae", 2, r"algorithm.advantage_estimator='gae': valid values are grpo, .*rloo"),
    ("algorithm.loss_agg_mode=mean", 2, r"algorithm.loss_agg_mode='mean': valid values are token-mean, seq-mean"),
    ("algorithm.clip_ratio_high=-1", 2, r"clip_ratio_high=-1.0: must be > 0"),
    ("data.task=mmlu", 2, r"data.task='mmlu': valid values are arithmetic, gsm8k"),
    ("rollout.max_model_len=9000", 2, r"rollout.max_model_len=9000 exceeds the model's max_position_embeddings=8192"),
    ("rollout.temperature=0", 2, r"rollout.temperature=0.0: GRPO samples"),
    ("rollout.tensor_parallel_size=3", 2, r"rollout.tensor_parallel_size=3 must divide the world size 2; valid: \[1, 2\]"),
    # SmolLM2 has 9 attention heads: a TP=2 engine cannot split them
    ("rollout.tensor_parallel_size=2", 2, r"rollout.tensor_parallel_size=2 must divide the attention heads \(9\)"),
    ("trainer.max_tokens_per_microbatch=-1", 2, r"trainer.max_tokens_per_microbatch=-1: must be >= 0"),
    ("trainer.max_tokens_per_microbatch=100", 2, r"trainer.max_tokens_per_microbatch=100 is below rollout.max_model_len"),
    ("algorithm.whiten_level=tokens", 2, r"algorithm.whiten_level='tokens': valid values are sequence, token"),
    ("algorithm.policy_loss=grpo", 2, r"algorithm.policy_loss='grpo': valid values are ppo, gspo, cispo"),
    ("algorithm.clip_ratio_c=0.5", 2, r"algorithm.clip_ratio_c=0.5: must be > 1 \(the dual clip, with "
                                      r"algorithm.policy_loss=ppo"),
    ("algorithm.rollout_correction.is_level=tok", 2,
     r"algorithm.rollout_correction.is_level='tok': valid values are null, token, sequence"),
    ("algorithm.rollout_correction.mask_high=0.9", 2, r"algorithm.rollout_correction.mask_low=None / mask_high=0.9"),
    ("trainer.grad_stats_every=-2", 2, r"trainer.grad_stats_every=-2: must be >= 0"),
    ("trainer.max_bad_steps=-1", 2, r"trainer.max_bad_steps=-1: must be >= 0"),
])
def test_invalid_values_name_the_field(override, world, message):
    with pytest.raises(ConfigError, match=message):
        validate(cfg(override), world_size=world, hf_config=SMOLLM2)


def test_max_staleness_needs_importance_weights():
    validate(cfg("rollout.max_staleness=1", "algorithm.rollout_correction.is_level=token"), world_size=2,
             hf_config=SMOLLM2)
    validate(cfg("rollout.max_staleness=2", "algorithm.rollout_correction.is_level=sequence", name="ppo"),
             world_size=2, hf_config=SMOLLM2)
    with pytest.raises(ConfigError, match=r"rollout.max_staleness=1 trains on samples from a policy up to 1 step\(s\) "
                                          r"old, .* set algorithm.rollout_correction.is_level=token"):
        validate(cfg("rollout.max_staleness=1"), world_size=2, hf_config=SMOLLM2)
    with pytest.raises(ConfigError, match=r"rollout.max_staleness=-1: must be >= 0 \(0: on-policy"):
        validate(cfg("rollout.max_staleness=-1"), world_size=2, hf_config=SMOLLM2)


def test_rollout_backend_is_checked():
    validate(cfg("rollout.backend=megatron"), world_size=2, hf_config=SMOLLM2)  # DP=2 replicas: fine
    validate(cfg("rollout.backend=megatron", name="ppo"), world_size=2, hf_config=SMOLLM2)
    with pytest.raises(ConfigError, match=r"rollout.backend='sglang': valid values are vllm, megatron"):
        validate(cfg("rollout.backend=sglang"), world_size=2, hf_config=SMOLLM2)
    even = LlamaConfig(num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, hidden_size=64,
                       intermediate_size=128, vocab_size=49152, max_position_embeddings=8192)
    validate(cfg("rollout.backend=megatron", "parallel.tensor_model_parallel_size=2"), world_size=2,
             hf_config=even)  # TP=2: the two ranks generate together
    with pytest.raises(ConfigError, match=r"rollout.backend=megatron generates on whole, tensor- or expert-parallel "
                                          r"model replicas for now, but pipeline_model_parallel_size=2, "
                                          r"context_parallel_size=2: set those to 1"):
        validate(cfg("rollout.backend=megatron", "parallel.context_parallel_size=2",
                     "parallel.pipeline_model_parallel_size=2"), world_size=4, hf_config=SMOLLM2)
    with pytest.raises(ConfigError, match=r"but sequence_parallel=True"):
        validate(cfg("rollout.backend=megatron", "parallel=tp2_sp"), world_size=2, hf_config=even)
    with pytest.raises(ConfigError, match=r"rollout.tensor_parallel_size=2: rollout.backend=megatron generates with "
                                          r"the trainer's own tensor parallelism"):
        validate(cfg("rollout.backend=megatron", "parallel.tensor_model_parallel_size=2",
                     "rollout.tensor_parallel_size=2"), world_size=2, hf_config=even)


@pytest.mark.parametrize("name", ["sft", "rm", "dpo"])
def test_offline_configs_validate(name):
    validate(cfg(name=name), world_size=2, hf_config=SMOLLM2)  # the shipped job as it is
    with pytest.raises(ConfigError, match="must be a multiple of the data-parallel size 2"):  # and the check is live
        validate(cfg("trainer.global_batch_size=3", name=name), world_size=2, hf_config=SMOLLM2)


def test_offline_config_errors_name_the_field():
    with pytest.raises(ConfigError, match="data.dataset='alpaca_en_demo': algorithm.name=dpo trains on dpo_en_demo"):
        validate(cfg("data.dataset=alpaca_en_demo", name="dpo"), world_size=2, hf_config=SMOLLM2)
    with pytest.raises(ConfigError, match="algorithm.loss_type='dpop'"):
        validate(cfg("algorithm.loss_type=dpop", name="dpo"), world_size=2, hf_config=SMOLLM2)
    with pytest.raises(ConfigError, match="trainer.global_batch_size=15 must be a multiple"):
        validate(cfg("trainer.global_batch_size=15", name="rm"), world_size=2, hf_config=SMOLLM2)
    with pytest.raises(ConfigError, match=r"trainer.micro_batch_size=3 .* valid values: \[1, 2, 4, 8\]"):
        validate(cfg("trainer.micro_batch_size=3", name="sft"), world_size=2, hf_config=SMOLLM2)
    with pytest.raises(ConfigError, match="trainer.offload=true: algorithm.name=dpo uses every model"):
        validate(cfg("trainer.offload=true", name="dpo"), world_size=2, hf_config=SMOLLM2)
    with pytest.raises(ConfigError, match="algorithm.name='ppo2'"):
        validate(cfg("algorithm.name=ppo2"), world_size=2, hf_config=SMOLLM2)
    validate(cfg("algorithm.loss_type=kto", "trainer.global_batch_size=4", "trainer.micro_batch_size=1",
                 "data.heldout_size=4", name="dpo"), world_size=2, hf_config=SMOLLM2)  # 2 pairs per rank: fine
    with pytest.raises(ConfigError, match=r"loss_type=kto .*global_batch_size=2 and data.heldout_size=4 must each be "
                                          r">= 4 at data-parallel size 2"):
        validate(cfg("algorithm.loss_type=kto", "trainer.global_batch_size=2", "trainer.micro_batch_size=1",
                     "data.heldout_size=4", name="dpo"), world_size=2, hf_config=SMOLLM2)
    with pytest.raises(ConfigError, match=r"loss_type=kto .* data.heldout_size=3"):
        validate(cfg("algorithm.loss_type=kto", "data.heldout_size=3", name="dpo"), world_size=2, hf_config=SMOLLM2)


def test_prm_config_needs_the_data_tools_files(tmp_path):
    with pytest.raises(ConfigError, match=rf"data.dataset={tmp_path}: algorithm.name=prm trains on a directory of "
                                          r"step-labelled solutions, but train.jsonl, heldout.jsonl is missing there; "
                                          rf"write them with `python tools/make_prm_data.py --out {tmp_path}`"):
        validate(cfg(f"data.dataset={tmp_path}", name="prm"), world_size=2, hf_config=SMOLLM2)
    (tmp_path / "train.jsonl").write_text("")
    (tmp_path / "heldout.jsonl").write_text("")
    validate(cfg(f"data.dataset={tmp_path}", name="prm"), world_size=2, hf_config=SMOLLM2)
    validate(cfg(f"data.dataset={tmp_path}", "algorithm.supervision=outcome", name="prm"), world_size=2,
             hf_config=SMOLLM2)
    with pytest.raises(ConfigError, match="algorithm.supervision='steps': valid values are process, outcome"):
        validate(cfg(f"data.dataset={tmp_path}", "algorithm.supervision=steps", name="prm"), world_size=2,
                 hf_config=SMOLLM2)
    with pytest.raises(ConfigError, match="algorithm.step_separator is empty"):
        validate(cfg(f"data.dataset={tmp_path}", "algorithm.step_separator=''", name="prm"), world_size=2,
                 hf_config=SMOLLM2)
    with pytest.raises(ConfigError, match="reward.functions is set, but algorithm.name=prm trains on fixed data"):
        validate(cfg(f"data.dataset={tmp_path}", "reward.functions=[{name: length}]", name="prm"), world_size=2,
                 hf_config=SMOLLM2)


def test_profile_fields_are_checked():
    with pytest.raises(ConfigError, match=r"profile.ranks=\[2\]: global ranks of trainers, in \[0, 2\)"):
        validate(cfg("profile.enabled=true", "profile.ranks=[2]"), world_size=2, hf_config=SMOLLM2)
    with pytest.raises(ConfigError, match=r"profile.steps=\[0\]: give 1-based optimizer steps"):
        validate(cfg("profile.enabled=true", "profile.steps=[0]"), world_size=2, hf_config=SMOLLM2)
    validate(cfg("profile.ranks=[5]"), world_size=2, hf_config=SMOLLM2)  # not checked while profiling is off


GROUPS = {"model": ["smollm2", "smollm2_sft_rm"],
          "algorithm": ["grpo", "dr_grpo", "dapo", "rloo", "reinforce_pp", "gspo", "cispo", "ppo", "sft", "rm", "dpo",
                        "rft", "online_dpo", "prm", "distill"],
          "parallel": ["single", "tp2", "tp2_sp", "pp2", "cp2_ring", "cp2_ulysses", "tp2_pp2"],
          "rollout": ["default", "long"], "data": ["arithmetic", "gsm8k", "alpaca_en_demo", "dpo_en_demo",
                                                    "prm_steps", "arithmetic_tools", "file"],
          "cluster": ["local", "slurm_h100x8", "h100_1x8", "h100_4x8"]}


def test_config_groups_list_every_option():
    for group, options in GROUPS.items():
        assert sorted(p.stem for p in (ROOT / "configs" / group).glob("*.yaml")) == sorted(options), group


def test_a_file_of_your_own_needs_its_own_limits():
    """The demo data configs' sizes belong to their demo set: another data.dataset is refused until it
    gets limits of its own; data=file takes the file whole with a hashed 5 % held out."""
    with pytest.raises(ConfigError, match=r"data.dataset=mine.jsonl: this data config's limits were chosen for "
                                          r"dpo_en_demo .* add data=file"):
        validate(cfg("data.dataset=mine.jsonl", name="dpo"), world_size=2, hf_config=SMOLLM2)
    own = cfg("data=file", "data.dataset=mine.jsonl", "data.columns={prompt: q, chosen: a, rejected: b}", name="dpo")
    validate(own, world_size=2, hf_config=SMOLLM2)
    assert own.data.train_size is None and own.data.heldout_fraction == 0.05 and own.data.limits_of is None
    validate(cfg("data.dataset=mine.jsonl", "data.limits_of=null", name="sft"), world_size=2, hf_config=SMOLLM2)
    with pytest.raises(ConfigError, match=r"data.columns has \['response'\]; for preference records"):
        validate(cfg("data=file", "data.dataset=mine.jsonl", "data.columns={response: r}", name="dpo"), world_size=2,
                 hf_config=SMOLLM2)


def test_dict_fields_take_a_whole_dict_on_the_command_line():
    """``data.chat_template_kwargs={enable_thinking: false}`` as the docs write it (an empty typed dict
    in the schema refused every key: Hydra's struct mode)."""
    c = cfg("data.chat_template_kwargs={enable_thinking: false}", "data.columns={prompt: q}")
    assert c.data.chat_template_kwargs == {"enable_thinking": False} and c.data.columns == {"prompt": "q"}


def test_swapping_a_group_takes_its_values_and_keeps_the_rest():
    c = cfg("algorithm=dr_grpo", "parallel=tp2_sp")
    assert c.algorithm.advantage_estimator == "grpo_no_std" and c.algorithm.loss_agg_mode == "seq-mean-token-sum-norm"
    assert c.parallel.tensor_model_parallel_size == 2 and c.parallel.sequence_parallel
    assert c.trainer.steps == 12 and c.run_name == "grpo_smollm2_arithmetic"  # the job's own values stay
    with pytest.raises(LayoutError, match=r"tensor_model_parallel_size=2 must divide the model's 9 attention"):
        validate(c, world_size=6, hf_config=SMOLLM2)  # SmolLM2: 9 heads / 3 KV heads; TP=3 works
    c = cfg("algorithm=dr_grpo", "parallel=tp2_sp", "parallel.tensor_model_parallel_size=3")
    validate(c, world_size=6, hf_config=SMOLLM2)
    g = cfg(name="grpo_gsm8k")  # a job made of other groups
    assert (g.data.task, g.rollout.max_tokens, g.rollout.max_model_len, g.algorithm.kl_coef) == ("gsm8k", 256, 768, 0.04)
    d = cfg(name="dapo")
    assert d.algorithm.clip_ratio_high == 0.28 and d.algorithm.dynamic_sampling and d.data.task == "arithmetic"
    with pytest.raises(LayoutError, match=r"cp_comm_type=a2a \(Ulysses\)"):
        validate(cfg("parallel=cp2_ulysses"), world_size=2, hf_config=SMOLLM2)
    with pytest.raises(ConfigCompositionException, match="tp3"):
        cfg("parallel=tp3")


def test_cluster_group_checks_the_world_size():
    c = cfg("cluster=slurm_h100x8", "parallel.tensor_model_parallel_size=3", "rollout.prompts_per_step=8",
            "parallel.pipeline_model_parallel_size=1")
    assert (c.cluster.nodes, c.cluster.gpus_per_node) == (2, 8)
    validate(cfg("cluster=slurm_h100x8", "rollout.prompts_per_step=16"), world_size=16, hf_config=SMOLLM2)
    with pytest.raises(ConfigError, match=r"cluster.nodes x cluster.gpus_per_node = 2 x 8 = 16 processes, but 8"):
        validate(cfg("cluster=slurm_h100x8"), world_size=8, hf_config=SMOLLM2)
    with pytest.raises(ConfigError, match=r"cluster.nodes=0"):
        validate(cfg("cluster.nodes=0"), world_size=2, hf_config=SMOLLM2)


def test_vocabulary_and_aligned_lengths_are_checked():
    validate(cfg(), world_size=2, hf_config=SMOLLM2, tokenizer_size=49152)
    with pytest.raises(ConfigError, match=r"its tokenizer has 50000 tokens but the model's vocab_size is 49152"):
        validate(cfg(), world_size=2, hf_config=SMOLLM2, tokenizer_size=50000)
    small = LlamaConfig(num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, hidden_size=64,
                        intermediate_size=80, vocab_size=250, max_position_embeddings=510)
    ok = ("rollout.max_model_len=508", "rollout.max_tokens=48")
    validate(cfg(*ok), world_size=2, hf_config=small)  # 508 is already a multiple of 4
    # CP=2 x TP=2 with SP: sequences padded to multiples of 8; 505 -> 512 > 510
    with pytest.raises(ConfigError, match=r"rollout.max_model_len=505 padded to a multiple of 8 .* is 512 > the "
                                          r"model's max_position_embeddings=510; set rollout.max_model_len<=504"):
        validate(cfg("rollout.max_model_len=505", "parallel=cp2_ring", "parallel.tensor_model_parallel_size=2",
                     "parallel.sequence_parallel=true", "trainer.sequence_packing=true"), world_size=4, hf_config=small)
    with pytest.raises(ConfigError, match=r"data.max_length=509 padded to a multiple of 4 .* set data.max_length<=508"):
        validate(cfg("parallel=cp2_ring", "data.max_length=509", name="sft"), world_size=2, hf_config=small)


def test_model_families_and_experts_are_validated_before_start():
    """Qwen3-MoE jobs: expert parallelism checked with the field and valid values; an unsupported
    architecture named with the supported ones; the load-balancing coefficient and the tasks."""
    from transformers import GPT2Config

    from tests.dist.tiny_models import tiny_qwen3_moe_config

    moe = tiny_qwen3_moe_config()  # 4 experts of width 48
    validate(cfg("parallel.expert_model_parallel_size=2", "data.task=length"), world_size=2, hf_config=moe)
    validate(cfg("parallel.expert_model_parallel_size=4"), world_size=4, hf_config=moe)
    with pytest.raises(LayoutError, match=r"parallel.expert_model_parallel_size=3 must divide the model's 4 experts"):
        validate(cfg("parallel.expert_model_parallel_size=3"), world_size=3, hf_config=moe)
    with pytest.raises(LayoutError, match="needs parallel.sequence_parallel=true"):
        validate(cfg("parallel.tensor_model_parallel_size=2"), world_size=2, hf_config=moe)
    with pytest.raises(LayoutError, match="this model has no experts"):
        validate(cfg("parallel.expert_model_parallel_size=2"), world_size=2, hf_config=SMOLLM2)
    with pytest.raises(ConfigError, match="model.moe_aux_loss_coeff=-0.1: must be >= 0"):
        validate(cfg("model.moe_aux_loss_coeff=-0.1"), world_size=2, hf_config=moe)
    with pytest.raises(ConfigError, match=r"model.path=smollm2: model architecture 'GPT2LMHeadModel' is not "
                                          r"supported; supported: .*Qwen3MoeForCausalLM"):
        validate(cfg(), world_size=2, hf_config=GPT2Config(architectures=["GPT2LMHeadModel"]))
    with pytest.raises(ConfigError, match="data.task='poetry': valid values are arithmetic, gsm8k, length"):
        validate(cfg("data.task=poetry"), world_size=2, hf_config=SMOLLM2)
    # routing replay: a MoE model, an old-logprob pass to record (r2), the GRPO step
    validate(cfg("algorithm.routing_replay=r2", "algorithm.num_mini_batches=2"), world_size=2, hf_config=moe)
    with pytest.raises(ConfigError, match=r"algorithm.routing_replay=r2 forces the old-logprob pass's experts .* set "
                                          r"algorithm.ppo_epochs or algorithm.num_mini_batches > 1"):
        validate(cfg("algorithm.routing_replay=r2"), world_size=2, hf_config=moe)
    with pytest.raises(ConfigError, match=r"algorithm.routing_replay=r2: the model is dense"):
        validate(cfg("algorithm.routing_replay=r2", "algorithm.ppo_epochs=2"), world_size=2, hf_config=SMOLLM2)
    # r3: the rollout engine's routing, which both backends record, at EP=2 too (TP=1 for the Megatron engine)
    validate(cfg("algorithm.routing_replay=r3", "rollout.backend=megatron", "parallel.expert_model_parallel_size=2"),
             world_size=2, hf_config=moe)
    validate(cfg("algorithm.routing_replay=r3", "parallel.expert_model_parallel_size=2"), world_size=2, hf_config=moe)
    with pytest.raises(ConfigError, match=r"algorithm.routing_replay=r3 records vLLM's routers' choices through a "
                                          r"Python hook, which a compiled engine skips; leave rollout.enforce_eager unset"):
        validate(cfg("algorithm.routing_replay=r3", "rollout.enforce_eager=false"), world_size=2, hf_config=moe)
    with pytest.raises(ConfigError, match=r"algorithm.routing_replay=r3 .* which episodes played through the rollout "
                                          r"server \(rollout.agent, .*\) do not carry; set algorithm.routing_replay=r2"):
        validate(cfg("algorithm.routing_replay=r3", "rollout.agent=tests.test_agents:chatty"), world_size=2,
                 hf_config=moe)
    with pytest.raises(ConfigError, match=r"algorithm.routing_replay='r9': valid values are none, r2, r3"):
        validate(cfg("algorithm.routing_replay=r9"), world_size=2, hf_config=moe)
    with pytest.raises(ConfigError, match=r"algorithm.routing_replay=r2 is set, but algorithm.name=rft has no such "
                                          r"setting \(it belongs to grpo, distill\)"):  # rft's section has no such key
        cfg("algorithm.routing_replay=r2", name="rft")


def test_environment_settings_are_checked():
    c = cfg(name="grpo_tools")
    assert (c.rollout.environment, c.rollout.max_turns, c.data.generator) == ("tools", 3, "basic_arithmetic")
    validate(c, world_size=2, hf_config=SMOLLM2)
    validate(cfg("rollout.environment=tests.dist.echo_env:build", "rollout.max_turns=3"), world_size=2,
             hf_config=SMOLLM2)
    h = cfg(name="grpo_humaneval")
    assert (h.data.task, h.rollout.eval_pass_k, h.rollout.max_model_len) == ("humaneval", 4, 1024)
    validate(h, world_size=2, hf_config=SMOLLM2)
    with pytest.raises(ConfigError, match="rollout.eval_pass_k=-1"):
        validate(cfg("rollout.eval_pass_k=-1"), world_size=2, hf_config=SMOLLM2)
    bad = {("rollout.environment=chat",): "rollout.environment='chat': valid values are single_turn, tools",
           ("rollout.max_turns=0",): "rollout.max_turns=0: must be >= 1",
           ("rollout.max_turns=1",): "rollout.max_turns>=2",
           ("rollout.tools=[search]",): r"rollout.tools=\['search'\]: give one or more of calculator, python",
           ("rollout.max_tokens_per_turn=500",): r"must be in \[1, rollout.max_tokens=192\]",
           ("rollout.backend=megatron",): "set rollout.backend=vllm",
           ("algorithm=rft",): "set rollout.environment=single_turn",
           ("data.generator=no_such_set",): "is not a reasoning-gym dataset; e.g. .*basic_arithmetic",
           ("rollout.placement=disaggregated", "rollout.rollout_ranks=1"): "set rollout.placement=colocated"}
    for overrides, message in bad.items():
        with pytest.raises(ConfigError, match=message):
            validate(cfg(*overrides, name="grpo_tools"), world_size=3 if "rollout.rollout_ranks=1" in overrides
                     else 2, hf_config=SMOLLM2)
    with pytest.raises(ConfigError, match="data.generator='chain_sum' applies to data.task=arithmetic"):
        validate(cfg("data.task=gsm8k", "data.generator=chain_sum"), world_size=2, hf_config=SMOLLM2)
