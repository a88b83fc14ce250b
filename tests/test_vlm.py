"""Qwen2.5-VL (alignment/models/qwen2_5_vl): M-RoPE positions equal transformers', the family table
maps every checkpoint tensor once and round-trips through TP shards, bad image inputs get one clear
error, rows of a batch keep their images; and on 2 ranks (tests/dist/vlm_worker.py) logits equal
transformers' at TP=1, TP=2+SP, PP=2 and packed, on text and on images of three sizes, with an exact HF
export, and GRPO-loss gradients (vision tower included) equal single-process autograd; the rollout
engine's greedy tokens and sampled logprobs on prompts with images equal transformers' at TP=1 and TP=2.
Qwen3-VL (alignment/models/qwen3_vl: interleaved M-RoPE, DeepStack) passes the same worker cases; its
table, positions and refusals are checked here too, and its LoRA gradients (language model and vision tower)
equal PEFT's at DP=2, TP=2+SP and PP=2."""

from __future__ import annotations

import pytest
import torch

from tests.dist.tiny_models import (
    IMAGE_TOKEN,
    checkpoint_state,
    tiny_qwen2_5_vl,
    tiny_qwen2_5_vl_config,
    tiny_qwen3_config,
    tiny_qwen3_vl,
    tiny_qwen3_vl_config,
    tiny_qwen3_vl_moe,
)
from tests.dist.vlm_worker import (
    CASES,
    ENGINE_CASES,
    GRAD_CASES,
    LORA_CASES,
    MOE_CASES,
    MOE_ENGINE_CASES,
    MOE_GRAD_CASES,
    MOE_RESHARD_CASES,
    RESHARD_CASES,
    micro_batch,
    rows_and_images,
)


@pytest.fixture(scope="module")
def hf():
    return tiny_qwen2_5_vl(seed=0)


def positions_and_transformers(hf):
    """Our M-RoPE positions of the worker's four right-padded rows, transformers' ``get_rope_index``, and
    the real tokens' mask ``[3, rows, seq]``."""
    from alignment.models.families import model_dims
    from alignment.models.qwen2_5_vl.positions import mrope_position_ids

    rows, images = rows_and_images()
    mb = micro_batch(rows, images)
    ids, lengths = mb["input_ids"], mb["seq_lengths"]
    mask = (torch.arange(ids.shape[1]) < lengths[:, None]).long()
    ref, _ = hf.model.get_rope_index(ids, mm_token_type_ids=(ids == IMAGE_TOKEN).int() * mask,
                                     image_grid_thw=mb["image_grid_thw"], attention_mask=mask)
    ours = mrope_position_ids(ids, lengths, mb["image_grid_thw"], model_dims(hf.config))
    return ours, ref, mask.bool().expand(3, -1, -1)


def test_mrope_positions_equal_transformers(hf):
    """Our positions of a right-padded batch (text only, one image, two images of other sizes) equal
    ``Qwen2_5_VLModel.get_rope_index`` at every real token; the image rows really are 3-D."""
    ours, ref, real = positions_and_transformers(hf)
    assert ours.shape == (3, 4, real.shape[2])
    assert torch.equal(ours[real], ref[real])
    assert not torch.equal(ours[0, 2], ours[1, 2])  # height differs from time in the image row
    # text only: plain 1-D positions in all three channels
    assert torch.equal(ours[:, 0, :20], torch.arange(20).expand(3, -1))


def test_mrope_positions_refuse_bad_images(hf):
    from alignment.models.families import model_dims
    from alignment.models.qwen2_5_vl.positions import mrope_position_ids

    d = model_dims(hf.config)
    ids = torch.tensor([[1, 2] + [IMAGE_TOKEN] * 4 + [3]])
    with pytest.raises(ValueError, match="needs 16 placeholder tokens"):
        mrope_position_ids(ids, None, torch.tensor([[1, 8, 8]]), d)
    with pytest.raises(ValueError, match="only 0 image grids"):
        mrope_position_ids(ids, None, None, d)
    with pytest.raises(ValueError, match="2 image grids .* for 1 images"):
        mrope_position_ids(ids, None, torch.tensor([[1, 4, 4], [1, 4, 4]]), d)
    with pytest.raises(ValueError, match="does not divide by the merge size 2"):
        mrope_position_ids(ids, None, torch.tensor([[1, 3, 4]]), d)


