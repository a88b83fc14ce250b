"""Vision-language data and jobs: a Qwen2.5-VL made from a text model keeps its logits on text; image
records (TRL's messages with image parts + ``images``) tokenise with each image's placeholder repeated
to its token count, and every bad image input is one clear error; the synthetic shape-count task's
answers are what its images show; and real SFT and DPO jobs on a tiny VLM train, evaluate held-out
images and export a directory transformers loads with its image processor."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from alignment.algorithms.config import PreferenceConfig, SFTConfig
from tests.conftest import Job, run_jobs
from tests.dist.tiny_models import save_tiny_vlm_dir


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory):
    return save_tiny_vlm_dir(tmp_path_factory.mktemp("vlm") / "vlm")


@pytest.fixture(scope="module")
def qwen3_vlm_dir(tmp_path_factory):
    return save_tiny_vlm_dir(tmp_path_factory.mktemp("vlm3") / "vlm", family="qwen3_vl")


@pytest.fixture(scope="module")
def qwen3_moe_vlm_dir(tmp_path_factory):
    return save_tiny_vlm_dir(tmp_path_factory.mktemp("vlm3moe") / "vlm", family="qwen3_vl_moe")


@pytest.fixture(scope="module")
def qwen3_vlm_teacher(tmp_path_factory):
    return save_tiny_vlm_dir(tmp_path_factory.mktemp("vlm3_teacher") / "vlm", seed=1, family="qwen3_vl")


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    from alignment.data.image_tasks import write_task

    root = tmp_path_factory.mktemp("task")
    write_task(root, train=24, heldout=8, seed=0)
    return root


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe"])
def test_vlm_from_text_keeps_the_text_models_logits(family, request):
    """A Qwen2.5-VL made from a Llama, a Qwen3-VL made from a Qwen3 and a Qwen3-VL-MoE made from a Qwen3-MoE
    (its experts written fused, in the released layout) give the text model's logits on text (their M-RoPE is
    plain RoPE there) and render image parts as Qwen2-VL's template does."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer

    vlm_dir = request.getfixturevalue({"qwen2_5_vl": "vlm_dir", "qwen3_vl": "qwen3_vlm_dir",
                                       "qwen3_vl_moe": "qwen3_moe_vlm_dir"}[family])
    if family == "qwen3_vl_moe":  # [experts, H, 2F] and [experts, F, H] (H 64, F 48), as vLLM reads them
        with safe_open(str(vlm_dir / "model.safetensors"), "pt") as f:
            stem = "model.language_model.layers.0.mlp.experts."
            assert f.get_slice(stem + "gate_up_proj").get_shape() == [4, 64, 96]
            assert f.get_slice(stem + "down_proj").get_shape() == [4, 48, 64]
    assert AutoModelForImageTextToText.from_pretrained(vlm_dir).config.model_type == family
    text = AutoModelForCausalLM.from_pretrained(f"{vlm_dir}_text", dtype=torch.float32).eval()
    vlm = AutoModelForImageTextToText.from_pretrained(vlm_dir, dtype=torch.float32).eval()
    ids = torch.randint(0, 1000, (2, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = text(ids).logits, vlm(input_ids=ids).logits
    assert a.std() > 0.5 and torch.equal(a, b[..., : a.shape[-1]])
    tok = AutoTokenizer.from_pretrained(vlm_dir)
    rendered = tok.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Q"}]}],
                                       add_generation_prompt=True, tokenize=False)
    assert rendered == "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Q<|im_end|>\n<|im_start|>assistant\n"


def _data(d, **kw):
    return SimpleNamespace(dataset=str(d), heldout_size=2, heldout_files=None, heldout_fraction=0.0, columns={},
                           train_size=None, max_length=64, max_prompt_length=48, **kw)


def test_image_records_tokenise_with_their_placeholders(vlm_dir, task):
    from transformers import AutoConfig, AutoTokenizer

    from alignment.data.examples import tokenize_split
    from alignment.data.images import ImageProcessor

    cfg, tok = AutoConfig.from_pretrained(vlm_dir), AutoTokenizer.from_pretrained(vlm_dir)
    images = ImageProcessor(vlm_dir, cfg.image_token_id)
    rows = tokenize_split(_data(task / "train.jsonl"), SFTConfig(name="sft"), tok, "train", images)
    assert len(rows) == 22  # 24 records, the last 2 held out
    ids, prompt_len, inputs = rows[0][0]
    assert inputs.image_grid_thw.tolist() == [[1, 6, 6]] and inputs.pixel_values.shape == (36, 3 * 2 * 14 * 14)
    assert ids.count(cfg.image_token_id) == 9  # 84x84 pixels: 6x6 patches, merged 2x2
    first = ids.index(cfg.image_token_id)
    assert ids[first - 1] == cfg.vision_start_token_id and ids[first + 9] == cfg.vision_end_token_id
    record = json.loads((task / "train.jsonl").read_text().splitlines()[0])
    assert tok.decode(ids[prompt_len:]) == record["answer"] + "<|im_end|>"
    # DPO pairs keep the prompt's images on both rows
    pairs = task / "pairs.jsonl"
    pairs.write_text(json.dumps({"prompt": record["prompt"], "images": record["images"], "chosen": "1",
                                 "rejected": "2"}) + "\n" + "".join(json.dumps({"prompt": f"no image {i}", "chosen": "a",
                                                                                 "rejected": "b"}) + "\n" for i in range(2)))
    (chosen, rejected), (text_chosen, _) = tokenize_split(SimpleNamespace(**{**vars(_data(pairs)), "heldout_size": 1}),
                                                          PreferenceConfig(name="dpo"), tok, "train", images)
    assert chosen[2] is rejected[2] and chosen[:2] != rejected[:2] and len(text_chosen) == 2  # a text row: no images


def test_bad_image_inputs_are_one_clear_error(vlm_dir, task, tmp_path):
    from transformers import AutoConfig, AutoTokenizer

    from alignment.data.examples import tokenize_split
    from alignment.data.images import ImageProcessor

    cfg, tok = AutoConfig.from_pretrained(vlm_dir), AutoTokenizer.from_pretrained(vlm_dir)
    images = ImageProcessor(vlm_dir, cfg.image_token_id)
    record = json.loads((task / "train.jsonl").read_text().splitlines()[0])
    (tmp_path / "broken.png").write_bytes(b"not a png")

    def error(changes: dict, data=None, processor=images):
        path = tmp_path / "bad.jsonl"
        lines = []
        for i in range(3):  # three distinct records (their questions differ), the first one bad
            user = {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": f"question {i}"}]}
            lines.append(json.dumps({**record, "messages": [user, record["messages"][1]], **changes}))
        path.write_text("\n".join(lines) + "\n")
        with pytest.raises((ValueError, FileNotFoundError)) as e:
            tokenize_split(data or _data(path), SFTConfig(name="sft"), tok, "train", processor)
        return str(e.value)

    assert error({"images": ["missing.png"]}) == f"{tmp_path}/bad.jsonl:1: image {tmp_path}/missing.png does not exist"
    msg = error({"images": [str(tmp_path / "broken.png")]})
    assert msg.startswith(f"{tmp_path}/bad.jsonl:1: image {tmp_path}/broken.png cannot be decoded (UnidentifiedImageError")
    assert "1 image parts in the messages and 2 files in 'images'" in error({"images": ["a.png", "b.png"]})
    assert "the record has images, but model.path is a text model" in error({}, processor=None)
    big = {"images": [str(task / record["images"][0])]}
    msg = error(big, data=SimpleNamespace(**{**vars(_data(tmp_path / "bad.jsonl")), "max_prompt_length": 12}))
    assert "the prompt takes 23 tokens (9 for its 1 images), more than data.max_prompt_length=12" in msg


def test_prompt_files_with_images_for_rl(vlm_dir, task, tmp_path):
    """An RL job's prompt files (TRL's ``prompt`` messages with image parts + ``images``): each problem knows
    its image files (resolved against its file), the same question about another image is another prompt,
    the instruction ends the last text part, a prompt's length counts its images' tokens, prompts become
    ``ImagePrompt`` s with the placeholders expanded, and bad images are named before start."""
    from transformers import AutoConfig, AutoTokenizer

    from alignment.data.config import DataConfig
    from alignment.data.image_tasks import QUESTION
    from alignment.data.images import ImageProcessor
    from alignment.data.prompts import PromptStyle, build_prompt_ids, job_prompts, prompt_length, prompt_messages
    from alignment.rollout.config import RolloutConfig
    from alignment.rollout.engines.image_prompts import ImagePrompt, image_prompts

    cfg, tok = AutoConfig.from_pretrained(vlm_dir), AutoTokenizer.from_pretrained(vlm_dir)
    images = ImageProcessor(vlm_dir, cfg.image_token_id)
    d = DataConfig(train_files=str(task / "train.jsonl"), heldout_files=str(task / "heldout.jsonl"))
    sets = job_prompts(d, 0, tok, RolloutConfig(max_model_len=64, max_tokens=8), images)
    assert len(sets.train) == 24 and len(sets.heldout) == 8  # 3 questions, 24 images: no prompt dropped as a repeat
    p = sets.train[0]
    record = json.loads((task / "train.jsonl").read_text().splitlines()[0])
    assert p.images == (str(task / record["images"][0]),) and p.answer == record["answer"]
    assert p.question in {QUESTION.format(colour=c) for c in ("red", "green", "blue")}
    parts = prompt_messages(p, PromptStyle(instruction="Be brief."))[-1]["content"]
    assert parts[0] == {"type": "image"} and parts[1]["text"] == p.question + "\nBe brief."
    ids = build_prompt_ids(tok, p)
    assert ids.count(cfg.image_token_id) == 1 and prompt_length(tok, p, PromptStyle(), images) == len(ids) + 8
    text = sets.train[1].__class__("What is 2 + 2?", "4", "file")
    [image_prompt, plain] = image_prompts(images, [p, text], [ids, [1, 2, 3]])
    assert isinstance(image_prompt, ImagePrompt) and image_prompt.count(cfg.image_token_id) == 9
    assert image_prompt.images.image_grid_thw.tolist() == [[1, 6, 6]] and plain == [1, 2, 3]
    with pytest.raises(ValueError, match="shows images, but the model is a text model"):
        image_prompts(None, [p], [ids])
    with pytest.raises(ValueError, match=r"data.train_files: the longest prompt has \d+ tokens"):
        job_prompts(d, 0, tok, RolloutConfig(max_model_len=len(ids) + 12, max_tokens=8), images)
    missing = tmp_path / "missing.jsonl"
    missing.write_text(json.dumps({**record, "images": ["nowhere.png"]}) + "\n")
    with pytest.raises(FileNotFoundError, match=f"prompt .*: image {tmp_path}/nowhere.png does not exist"):
        job_prompts(DataConfig(train_files=str(missing)), 0, tok, RolloutConfig(max_model_len=64, max_tokens=8), images)


def test_shape_count_answers_are_what_the_images_show(task):
    """Count, in every image, the grid cells holding pixels of the asked colour: the record's answer."""
    import numpy as np
    from PIL import Image

    from alignment.data.image_tasks import COLOURS, GRID

    for split, n in (("train", 24), ("heldout", 8)):
        records = [json.loads(line) for line in (task / f"{split}.jsonl").read_text().splitlines()]
        assert len(records) == n
        for r in records:
            colour = next(c for c in COLOURS if f" {c} " in r["prompt"][0]["content"][1]["text"])
            pixels = np.asarray(Image.open(task / r["images"][0]))
            cell = pixels.shape[0] // GRID
            hits = (np.abs(pixels.astype(int) - COLOURS[colour]).sum(-1) < 10)
            count = sum(hits[i * cell:(i + 1) * cell, j * cell:(j + 1) * cell].any()
                        for i in range(GRID) for j in range(GRID))
            assert str(count) == r["answer"], r
    train = {r["images"][0] for r in map(json.loads, (task / "train.jsonl").read_text().splitlines())}
    assert all(name.startswith("images/train/") for name in train)
    # DPO pairs: the true count chosen, a count one off rejected, the same prompt and image
    from alignment.data.image_tasks import write_pairs

    records = [json.loads(line) for line in (task / "train.jsonl").read_text().splitlines()]
    pairs = [json.loads(line) for line in write_pairs(task, "train").read_text().splitlines()]
    assert len(pairs) == len(records)
    for r, p in zip(records, pairs):
        assert (p["prompt"], p["images"], p["chosen"]) == (r["prompt"], r["images"], r["answer"])
        assert abs(int(p["rejected"]) - int(p["chosen"])) == 1 and int(p["rejected"]) >= 0


GRPO = ["rollout.backend=megatron", "rollout.group_size=4", "rollout.prompts_per_step=4", "rollout.max_tokens=6",
        "rollout.eval_max_tokens=4", "rollout.temperature=1.0", "trainer.micro_batch_size=4", "trainer.steps=3",
        "trainer.lr=1e-3", "trainer.progress_bar=false", "trainer.save_checkpoint=false", "trainer.export_hf=false",
        "data.prompt_key=prompt",
        "reward.functions=[{name: numeric}, {name: chars, function: 'tests.reward_fns:reply_length', weight: 0.1}]"]


@pytest.mark.slow
def test_sft_dpo_and_grpo_jobs_on_a_vision_language_model(vlm_dir, task, tmp_path):
    """One launch on the tiny VLM over the shape-count images: SFT (TP=2 with sequence parallelism, packed), DPO
    (DP=2) and SFT at CP=2 (packed) all lower their held-out loss, and the SFT export loads in transformers with
    its image processor and answers the held-out questions. GRPO with Megatron's engine, full fine-tuning at TP=2
    with packed micro-batches, and LoRA on the language model and the vision tower at DP=2 (the reference is the
    base under the adapters, no second model): every step's samples come from the trained weights with their
    images, so fp32 ``token_mult_prob_error`` is 1; the held-out accuracy is measured before and after."""
    from alignment.evaluation.image_answers import image_task_accuracy

    pairs = task / "sft_dpo_pairs.jsonl"
    records = [json.loads(line) for line in (task / "train.jsonl").read_text().splitlines()]
    pairs.write_text("".join(json.dumps({"prompt": r["prompt"], "images": r["images"],
                                         "chosen": r["answer"], "rejected": str(int(r["answer"]) + 1)}) + "\n"
                             for r in records))
    common = [f"data.dataset={task / 'train.jsonl'}", "data=file", "data.heldout_fraction=0",
              f"data.heldout_files={task / 'heldout.jsonl'}", "data.max_length=64", "data.max_prompt_length=48",
              "trainer.progress_bar=false", "trainer.lr=1e-3", "trainer.global_batch_size=8",
              "trainer.micro_batch_size=2", "trainer.steps=3", "trainer.save_checkpoint=false"]
    sft = Job("sft", vlm_dir, tmp_path / "sft", [*common, "parallel.tensor_model_parallel_size=2",
                                                 "parallel.sequence_parallel=true"])
    # the rejected answer is always one more than the chosen: learnable, but not in one epoch (the held-out loss
    # then moved either way with the split, which hashes the prompt and its image paths: relative here, so fixed)
    dpo = Job("dpo", vlm_dir, tmp_path / "dpo", [*common, f"data.dataset={pairs}", "data.heldout_files=null",
                                                 "data.heldout_fraction=0.25", "algorithm.beta=0.5", "trainer.epochs=4"])
    sft_cp = Job("sft", vlm_dir, tmp_path / "sft_cp", [*common, "parallel.context_parallel_size=2",
                                                       "trainer.sequence_packing=true", "trainer.export_hf=false"])
    data = [*GRPO, f"data.train_files={task / 'train.jsonl'}", f"data.heldout_files={task / 'heldout.jsonl'}"]
    full = Job("grpo", vlm_dir, tmp_path / "grpo", [*data, "parallel.tensor_model_parallel_size=2",
                                                    "trainer.sequence_packing=true"])
    lora = Job("grpo", vlm_dir, tmp_path / "grpo_lora", [*data, "model.lora.rank=4", "model.lora.vision_tower=true",
                                                         "trainer.lr=1e-2"])
    s, d, c, full, lora = run_jobs(sft, dpo, sft_cp, full, lora)
    assert s["heldout_after"]["loss"] < s["heldout_before"]["loss"] - 0.5, s
    # context parallelism over packed micro-batches: each CP rank fills its own placeholders with their image
    # features, and Megatron's thd rotary takes each rank's share of the whole stream's M-RoPE angles
    assert c["heldout_after"]["loss"] < c["heldout_before"]["loss"] - 0.5, c
    assert d["heldout_after"]["loss"] < d["heldout_before"]["loss"], d
    exported = tmp_path / "sft" / "hf"
    assert (exported / "preprocessor_config.json").exists()
    result = image_task_accuracy(exported, task / "heldout.jsonl", max_new_tokens=2)
    assert result["questions"] == 8 and all(a["response"] for a in result["answers"])
    for g in (full, lora):
        h = g["history"]
        assert len(h) == 3, g
        for m in h:  # the fp32 engine samples with the trained weights and the same images, step after step
            assert 1.0 <= m["token_mult_prob_error"] < 1.0 + 1e-4, m
            assert m["reward/numeric/scored"] == 1.0 and m["reward/std"] > 0 and m["grad_norm"] > 1e-3, m
        assert g["heldout_size"] == 8 and 0.0 <= g["heldout_accuracy_after"] <= 1.0, g
    kl = [m["kl"] for m in lora["history"]]
    assert kl[0] == 0.0 and kl[-1] > 1e-3, kl  # the adapters move the policy off the shared base


@pytest.mark.slow
def test_jobs_on_a_qwen3_vl(qwen3_vlm_dir, qwen3_vlm_teacher, qwen3_moe_vlm_dir, task, tmp_path):
    """One launch on a tiny Qwen3-VL (interleaved M-RoPE, DeepStack into decoder layers 0 and 1): SFT at PP=2
    (DeepStack's layers on the first stage) lowers the held-out loss and exports a ``Qwen3VLForConditionalGeneration``
    that transformers loads and runs on the held-out images; GRPO at TP=2 samples on Megatron's engine, and at
    TP=1 with LoRA (the tower's too) on a vLLM engine of TP=2 over both ranks (images through
    ``multi_modal_data``, the merged tower synced and checked), with fp32 ``token_mult_prob_error`` 1; RFT and online DPO sample answers to prompts with images and train on them with
    their images (a micro-batch whose prompts lost their images is an error: ``multimodal_inputs``); on-policy
    distillation from another Qwen3-VL, which scores the student's answers with the same images, brings the
    forward KL to it down; and GRPO on a tiny Qwen3-VL-MoE at EP=2 with its rollouts on vLLM keeps
    ``token_mult_prob_error`` at 1 with every engine parameter (the fused experts too) checked."""
    from alignment.evaluation.image_answers import image_task_accuracy

    common = ["data.max_length=64", "data.max_prompt_length=48", "trainer.progress_bar=false", "trainer.lr=1e-3",
              "trainer.save_checkpoint=false"]
    sft = Job("sft", qwen3_vlm_dir, tmp_path / "sft", [
        *common, f"data.dataset={task / 'train.jsonl'}", "data=file", "data.heldout_fraction=0",
        f"data.heldout_files={task / 'heldout.jsonl'}", "trainer.global_batch_size=8", "trainer.micro_batch_size=2",
        "trainer.steps=3", "parallel.pipeline_model_parallel_size=2"])
    grpo = Job("grpo", qwen3_vlm_dir, tmp_path / "grpo", [
        *GRPO, f"data.train_files={task / 'train.jsonl'}", f"data.heldout_files={task / 'heldout.jsonl'}",
        "trainer.steps=2", "parallel.tensor_model_parallel_size=2"])
    rl = [f"data.train_files={task / 'train.jsonl'}", f"data.heldout_files={task / 'heldout.jsonl'}",
          "rollout.backend=megatron", "rollout.group_size=4", "rollout.prompts_per_step=4", "rollout.max_tokens=4",
          "rollout.eval_max_tokens=4", "rollout.temperature=1.0", "trainer.micro_batch_size=4", "trainer.steps=2",
          "trainer.lr=1e-3", "trainer.progress_bar=false", "trainer.save_checkpoint=false", "trainer.export_hf=false",
          "data.prompt_key=prompt", "reward.functions=[{name: chars, function: 'tests.reward_fns:reply_length'}]"]
    vllm = Job("grpo", qwen3_vlm_dir, tmp_path / "grpo_vllm", [
        *[o for o in GRPO if o != "rollout.backend=megatron"], f"data.train_files={task / 'train.jsonl'}",
        f"data.heldout_files={task / 'heldout.jsonl'}", "trainer.steps=2", "rollout.backend=vllm",
        "rollout.tensor_parallel_size=2", "rollout.check_weight_sync=true", "model.lora.rank=4",
        "model.lora.vision_tower=true", "trainer.lr=1e-2"])
    rft = Job("rft", qwen3_vlm_dir, tmp_path / "rft", [*rl, "algorithm.accept_threshold=0.5"])
    odpo = Job("online_dpo", qwen3_vlm_dir, tmp_path / "online_dpo", rl)
    kd = Job("distill", qwen3_vlm_dir, tmp_path / "distill", [
        *rl, f"model.teacher_path={qwen3_vlm_teacher}", "trainer.steps=3", "trainer.eval_before=false",
        "algorithm.distill_loss=forward_kl", "algorithm.task_reward_weight=0", "trainer.lr=1e-2"])
    moe = Job("grpo", qwen3_moe_vlm_dir, tmp_path / "grpo_moe", [
        *[o for o in GRPO if o not in ("rollout.backend=megatron", "trainer.export_hf=false")],
        f"data.train_files={task / 'train.jsonl'}", f"data.heldout_files={task / 'heldout.jsonl'}", "trainer.steps=2",
        "rollout.backend=vllm", "parallel.expert_model_parallel_size=2", "rollout.check_weight_sync=true",
        "model.lora.rank=4", "trainer.lr=1e-2"])
    s, g, v, r, o, k, e = run_jobs(sft, grpo, vllm, rft, odpo, kd, moe)
    assert s["heldout_after"]["loss"] < s["heldout_before"]["loss"] - 0.5, s
    exported = tmp_path / "sft" / "hf"
    assert json.loads((exported / "config.json").read_text())["architectures"] == ["Qwen3VLForConditionalGeneration"]
    result = image_task_accuracy(exported, task / "heldout.jsonl", max_new_tokens=2)
    assert result["questions"] == 8 and all(a["response"] for a in result["answers"])
    assert len(g["history"]) == 2, g
    for m in g["history"]:
        assert 1.0 <= m["token_mult_prob_error"] < 1.0 + 1e-4, m
        assert m["reward/numeric/scored"] == 1.0 and m["reward/std"] > 0 and m["grad_norm"] > 1e-3, m
    # vLLM TP=2 over both ranks, LoRA on the language model and the tower: the merged weights (W + B A, the
    # tower's split as vLLM splits it) pass the weight check after every sync (all 79 parameters), and the
    # samples come from each rank's own images (the ranks' prompts of one question text differ only in their
    # images: merged by token ids alone, the error was 1.017)
    assert len(v["history"]) == 2 and v["heldout_size"] == 8, v
    for m in v["history"]:
        assert 1.0 <= m["token_mult_prob_error"] < 1.0 + 1e-4 and m["weight_sync/checked"] == 79, m
    assert v["history"][-1]["kl"] > 1e-4, v  # the adapters moved the policy, and the engine followed
    assert [m["rft/kept"] > 0 and m["grad_norm"] > 0 for m in r["history"]] == [True, True], r
    assert [m["online_dpo/pairs"] > 0 and m["grad_norm"] > 0 for m in o["history"]] == [True, True], o
    for job in (r, o):
        assert job["heldout_size"] == 8 and 0.0 <= job["heldout_accuracy_after"] <= 1.0, job
    div = [m["distill/divergence"] for m in k["history"]]  # KL(teacher || student) over the whole vocabulary
    assert len(div) == 3 and div[0] > 0.1 and div[-1] < 0.9 * div[0], div  # measured 0.70, 0.68, 0.42
    assert all(1.0 <= m["token_mult_prob_error"] < 1.0 + 1e-4 for m in k["history"]), k
    # Qwen3-VL-MoE at EP=2 (two experts per rank) with LoRA on every linear, the experts' too, rollouts with images
    # on vLLM: the merged experts resharded from both ranks into vLLM's fused MoE pass the weight check (all 83
    # parameters), the trainer's logprobs == vLLM's; the export writes the experts fused (the adapters merged in),
    # and no PEFT directory (PEFT would drop the experts' adapters)
    assert len(e["history"]) == 2, e
    for m in e["history"]:
        assert 1.0 <= m["token_mult_prob_error"] < 1.0 + 1e-4 and m["weight_sync/checked"] == 83, m
        assert m["moe/load_imbalance"] >= 1.0 and m["grad_norm"] > 1e-3, m
    assert e["history"][-1]["kl"] > 1e-4, e
    from safetensors.torch import load_file

    base, trained = load_file(qwen3_moe_vlm_dir / "model.safetensors"), load_file(tmp_path / "grpo_moe" / "hf" / "model.safetensors")
    fused = "model.language_model.layers.0.mlp.experts.gate_up_proj"
    assert trained[fused].shape == base[fused].shape == (4, 64, 96) and sorted(trained) == sorted(base)
    assert (trained[fused] - base[fused]).abs().max() > 1e-4
    assert not (tmp_path / "grpo_moe" / "hf_adapter").exists()


def test_processor_files_travel_with_an_export(vlm_dir, tmp_path):
    """The image processor's config (and only the processor files) is copied beside an export's weights."""
    from transformers import AutoImageProcessor

    from alignment.training.checkpoint import copy_processor_files

    export = tmp_path / "export"
    export.mkdir()
    copy_processor_files(vlm_dir, export)
    assert sorted(p.name for p in export.iterdir()) == ["preprocessor_config.json"]
    assert AutoImageProcessor.from_pretrained(str(export)).merge_size == 2
    copy_processor_files(None, tmp_path / "none")  # a text model's export: nothing to copy
    assert not (tmp_path / "none").exists()
