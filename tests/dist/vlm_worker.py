"""torchrun worker: Qwen2.5-VL and Qwen3-VL on Megatron-Core equal transformers.

    torchrun --nproc-per-node 2 tests/dist/vlm_worker.py [FAMILY ...] OUT.json

Logits (fp32, full vocabulary) of a tiny random Qwen2.5-VL loaded from its HF checkpoint form, at
TP=1 (DP=2), TP=2 with sequence parallelism, PP=2, and packed (``thd``) at TP=1 and TP=2+SP, against
transformers' logits of every row run on its own: a micro-batch of two text rows, then one with a
16-token image (8x8 patches), a 24-token image (8x12) and a 4-token image (4x4) in two rows. The HF
export must give every checkpoint tensor back exactly. GRPO-loss gradients of every parameter (the
vision tower's too) at DP=2, TP=2+SP, PP=2 and packed equal plain autograd on transformers' model.
The rollout engine (``rollout.backend=megatron``) at TP=1 and TP=2 on prompts with images and without,
of different lengths (a longer prompt's images reach the model in the decode steps): its greedy tokens
equal greedy decoding with transformers, and its sampled tokens' logprobs equal transformers' logprobs
of prompt + response. Qwen3-VL (interleaved M-RoPE, DeepStack into decoder layers 0 and 1, head_dim
32 x 4 heads != hidden 64) runs every case as Qwen2.5-VL. The resharder's vLLM tensors (the tower's too) from
TP=2+SP and PP=2 into vLLM TP 1 and 2 equal vLLM's own loaders'. Writes {family: {case: {...}}}.
"""

from __future__ import annotations

import sys

import torch

from alignment.models.families import get_bridge, model_dims
from alignment.models.gpt import build_gpt_model, transformer_config
from alignment.models.weights import export_hf_weights, load_hf_weights
from alignment.training.megatron_step import forward_backward
from parallel.layout import ParallelLayout, validate_model_layout
from parallel.state import env_world, init_distributed
from tests.dist.grpo_invariance_worker import hf_reference
from tests.dist.grpo_invariance_worker import megatron_case as grpo_case
from tests.dist.report import every_rank, worst_over_ranks, write_results_and_shutdown, exit_now
from tests.dist.tiny_models import IMAGE_TOKEN, checkpoint_state, tiny_qwen2_5_vl, tiny_qwen3_vl, tiny_qwen3_vl_moe

MODELS = {"qwen2_5_vl": tiny_qwen2_5_vl, "qwen3_vl": tiny_qwen3_vl,  # family: tiny random model(seed)
          "qwen3_vl_moe": tiny_qwen3_vl_moe}


def L(tp=1, pp=1, packing=False, cp=1, comm="p2p", ep=1):  # noqa: N802 - a layout
    return dict(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, sequence_parallel=tp > 1,
                context_parallel_size=cp, cp_comm_type=comm, expert_model_parallel_size=ep), packing


CASES = {"tp1": L(), "tp2_sp": L(tp=2), "pp2": L(pp=2), "tp1_packed": L(packing=True),
         "tp2_sp_packed": L(tp=2, packing=True), "cp2": L(cp=2), "cp2_packed": L(cp=2, packing=True),
         "ulysses2_packed": L(cp=2, packing=True, comm="a2a")}
# a vision-language MoE (Qwen3-VL-MoE) also runs these: experts over two expert-parallel ranks
MOE_CASES = {"ep2": L(ep=2), "ep2_packed": L(ep=2, packing=True)}
MOE_GRAD_CASES = {"grad/ep2": (L(ep=2)[0], 2, False)}
MOE_ENGINE_CASES = {"engine/ep2": dict(expert_model_parallel_size=2)}
MOE_RESHARD_CASES = {"reshard/ep2": L(ep=2)[0]}
GRIDS = [(1, 8, 8), (1, 8, 12), (1, 4, 4)]  # patch grids: 16, 24 and 4 merged tokens


