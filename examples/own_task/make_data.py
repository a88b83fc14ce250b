"""Write a task of your own as prompt files: greatest common divisors of two small numbers, from
reasoning-gym's ``gcd`` generator (which megalign does not ship as a task).

    python examples/own_task/make_data.py --out data/gcd          # prompt strings (JSONL)
    python examples/own_task/make_data.py --out data/gcd --chat   # chat messages with a system prompt

Writes ``<out>/train.jsonl`` and ``<out>/heldout.jsonl``: one record per line with ``prompt`` (a string,
or with ``--chat`` a list of messages) and ``answer``, plus a ``numbers`` column the reward functions
receive too. Held-out questions are drawn from another seed and never repeat a training question.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

SYSTEM = "You are a careful calculator. Reply with the number only."


def records(size: int, seed: int, chat: bool) -> list[dict]:
    import reasoning_gym

    ds = reasoning_gym.create_dataset("gcd", size=size, seed=seed, min_numbers=2, max_numbers=2, min_value=2,
                                      max_value=30)
    out = []
    for entry in ds:
        numbers = entry["metadata"]["numbers"]
        question = f"What is the greatest common divisor of {numbers[0]} and {numbers[1]}?"
        prompt = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}] if chat else \
            f"{question} Answer with a single number."
        out.append({"prompt": prompt, "answer": str(entry["answer"]), "numbers": numbers})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="data/gcd")
    ap.add_argument("--train-size", type=int, default=1000)
    ap.add_argument("--heldout-size", type=int, default=100)
    ap.add_argument("--chat", action="store_true", help="chat messages with a system prompt")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    heldout = records(args.heldout_size, 1_000_003, args.chat)
    held = {json.dumps(r["prompt"]) for r in heldout}
    train = [r for r in records(args.train_size, 1, args.chat) if json.dumps(r["prompt"]) not in held]
    for name, rows in (("train", train), ("heldout", heldout)):
        (out / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"wrote {len(train)} training and {len(heldout)} held-out records to {out}/")


if __name__ == "__main__":
    main()
