"""The vision-language example: a shape-count image task, a Qwen2.5-VL made from a text model, and
held-out accuracy of a model on the task (README "Vision-language models").

    python tools/vision_task.py data outputs/shapes                    # train.jsonl (2000), heldout.jsonl (200), images/
    python tools/vision_task.py model outputs/smollm2_vl               # SmolLM2-135M + a new vision tower
    python tools/vision_task.py accuracy outputs/smollm2_vl outputs/shapes/heldout.jsonl

``data``: :func:`alignment.data.image_tasks.write_task` (``--train``, ``--heldout``, ``--seed``, ``--size``
pixels) and each split's DPO pairs (:func:`alignment.data.image_tasks.write_pairs`). ``model``: :func:`alignment.models.vlm_from_text.vision_language_from_text` of ``--text``
(an HF directory of the Llama family, or ``smollm2``: a Qwen2.5-VL; a Qwen3: a Qwen3-VL; a Qwen3-MoE: a Qwen3-VL-MoE). ``accuracy``: greedy answers through transformers
(:func:`alignment.evaluation.image_answers.image_task_accuracy`); prints ``{"accuracy": ..., "questions": ...}``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="megalign vision-task", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    d = sub.add_parser("data", help="write the shape-count task")
    d.add_argument("out")
    d.add_argument("--train", type=int, default=2000)
    d.add_argument("--heldout", type=int, default=200)
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--size", type=int, default=84, help="image side in pixels")
    m = sub.add_parser("model", help="a Qwen2.5-VL from a text model and a new vision tower")
    m.add_argument("out")
    m.add_argument("--text", default="smollm2", help="HF directory of a Llama-family model, or smollm2")
    m.add_argument("--seed", type=int, default=0)
    a = sub.add_parser("accuracy", help="greedy held-out accuracy of a model on the task")
    a.add_argument("model")
    a.add_argument("questions")
    a.add_argument("--limit", type=int, default=None)
    args = p.parse_args(argv)
    if args.command == "data":
        from alignment.data.image_tasks import write_pairs, write_task

        train, heldout = write_task(args.out, args.train, args.heldout, args.seed, args.size)
        pairs = [write_pairs(args.out, split) for split in ("train", "heldout")]
        print(f"wrote {train}, {heldout} and their preference pairs {pairs[0].name}, {pairs[1].name}")
    elif args.command == "model":
        from alignment.models.hf_assets import prepare_hf_dir
        from alignment.models.vlm_from_text import vision_language_from_text

        print(f"wrote {vision_language_from_text(prepare_hf_dir(args.text), args.out, seed=args.seed)}")
    else:
        from alignment.evaluation.image_answers import image_task_accuracy

        result = image_task_accuracy(args.model, args.questions, limit=args.limit)
        print(json.dumps({k: result[k] for k in ("accuracy", "questions")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