def test_table_maps_every_tensor_once_and_round_trips(hf):
    from alignment.models.families import get_bridge, supported_architectures

    state, bridge = checkpoint_state(hf), get_bridge(hf.config)
    made = [n for mg in bridge.megatron_names() for n in bridge.hf_names(mg)]
    assert sorted(made) == sorted(state)  # every tensor of the checkpoint, once: vision tower included
    assert any(n.startswith("visual.blocks.1.") for n in made) and "model.layers.3.self_attn.q_proj.bias" in made
    for mg in bridge.megatron_names():
        back = bridge.to_hf(mg, [bridge.to_megatron_shard(mg, state, j, 2) for j in range(2)])
        assert all(torch.equal(back[k], state[k]) for k in back), mg
    assert bridge.hf_architecture == "Qwen2_5_VLForConditionalGeneration"
    assert "Qwen2_5_VLForConditionalGeneration" in supported_architectures()
    assert "Qwen2_5_VLForSequenceClassification" not in supported_architectures()
    with pytest.raises(ValueError, match="no sequence-classification"):
        get_bridge(hf.config, head="score")


def test_dims_refuse_what_the_model_cannot_run():
    from alignment.models.families import model_dims

    cfg = tiny_qwen2_5_vl_config()
    d = model_dims(cfg)
    assert d.qkv_bias and d.is_vision_language and d.mrope_section == (2, 3, 3) and d.image_token_id == IMAGE_TOKEN
    cfg.text_config.rope_parameters["mrope_section"] = [4, 6, 6]
    with pytest.raises(ValueError, match="mrope_section=\\[4, 6, 6\\] must sum to head_dim / 2 = 8"):
        model_dims(cfg)
    cfg = tiny_qwen2_5_vl_config()
    cfg.vision_config.out_hidden_size = 32
    with pytest.raises(ValueError, match="out_hidden_size=32 must equal the language model's hidden_size=64"):
        model_dims(cfg)


@pytest.mark.slow
def test_logits_equal_transformers_at_every_layout(torchrun_json):
    out = torchrun_json("vlm_worker.py", nproc=2)
    assert sorted(out) == ["qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe"]
    for family, r in out.items():
        moe = family == "qwen3_vl_moe"  # also at EP=2 (its experts over two expert-parallel ranks)
        ref = r["reference"]
        assert ref["logit_std"] > 0.5 and ref["image_effect"] > 0.5, family  # the images move the logits far
        # Qwen3-VL's DeepStack features move them too (Qwen2.5-VL has none)
        assert (ref["deepstack_effect"] > 0.5) if family != "qwen2_5_vl" else ref["deepstack_effect"] == 0.0, ref
        for name in {**CASES, **(MOE_CASES if moe else {})}:
            c = r[name]
            assert c["max_abs_diff"] <= 1e-4, (family, name, c)
            assert c["export_max_abs_diff"] == 0.0 and c["export_missing"] == [], (family, name, c)
        ref = r["grad_reference"]
        assert ref["max_grad"] > 1e-2 and ref["max_vision_grad"] > 1e-3, family  # the loss reaches the vision tower
        for name in {**GRAD_CASES, **(MOE_GRAD_CASES if moe else {})}:
            c = r[name]
            assert abs(c["loss"] - ref["loss"]) <= 1e-5 * max(1.0, abs(ref["loss"])), (family, name, c, ref)
            assert c["missing"] == [] and c["max_grad_diff"] <= 1e-5 * ref["max_grad"] + 1e-7, (family, name, c, ref)
        for name in {**ENGINE_CASES, **(MOE_ENGINE_CASES if moe else {})}:  # rollouts with images: greedy
            # tokens and sampled logprobs == transformers
            c = r[name]
            assert c["greedy_equal"] == [[True] * 4] * 2 and c["tokens"] == [48, 48], (family, name, c)  # per rank
            assert c["images_kept"] == [[False, False, True, True, True, True, False, False]] * 2, (family, name, c)
            assert c["max_logprob_diff"] <= 1e-4, (family, name, c)
        # weight sync: Megatron TP=2+SP / PP=2 -> vLLM TP 1 / 2, the vision tower's tensors (split by vLLM over
        # its TP ranks: fused QKV, merged gate / up, row-parallel projections) == vLLM's own loaders'
        tower = {"qwen2_5_vl": 26, "qwen3_vl": 57, "qwen3_vl_moe": 57}[family]  # Qwen3-VL: biases, position table,
        # 2 DeepStack mergers
        for name in {**RESHARD_CASES, **(MOE_RESHARD_CASES if moe else {})}:
            for vtp in (1, 2):
                assert len(r[f"{name}->vllm_tp{vtp}"]) == 2  # each rank's vLLM TP rank
                for c in r[f"{name}->vllm_tp{vtp}"]:
                    assert c["wrong"] == [] and c["tensors"] == c["expected"] and c["tower_tensors"] == tower, \
                        (family, c)
    # LoRA on the language model and the vision tower (replicated adapters) == PEFT on transformers' Qwen3-VL
    ref = out["qwen3_vl"]["lora_reference"]
    assert ref["tower_tensors"] == 36 and ref["tensors"] == 92 and ref["max_tower_grad"] > 1e-2, ref
    for name in LORA_CASES:
        c = out["qwen3_vl"][name]
        assert abs(c["loss"] - ref["loss"]) <= 1e-5 * max(1.0, abs(ref["loss"])) + 1e-7, (name, c, ref)
        assert c["max_rel_diff"] <= 1e-4, (name, c)


