"""torchrun worker for tools/convert_checkpoint.py.

    convert_worker.py import SRC OUT TP PP          # the tool's import
    convert_worker.py export CKPT HF_OUT TP PP      # the tool's export
    convert_worker.py reshape CKPT OUT TP PP        # the tool's reshape
    convert_worker.py logits CKPT TP PP OUT.pt      # load a converted checkpoint at TP x PP, save its logits
    convert_worker.py random HF_DIR OUT TP PP OUT.pt  # a model with its OWN random weights saved as a
                                                      # converted checkpoint, and its logits
    convert_worker.py chain WORKDIR HF_DIR...       # per HF dir, in one launch: import at EP 2 (expert
                                                    # models) or TP 2, reshape to TP 2 x EP 2 with expert
                                                    # TP 1 (or PP 2), export at PP 2 -> WORKDIR/<i>/hf
Logits are of :data:`INPUT_IDS`, full vocabulary, written by rank 0 from the last stage.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from tools import convert_checkpoint as cc
from tests.dist.report import exit_now

INPUT_IDS = torch.tensor([[5, 17, 301, 4000, 77, 9, 2048, 11, 600, 42, 42, 3]])


def logits_of(model, vocab: int) -> torch.Tensor | None:
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    from alignment.training.megatron_step import forward_backward

    def full(logits, target_ids):
        return {"logits": gather_from_tensor_model_parallel_region(logits)[..., :vocab]}

    mb = {"input_ids": INPUT_IDS}
    with torch.no_grad():
        out = forward_backward(model, [mb], lambda mb, o: (o["logits"].sum() * 0, o), outputs=full, forward_only=True)
    return out[0]["logits"] if ps.is_pipeline_last_stage() else None


def send_to_rank0(x: torch.Tensor | None, path: str) -> None:
    """The last rank holds the last stage's logits (PP puts the last stage on the highest ranks)."""
    obj = [x]
    dist.broadcast_object_list(obj, src=dist.get_world_size() - 1)
    if dist.get_rank() == 0:
        torch.save(obj[0], path)


def main() -> None:
    op, *args = sys.argv[1:]
    from parallel.state import shutdown

    if op in ("import", "export", "reshape"):
        src, out, tp, pp = args
        cc.main([op, src, out, "--tp", tp, "--pp", pp])
        return
    if op == "chain":
        from transformers import AutoConfig

        workdir, *dirs = args
        for i, hf_dir in enumerate(dirs):
            w = Path(workdir) / str(i)
            config = AutoConfig.from_pretrained(hf_dir)
            if getattr(config, "num_experts", 0):
                cc.hf_to_megatron(hf_dir, w / "a", ep=2)
                cc.reshape(w / "a", w / "b", tp=2, ep=2, etp=1)
                cc.megatron_to_hf(w / "b", w / "hf", pp=2)
            elif config.model_type == "llama":  # PP 2 -> TP 2 -> one rank's whole model
                cc.hf_to_megatron(hf_dir, w / "a", pp=2)
                cc.reshape(w / "a", w / "b", tp=2)
                cc.megatron_to_hf(w / "b", w / "hf")
            else:
                cc.hf_to_megatron(hf_dir, w / "a", tp=2)
                cc.reshape(w / "a", w / "b", pp=2)
                cc.megatron_to_hf(w / "b", w / "hf", pp=2)
        shutdown()
        return
    if op == "logits":
        ckpt, tp, pp, out = args
        model, hf_config, _ = cc._load_converted(Path(ckpt), int(tp), int(pp))
        send_to_rank0(logits_of(model, hf_config.vocab_size), out)
    else:  # random
        from transformers import AutoConfig, AutoTokenizer

        from tests.dist.parity_worker import randomize

        hf_dir, ckpt, tp, pp, out = args
        hf_config = AutoConfig.from_pretrained(hf_dir)
        model = cc._model(hf_config, int(tp), int(pp))
        randomize(model)
        cc._save_converted(model, hf_config, AutoTokenizer.from_pretrained(hf_dir), Path(ckpt))
        send_to_rank0(logits_of(model, hf_config.vocab_size), out)
    shutdown()


if __name__ == "__main__":
    main()
    exit_now()