def rows_and_images(seed: int = 2):
    """Four rows (text only; one image; two images; text only) as token-id lists, and per row its images'
    (pixel_values [patches, 96], grid [1, 3]) in order."""
    g = torch.Generator().manual_seed(seed)

    def text(n):
        return torch.randint(0, 240, (n,), generator=g).tolist()

    def image(grid):
        t, h, w = grid
        return [IMAGE_TOKEN] * (t * h * w // 4), (torch.randn(t * h * w, 96, generator=g), torch.tensor([grid]))

    rows, images = [text(20)], [[]]
    tok, img = image(GRIDS[0])
    rows.append(text(3) + tok + text(6))
    images.append([img])
    tok1, img1 = image(GRIDS[1])
    tok2, img2 = image(GRIDS[2])
    rows.append(text(2) + tok1 + text(3) + tok2 + text(2))
    images.append([img1, img2])
    rows.append(text(15))
    images.append([])
    return rows, images


def micro_batch(rows, images):
    """Right-padded ``input_ids`` / ``seq_lengths`` and the rows' images concatenated in order."""
    seq = max(map(len, rows))
    ids = torch.zeros(len(rows), seq, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, :len(r)] = torch.tensor(r)
    mb = {"input_ids": ids, "seq_lengths": torch.tensor([len(r) for r in rows])}
    flat = [im for ims in images for im in ims]
    if flat:
        mb["pixel_values"] = torch.cat([p for p, _ in flat])
        mb["image_grid_thw"] = torch.cat([gr for _, gr in flat])
    return mb


def hf_logits(hf, row, images) -> torch.Tensor:
    """transformers' logits ``[len, vocab]`` of one row with its images."""
    ids = torch.tensor([row])
    kw = {}
    if images:
        kw = dict(pixel_values=torch.cat([p for p, _ in images]), image_grid_thw=torch.cat([g for _, g in images]),
                  mm_token_type_ids=(ids == IMAGE_TOKEN).int())
    with torch.no_grad():
        return hf(input_ids=ids, **kw).logits[0]


def megatron_case(hf, mbs, world, sizes, packing):
    """Every micro-batch's full-vocabulary logits ``[rows, seq, vocab]`` (last stage; None elsewhere)
    and the export's largest difference and missing names."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    cfg, state = hf.config, checkpoint_state(hf)
    validate_model_layout(ParallelLayout(world_size=world, **sizes), model_dims(cfg))
    init_distributed(ParallelLayout(world_size=world, **sizes))
    bridge = get_bridge(cfg)
    model = build_gpt_model(cfg, transformer_config(cfg, **sizes)).eval()
    load_hf_weights(model, state, bridge)
    vocab = cfg.get_text_config().vocab_size

    def full_logits(logits, target_ids):
        return {"logits": gather_from_tensor_model_parallel_region(logits)[..., :vocab]}

    with torch.no_grad():
        out = forward_backward(model, mbs, lambda mb, o: (o["logits"].sum() * 0, o), outputs=full_logits,
                               forward_only=True, packing=packing)
    exported = export_hf_weights(model, bridge)
    export_diff = max((exported[k] - state[k]).abs().max().item() for k in exported)
    logits = [o["logits"] for o in out] if ps.is_pipeline_last_stage() else None
    return logits, export_diff, sorted(set(state) - set(exported))


GRAD_CASES = {"grad/dp2": (L()[0], 1, False), "grad/tp2_sp": (L(tp=2)[0], 2, False), "grad/pp2": (L(pp=2)[0], 2, False),
              "grad/dp2_packed": (L()[0], 2, True), "grad/cp2": (L(cp=2)[0], 2, False),
              "grad/cp2_packed": (L(cp=2)[0], 2, True)}  # (sizes, rows, packing)


def grpo_batch(rows, images) -> dict:
    """The four rows as one GRPO batch: the last 5 tokens of each row the response (text), ``old_delta``
    (old logprobs off the current ones, so ratios differ from 1), ``ref_logprobs`` and ``advantages``,
    and the images with ``image_counts``."""
    g = torch.Generator().manual_seed(9)
    batch = micro_batch(rows, images)
    n, seq = batch["input_ids"].shape
    mask = torch.zeros(n, seq)
    for i, r in enumerate(rows):
        mask[i, len(r) - 6: len(r) - 1] = 1.0  # position t scores token t + 1
    batch.update(response_mask=mask, old_delta=0.3 * torch.randn(n, seq, generator=g),
                 ref_logprobs=-5.5 + 0.5 * torch.randn(n, seq, generator=g), advantages=torch.randn(n, generator=g),
                 image_counts=torch.tensor([len(ims) for ims in images]))
    return batch


def grad_cases(world: int, hf, rows, images, cases: dict = GRAD_CASES) -> dict:
    """GRPO-loss gradients of every parameter (vision tower included) through Megatron against plain
    autograd on transformers' model over the whole batch in one process."""
    batch = grpo_batch(rows, images)
    ids = batch["input_ids"]
    ref_loss, ref_grads = hf_reference(hf, batch, pixel_values=batch["pixel_values"],
                                       image_grid_thw=batch["image_grid_thw"],
                                       mm_token_type_ids=(ids == IMAGE_TOKEN).int())
    ref_grads = checkpoint_state(hf, ref_grads)
    max_grad = max(g.abs().max().item() for g in ref_grads.values())
    vision_grad = max(g.abs().max().item() for k, g in ref_grads.items() if "visual." in k)
    results = {"grad_reference": {"loss": ref_loss, "max_grad": max_grad, "max_vision_grad": vision_grad}}
    state = checkpoint_state(hf)
    for name, (sizes, mbs, packing) in cases.items():
        loss, grads = grpo_case(hf, batch, world, mbs, state=state, packing=packing, **sizes)
        results[name] = {"loss": loss, "missing": sorted({k for r in every_rank(sorted(set(ref_grads) - set(grads)))
                                                          for k in r}),
                         "max_grad_diff": worst_over_ranks(max((grads[k] - ref_grads[k]).abs().max().item()
                                                               for k in ref_grads if k in grads))}
    return results


LORA_CASES = {"lora/dp2": (L()[0], 1), "lora/tp2_sp": (L(tp=2)[0], 2), "lora/pp2": (L(pp=2)[0], 2)}
TOWER_TARGETS = ["qkv", "proj", "linear_fc1", "linear_fc2"]  # Qwen3-VL's tower: attention, MLPs, mergers


def lora_cases(world: int, hf, rows, images) -> dict:
    """GRPO-loss gradients of LoRA adapters on the language model's linears and every linear of the vision
    tower (``model.lora.vision_tower``: replicated adapters) through Megatron against PEFT on transformers'
    model with the same adapters (random A and B), PEFT-named both sides. Qwen3-VL only: its checkpoint
    names are transformers' module names, which PEFT's adapters follow."""
    import copy
    import dataclasses

    from tests.dist import lora_parity_worker as lp

    spec = dataclasses.replace(lp.SPEC, replicated_modules=("vision_model",))
    targets = lp.TARGETS + TOWER_TARGETS
    values = lp.adapter_values(hf, targets)
    batch = grpo_batch(rows, images)
    linears = r".*\.(%s)$" % "|".join(lp.TARGETS + ["attn.qkv", "attn.proj", "linear_fc1", "linear_fc2"])  # no patch_embed
    ref_loss, ref_grads = hf_reference(lp.peft_wrapped(copy.deepcopy(hf), values, linears), batch,
                                       pixel_values=batch["pixel_values"], image_grid_thw=batch["image_grid_thw"],
                                       mm_token_type_ids=(batch["input_ids"] == IMAGE_TOKEN).int())
    want = lp.expected(ref_grads)
    tower = [k for k in want if ".visual." in k]
    results = {"lora_reference": {"loss": ref_loss, "tensors": len(want), "tower_tensors": len(tower),
                                  "max_tower_grad": max(want[k].abs().max().item() for k in tower)}}
    state = checkpoint_state(hf)
    for name, (sizes, mbs) in LORA_CASES.items():
        loss, grads = grpo_case(hf, batch, world, mbs, state=state, lora=spec, adapters=values, **sizes)
        results[name] = {"loss": loss, **lp.compare(grads, want)}
    return results


ENGINE_CASES = {"engine/tp1": L()[0], "engine/tp2": dict(tensor_model_parallel_size=2)}
EOS = 249  # never among the rows' tokens


def engine_prompts(rows, images):
    """The four rows as engine prompts: :class:`ImagePrompt` s for the rows with images."""
    from alignment.data.images import ImageInputs
    from alignment.rollout.engines.image_prompts import ImagePrompt

    return [ImagePrompt(r, ImageInputs(torch.cat([p for p, _ in ims]), torch.cat([g for _, g in ims]))) if ims
            else list(r) for r, ims in zip(rows, images)]


def hf_response_logprobs(hf, row, images, response) -> tuple[torch.Tensor, int]:
    """transformers' logprobs of ``response`` after ``row`` (the images marked in the prompt only), and
    its greedy next token after the whole sequence."""
    ids = torch.tensor([row + response])
    kw = {}
    if images:
        marks = torch.zeros_like(ids)
        marks[0, :len(row)] = (ids[0, :len(row)] == IMAGE_TOKEN).int()
        kw = dict(pixel_values=torch.cat([p for p, _ in images]), image_grid_thw=torch.cat([g for _, g in images]),
                  mm_token_type_ids=marks)
    with torch.no_grad():
        logits = hf(input_ids=ids, **kw).logits[0].float()
    logp = torch.log_softmax(logits[:, :250], dim=-1)
    picked = logp[len(row) - 1: len(row) + len(response) - 1].gather(1, torch.tensor(response)[:, None])[:, 0]
    return picked, int(logits[-1, :250].argmax())


def hf_greedy(hf, row, images, steps: int) -> list[int]:
    """Greedy decoding with transformers' full forward at every step."""
    out = []
    for _ in range(steps):
        _, nxt = hf_response_logprobs(hf, row, images, out)
        out.append(nxt)
        if nxt == EOS:
            break
    return out


def engine_cases(hf, world, rows, images, cases: dict = ENGINE_CASES) -> dict:
    """Greedy tokens and sampled logprobs of the Megatron engine against transformers."""
    from alignment.data.samples import SamplingConfig
    from alignment.rollout.engines.megatron_engine import MegatronEngine

    cfg, state = hf.config, checkpoint_state(hf)
    prompts = engine_prompts(rows, images)
    greedy_ref = [hf_greedy(hf, r, ims, 6) for r, ims in zip(rows, images)]
    results = {}
    for name, sizes in cases.items():
        init_distributed(ParallelLayout(world_size=world, **sizes))
        model = build_gpt_model(cfg, transformer_config(cfg, **sizes)).eval()
        load_hf_weights(model, state, get_bridge(cfg))
        engine = MegatronEngine(model, None, eos_token_id=EOS, vocab_size=250, max_model_len=64, max_batch_size=8,
                                seed=3)
        greedy = engine.generate(prompts, SamplingConfig(n=1, temperature=0.0, max_tokens=6))
        sampled = engine.generate(prompts, SamplingConfig(n=2, temperature=1.0, max_tokens=6))
        diff, tokens = 0.0, 0
        for r, ims, group in zip(rows, images, sampled):
            for s in group:
                ref, _ = hf_response_logprobs(hf, r, ims, s.response_ids)
                diff = max(diff, (torch.tensor(s.logprobs) - ref).abs().max().item())
                tokens += len(s.response_ids)
        ranks = every_rank({"greedy_equal": [g[0].response_ids == ref for g, ref in zip(greedy, greedy_ref)],
                            "images_kept": [s.images is not None for g in sampled for s in g], "tokens": tokens})
        results[name] = {**{k: [r[k] for r in ranks] for k in ranks[0]},  # each rank's engine, in rank order
                         "max_logprob_diff": worst_over_ranks(diff)}
        engine.close()
    return results


RESHARD_CASES = {"reshard/tp2_sp": L(tp=2)[0], "reshard/pp2": L(pp=2)[0]}


def reshard_cases(hf, world, cases: dict = RESHARD_CASES) -> dict:
    """The resharder (:class:`parallel.reshard.Resharder`) from Megatron TP=2+SP and PP=2 into vLLM TP 1 and 2:
    every vLLM tensor of this rank's vLLM TP rank, the vision tower's included, equals what vLLM's own
    weight loaders put there from the checkpoint (:func:`alignment.rollout.engines.weight_check.vllm_reference_shard`)."""
    from parallel.reshard import Resharder
    from alignment.rollout.engines.weight_check import vllm_reference_shard

    cfg, state = hf.config, checkpoint_state(hf)
    bridge, rank = get_bridge(cfg), torch.distributed.get_rank()
    results = {}
    for name, sizes in cases.items():
        init_distributed(ParallelLayout(world_size=world, **sizes))
        model = build_gpt_model(cfg, transformer_config(cfg, **sizes)).eval()
        load_hf_weights(model, state, bridge)
        for vtp in (1, 2):
            resharder = Resharder(model, bridge.vllm_layout(sizes.get("tensor_model_parallel_size", 1), vtp), vllm_tp=vtp,
                                  bucket_bytes=16 << 10)
            wrong, tensors, tower = [], 0, 0
            for bucket in resharder.buckets():
                for vname, tensor in bucket:
                    want = vllm_reference_shard(bridge, state, vname, vtp, rank % vtp)
                    tensors, tower = tensors + 1, tower + vname.startswith("visual.")
                    if tensor.shape != want.shape or not torch.equal(tensor, want):
                        wrong.append(vname)
            results[f"{name}->vllm_tp{vtp}"] = every_rank({  # rank 1's vLLM TP rank as well as rank 0's
                "wrong": wrong[:4], "tensors": tensors, "tower_tensors": tower,
                "expected": len(bridge.vllm_tensors(1, vtp, rank % vtp))})
    return results


def deepstack_effect(hf, row, images) -> float:
    """How far DeepStack moves transformers' logits of ``row`` (0.0 for a model without it)."""
    lm = hf.model.language_model
    if not hasattr(lm, "_deepstack_process"):
        return 0.0
    full = hf_logits(hf, row, images)
    lm._deepstack_process = lambda hidden, mask, embeds: hidden
    try:
        return (hf_logits(hf, row, images) - full).abs().max().item()
    finally:
        del lm._deepstack_process


def family_cases(hf, world: int) -> dict:
    """Every case for one tiny model ``hf``."""
    rows, images = rows_and_images()
    groups = [[0, 3], [1, 2]]  # a micro-batch without images, one with three (equal rows: PP's fixed shapes)
    mbs = [micro_batch([rows[i] for i in grp], [images[i] for i in grp]) for grp in groups]
    refs = [[hf_logits(hf, rows[i], images[i]) for i in grp] for grp in groups]
    text_only = hf_logits(hf, rows[1], [])  # the image row with its placeholders left as tokens
    results = {"reference": {"logit_std": torch.cat([r for grp in refs for r in grp]).std().item(),
                             "image_effect": (refs[1][0] - text_only).abs().max().item(),
                             "deepstack_effect": deepstack_effect(hf, rows[1], images[1])}}
    moe = hf.config.model_type.endswith("_moe")
    for name, (sizes, packing) in {**CASES, **(MOE_CASES if moe else {})}.items():
        logits, export_diff, missing = megatron_case(hf, mbs, world, sizes, packing)
        diff = 0.0
        if logits is not None:
            diff = max((logits[m][j, :len(rows[i])] - refs[m][j]).abs().max().item()
                       for m, grp in enumerate(groups) for j, i in enumerate(grp))
        results[name] = {"max_abs_diff": worst_over_ranks(diff), "export_max_abs_diff": worst_over_ranks(export_diff),
                         "export_missing": sorted({k for r in every_rank(missing) for k in r})}
    results.update(grad_cases(world, hf, rows, images, {**GRAD_CASES, **(MOE_GRAD_CASES if moe else {})}))
    results.update(engine_cases(hf, world, rows, images, {**ENGINE_CASES, **(MOE_ENGINE_CASES if moe else {})}))
    results.update(reshard_cases(hf, world, {**RESHARD_CASES, **(MOE_RESHARD_CASES if moe else {})}))
    if hf.config.model_type == "qwen3_vl":
        results.update(lora_cases(world, hf, rows, images))
    return results


def main(path: str, families: list[str]) -> None:
    _, world, _ = env_world()
    write_results_and_shutdown(path, {f: family_cases(MODELS[f](seed=1), world) for f in families})


if __name__ == "__main__":
    main(sys.argv[-1], sys.argv[1:-1] or list(MODELS))
    exit_now()