def test_qwen3_vl_table_maps_every_tensor_once_and_positions_equal_transformers():
    """Qwen3-VL's checkpoint names (``model.language_model.*``, ``model.visual.*``: the DeepStack mergers
    included) each come from one Megatron parameter and round-trip through TP shards; its image positions
    are Qwen2.5-VL's, equal to ``Qwen3VLModel.get_rope_index``."""
    from alignment.models.families import get_bridge, supported_architectures

    hf = tiny_qwen3_vl(seed=0)
    state, bridge = checkpoint_state(hf), get_bridge(hf.config)
    made = [n for mg in bridge.megatron_names() for n in bridge.hf_names(mg)]
    assert sorted(made) == sorted(state)
    assert "model.visual.deepstack_merger_list.1.linear_fc2.bias" in made
    assert "model.language_model.layers.3.self_attn.k_norm.weight" in made and "lm_head.weight" in made
    assert bridge.hf_names("vision_model.pos_embed.weight") == ["model.visual.pos_embed.weight"]
    for mg in bridge.megatron_names():
        back = bridge.to_hf(mg, [bridge.to_megatron_shard(mg, state, j, 2) for j in range(2)])
        assert all(torch.equal(back[k], state[k]) for k in back), mg
    assert "Qwen3VLForConditionalGeneration" in supported_architectures()
    tied = get_bridge(tiny_qwen3_vl_config(tie_word_embeddings=True))
    assert tied.hf_names("output_layer.weight") == ["model.language_model.embed_tokens.weight"]
    ours, ref, real = positions_and_transformers(hf)
    assert torch.equal(ours[real], ref[real])


