"""A synthetic image task with verifiable answers, drawn with Pillow: count the shapes of one colour.

Each image is ``size`` x ``size`` pixels on white, a 3 x 3 grid of cells of which 1 to 6 hold a
filled square or circle (random size and place inside its cell) in red, green or blue; the question
asks for the number of shapes of one of the three colours (0 to 6, some of the others are distractors):
"How many red shapes are in the image? Answer with a number." The answer is the count, e.g. "2".

Records are TRL's vision SFT / GRPO format (what :mod:`alignment.data.chat_data` reads): ``messages``
(the user's image and question, the assistant's answer), ``images`` (the file, relative to the JSONL
file), plus ``prompt`` (the user turn alone) and ``answer`` for a prompt-only job. The training and
held-out files are drawn from different seeds, so no held-out image is trained on.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from alignment.data.text_files import read_jsonl

COLOURS = {"red": (220, 30, 30), "green": (30, 170, 60), "blue": (40, 70, 220)}
GRID = 3
QUESTION = "How many {colour} shapes are in the image? Answer with a number."


def draw(rng: random.Random, size: int):
    """One image and its shapes ``[(cell, colour, kind)]``: 1 to 6 shapes in distinct cells."""
    from PIL import Image, ImageDraw

    im = Image.new("RGB", (size, size), (255, 255, 255))
    pen = ImageDraw.Draw(im)
    cell = size // GRID
    shapes = []
    for c in rng.sample(range(GRID * GRID), rng.randint(1, 6)):
        colour, kind = rng.choice(list(COLOURS)), rng.choice(("square", "circle"))
        side = rng.randint(cell // 2, cell - 4)
        x0 = (c % GRID) * cell + rng.randint(2, cell - side - 2)
        y0 = (c // GRID) * cell + rng.randint(2, cell - side - 2)
        box = (x0, y0, x0 + side, y0 + side)
        (pen.rectangle if kind == "square" else pen.ellipse)(box, fill=COLOURS[colour])
        shapes.append((c, colour, kind))
    return im, shapes


def write_split(out_dir, split: str, n: int, seed: int, size: int = 84) -> Path:
    """Write ``n`` examples of the task to ``<out_dir>/<split>.jsonl`` and ``<out_dir>/images/<split>/``.
    Returns the JSONL path."""
    out = Path(out_dir)
    (out / "images" / split).mkdir(parents=True, exist_ok=True)
    rng = random.Random(f"{seed}:{split}")
    with open(out / f"{split}.jsonl", "w") as f:
        for i in range(n):
            im, shapes = draw(rng, size)
            colour = rng.choice(list(COLOURS))
            answer = str(sum(1 for _, c, _ in shapes if c == colour))
            name = f"images/{split}/{i:05d}.png"
            im.save(out / name)
            user = {"role": "user", "content": [{"type": "image"},
                                                {"type": "text", "text": QUESTION.format(colour=colour)}]}
            f.write(json.dumps({"messages": [user, {"role": "assistant", "content": answer}], "prompt": [user],
                                "images": [name], "answer": answer}) + "\n")
    return out / f"{split}.jsonl"


def write_pairs(out_dir, split: str) -> Path:
    """Preference pairs of a written split (``<out_dir>/<split>_pairs.jsonl``, TRL's ``prompt`` / ``chosen``
    / ``rejected`` + ``images``): chosen the true count, rejected a count one off (one more for a count of 0,
    else one more or one less, alternating). Returns the path."""
    out = Path(out_dir)
    records = [r for _, r in read_jsonl(out / f"{split}.jsonl", f"the {split} split")]
    with open(out / f"{split}_pairs.jsonl", "w") as f:
        for i, r in enumerate(records):
            n = int(r["answer"])
            wrong = n + 1 if n == 0 or i % 2 else n - 1
            f.write(json.dumps({"prompt": r["prompt"], "images": r["images"], "chosen": r["answer"],
                                "rejected": str(wrong)}) + "\n")
    return out / f"{split}_pairs.jsonl"


def write_task(out_dir, train: int = 2000, heldout: int = 200, seed: int = 0, size: int = 84) -> tuple[Path, Path]:
    """The task's ``train.jsonl`` and ``heldout.jsonl`` (``train`` and ``heldout`` examples) in ``out_dir``."""
    return write_split(out_dir, "train", train, seed, size), write_split(out_dir, "heldout", heldout, seed, size)