def test_qwen3_vl_moe_reads_and_writes_its_fused_experts():
    """Qwen3-VL-MoE's checkpoints fuse each layer's experts (``experts.gate_up_proj`` ``[E, H, 2F]``,
    ``experts.down_proj`` ``[E, F, H]``); the table names them per expert, as Qwen3-MoE's. Loading reads them from
    either layout about (the released one and transformers 5's in-memory one, which its ``save_pretrained`` writes);
    the export writes the released one (vLLM's), which transformers loads back to the same model; every other
    tensor round-trips exactly."""
    import tempfile

    from safetensors.torch import save_file
    from transformers import AutoModelForImageTextToText
    from transformers.core_model_loading import revert_weight_conversion

    from alignment.models.families import get_bridge, model_dims, supported_architectures
    from alignment.models.fused_experts import FusedExperts

    hf = tiny_qwen3_vl_moe(seed=0)
    bridge, d = get_bridge(hf.config), model_dims(hf.config)
    assert (d.num_experts, d.moe_ffn_hidden_size, d.moe_router_topk, d.moe_norm_topk_prob) == (4, 48, 2, True)
    assert d.moe_layer_pattern == (1, 1, 1, 0) and d.deepstack_layers == 2
    saved = dict(revert_weight_conversion(hf, dict(hf.state_dict())))  # transformers 5.19: in-memory layout
    stem = "model.language_model.layers.1.mlp.experts."
    assert saved[stem + "gate_up_proj"].shape == (4, 96, 64)
    released = bridge.released_checkpoint(saved)
    assert released[stem + "gate_up_proj"].shape == (4, 64, 96) and released[stem + "down_proj"].shape == (4, 48, 64)
    gate_up, down = hf.model.language_model.layers[1].mlp.experts.gate_up_proj, hf.model.language_model.layers[1].mlp.experts.down_proj
    for form in (saved, released):
        view = bridge.checkpoint_view(form)
        assert torch.equal(view[stem + "2.gate_proj.weight"], gate_up[2, :48]) and torch.equal(
            view[stem + "2.up_proj.weight"], gate_up[2, 48:]) and torch.equal(view[stem + "3.down_proj.weight"], down[3])
    per_expert = {}
    view = bridge.checkpoint_view(saved)
    for mg in bridge.megatron_names():
        per_expert.update(bridge.to_hf(mg, [bridge.to_megatron_shard(mg, view, j, 2) for j in range(2)]))
    assert stem + "3.up_proj.weight" in per_expert and stem + "gate_up_proj" not in per_expert
    written = bridge.to_checkpoint(per_expert)
    assert sorted(written) == sorted(released) and all(torch.equal(written[k], released[k]) for k in released)
    with tempfile.TemporaryDirectory() as tmp:
        hf.config.save_pretrained(tmp)
        save_file({k: v.contiguous() for k, v in written.items()}, f"{tmp}/model.safetensors", metadata={"format": "pt"})
        back = AutoModelForImageTextToText.from_pretrained(tmp, dtype=torch.float32).state_dict()
    assert all(torch.equal(back[k], v) for k, v in hf.state_dict().items())
    with pytest.raises(ValueError, match=r"experts \[1\] missing"):
        bridge.to_checkpoint({k: v for k, v in per_expert.items() if ".experts.1." not in k})
    with pytest.raises(ValueError, match="shape \(4, 96, 32\), expected"):
        FusedExperts().view({stem + "gate_up_proj": torch.zeros(4, 96, 32)}, 64)[stem + "0.gate_proj.weight"]
    assert "Qwen3VLMoeForConditionalGeneration" in supported_architectures()


def test_qwen3_vl_interleaved_rope_equals_transformers():
    """The rotary angles of 3-D positions equal transformers' ``Qwen3VLTextRotaryEmbedding`` (cos and sin),
    and differ from Megatron's sectioned M-RoPE (so the interleaving is what is tested)."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import MultimodalRotaryEmbedding
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRotaryEmbedding

    from alignment.models.qwen3_vl.rope import interleaved_mrope
    from parallel import cpu_compat

    cpu_compat.apply()  # Megatron's rotary tables ask for torch.cuda.current_device()
    cfg = tiny_qwen3_vl_config().text_config
    pos = torch.stack([torch.arange(12), torch.arange(12) // 3 + 5, torch.arange(12) % 3 + 5])[:, None, :]  # [3, 1, 12]
    ref_cos, ref_sin = Qwen3VLTextRotaryEmbedding(cfg)(torch.zeros(1), pos)  # [1, 12, 32]
    emb = interleaved_mrope(32, 10000.0)(pos, [6, 5, 5])  # [12, 1, 1, 32]
    assert emb.shape == (12, 1, 1, 32)
    assert torch.allclose(emb[:, 0, 0].cos(), ref_cos[0], atol=1e-6)
    assert torch.allclose(emb[:, 0, 0].sin(), ref_sin[0], atol=1e-6)
    sectioned = MultimodalRotaryEmbedding(kv_channels=32, rotary_percent=1.0, rotary_base=10000.0)(pos, [6, 5, 5])
    assert (sectioned - emb).abs().max() > 0.1


def test_qwen3_vl_dims_and_layouts_refuse_what_the_model_cannot_run():
    from alignment.config import validate
    from alignment.models.families import model_dims
    from alignment.schema import ConfigError
    from tests.test_config import cfg as job

    cfg = tiny_qwen3_vl_config()
    d = model_dims(cfg)
    assert d.qk_layernorm and not d.qkv_bias and d.head_dim == 32 and d.deepstack_layers == 2
    assert d.mrope_section == (6, 5, 5) and d.vision.deepstack_visual_indexes == (0, 1)
    cfg.text_config.rope_parameters["mrope_section"] = [4, 4, 4]
    with pytest.raises(ValueError, match="mrope_section=\\[4, 4, 4\\] must sum to head_dim / 2 = 16"):
        model_dims(cfg)
    cfg = tiny_qwen3_vl_config()
    cfg.vision_config.deepstack_visual_indexes = [0, 5]
    with pytest.raises(ValueError, match="deepstack_visual_indexes=\\[0, 5\\] must name at most 4 .* 3 blocks"):
        model_dims(cfg)
    with pytest.raises(ConfigError, match="pipeline_model_parallel_size=4: the first pipeline stage would hold 1 "
                                          "decoder layers, and DeepStack adds image features to the first 2"):
        validate(job("parallel.pipeline_model_parallel_size=4", name="sft"), world_size=4,
                 hf_config=tiny_qwen3_vl_config())
    validate(job("parallel.pipeline_model_parallel_size=2", name="dpo"), world_size=2, hf_config=tiny_qwen3_vl_config())
    validate(job("model.lora.rank=4", "model.lora.vision_tower=true", name="sft"), world_size=2,
             hf_config=tiny_qwen3_vl_config())
    with pytest.raises(ConfigError, match="model.lora.vision_tower=true: this model has no vision tower"):
        validate(job("model.lora.rank=4", "model.lora.vision_tower=true", name="sft"), world_size=2,
                 hf_config=tiny_qwen3_config())


def test_a_vision_language_students_teacher_must_see_its_images():
    """Distillation: the teacher of a vision-language student is a vision-language model that cuts images as the
    student's processor does (same placeholder, patch, frames and merge); a text student's teacher is free."""
    from alignment.schema import ConfigError
    from launchers.input_checks import check_same_image_input

    student = tiny_qwen3_vl_config()
    check_same_image_input(tiny_qwen3_vl_config(tie_word_embeddings=True), student, "t", "s")
    check_same_image_input(tiny_qwen3_config(), tiny_qwen3_config(), "t", "s")
    with pytest.raises(ConfigError, match="model.teacher_path=t is a text model, but the student .* is a vision"):
        check_same_image_input(tiny_qwen3_config(), student, "t", "s")
    teacher = tiny_qwen3_vl_config()
    teacher.vision_config.patch_size = 8
    with pytest.raises(ConfigError, match="its vision_config.patch_size=8, the student's .* 4"):
        check_same_image_input(teacher, student, "t", "s")
    check_same_image_input(tiny_qwen2_5_vl_config(), student, "t", "s")  # another family, the same image input


def test_select_rows_takes_each_rows_images():
    """Rows picked in any order keep their own images: grids and patch rows follow the new row order."""
    from alignment.data.images import select_rows

    grid = torch.tensor([[1, 2, 2], [1, 2, 4], [1, 4, 2]])  # 4, 8 and 8 patches
    pixels = torch.arange(20).float()[:, None].expand(20, 3)
    batch = {"input_ids": torch.arange(4)[:, None].expand(4, 5), "image_counts": torch.tensor([0, 2, 0, 1]),
             "image_grid_thw": grid, "pixel_values": pixels}
    out = select_rows(batch, torch.tensor([3, 1]))
    assert out["input_ids"][:, 0].tolist() == [3, 1] and out["image_counts"].tolist() == [1, 2]
    assert out["image_grid_thw"].tolist() == [[1, 4, 2], [1, 2, 2], [1, 2, 4]]
    assert out["pixel_values"][:, 0].tolist() == list(range(12, 20)) + list(range(0, 12))
    none = select_rows(batch, torch.tensor([0, 2]))
    assert none["image_grid_thw"].shape == (0, 3) and none["pixel_values"].shape == (0, 3)
    with pytest.raises(ValueError, match="image_counts sum to 3 images, image_grid_thw has 2"):
        select_rows({**batch, "image_grid_thw": grid[:2]}, torch.tensor([0]))


def test_jobs_a_vision_language_model_cannot_run_yet_are_refused():
    """PPO, disaggregated vLLM rollouts, multi-turn episodes, prompt trees, context parallelism over packed
    micro-batches and a vLLM TP size the tower's heads cannot split are refused before start, naming the field;
    SFT at CP=2 on padded rows, SFT and DPO at TP=2 with sequence parallelism and PP=2, GRPO on Megatron's
    engine and on a colocated vLLM pass, GRPO's prompt trees resolved off."""
    from alignment.config import job_config, resolve_for_model, validate
    from alignment.training.config import shares_prompts
    from alignment.schema import ConfigError
    from tests.test_config import cfg

    hf = tiny_qwen2_5_vl_config()
    with pytest.raises(ConfigError, match="is a vision-language model: algorithm.name=ppo is not supported for it "
                                          "yet; use one of grpo, rft, online_dpo, distill, sft, dpo"):
        validate(cfg(name="ppo"), world_size=2, hf_config=hf)
    with pytest.raises(ConfigError, match="rollout.placement=disaggregated: a vision-language model's vLLM rollouts"):
        validate(cfg("rollout.placement=disaggregated", "rollout.rollout_ranks=1"), world_size=2, hf_config=hf)
    with pytest.raises(ConfigError, match=r"rollout.tensor_parallel_size=4 must divide the vision tower's attention "
                                          r"heads \(2\)"):  # the language model's 4 heads would split
        validate(cfg("rollout.tensor_parallel_size=4"), world_size=4, hf_config=hf)
    validate(cfg("rollout.tensor_parallel_size=2"), world_size=2, hf_config=hf)  # vLLM rollouts with images
    grpo = ("rollout.backend=megatron",)
    with pytest.raises(ConfigError, match="rollout.environment=tools, rollout.max_turns=2: a vision-language"):
        validate(cfg(*grpo, "rollout.environment=tools", "rollout.max_turns=2"), world_size=2, hf_config=hf)
    with pytest.raises(ConfigError, match="trainer.shared_prompt_packing=true: a vision-language model's M-RoPE"):
        validate(cfg(*grpo, "trainer.shared_prompt_packing=true"), world_size=2, hf_config=hf)
    for packing in ("true", "false"):  # context parallelism, packed or on padded rows
        validate(cfg("parallel.context_parallel_size=2", f"trainer.sequence_packing={packing}", name="sft"),
                 world_size=2, hf_config=hf)
    validate(cfg("parallel.tensor_model_parallel_size=2", "parallel.sequence_parallel=true", name="sft"),
             world_size=2, hf_config=hf)
    validate(cfg("parallel.pipeline_model_parallel_size=2", name="dpo"), world_size=2, hf_config=hf)
    c = job_config(cfg(*grpo, "parallel.tensor_model_parallel_size=2"))
    assert shares_prompts(c)
    validate(c, world_size=2, hf_config=hf)  # resolves the model's defaults first (resolve_for_model)
    assert not shares_prompts(c) and not shares_prompts(resolve_for_model(c, hf))


def test_ranks_prompts_merge_only_with_the_same_images():
    """A vLLM engine over several ranks generates each distinct prompt list once: two lists of one question
    text showing different images of one size are different requests; the same ids and images are one."""
    from alignment.data.images import ImageInputs
    from alignment.rollout.engines.image_prompts import ImagePrompt
    from alignment.rollout.engines.vllm_engine import same_prompts

    grid = torch.tensor([[1, 4, 4]])
    a, b = torch.zeros(16, 96), torch.ones(16, 96)
    ids = [1, 2] + [IMAGE_TOKEN] * 4 + [3]
    assert [ImagePrompt(ids, ImageInputs(a, grid))] == [ImagePrompt(ids, ImageInputs(b, grid))]  # equal as ids
    assert not same_prompts([ImagePrompt(ids, ImageInputs(a, grid))], [ImagePrompt(ids, ImageInputs(b, grid))])
    assert same_prompts([ImagePrompt(ids, ImageInputs(a, grid)), [5, 6]],
                        [ImagePrompt(ids, ImageInputs(a.clone(), grid.clone())), [5, 6]])
    assert not same_prompts([ImagePrompt(ids, ImageInputs(a, grid))], [list(ids)])  # images vs none
    assert not same_prompts([[5, 6]], [[5, 7]]) and same_prompts([[5, 6]], [[5, 6]])
