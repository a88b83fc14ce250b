"""Best-of-N reranking on held-out problems: of the N solutions ``tools/make_prm_data.py`` sampled
per held-out problem, answer with the one a process reward model scores highest, the one an
outcome reward model scores highest, the majority answer, or a random one; report each pick's
accuracy, the PRM's held-out step accuracy and the ORM's outcome accuracy (its last-step score > 0.5
== the answer is right), and pass@N (some solution is right).

    python tools/rerank.py --data outputs/prm_data --prm outputs/prm_smollm2/hf --orm outputs/orm_smollm2/hf

``--prm`` / ``--orm``: HF exports of ``--config-name prm`` with ``algorithm.supervision=process`` /
``outcome`` (sequence classifiers); either may be left out. Scores are read with ``transformers``
at each step's last token, tokenised as the job trains (:func:`alignment.data.step_data.encode_steps`).
The random pick's accuracy is its expectation (the mean outcome per problem), not one draw.
Prints a table and writes ``--out`` (JSON).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root

from alignment.algorithms.best_of_n import aggregate_steps, majority_vote, pick_best  # noqa: E402
from alignment.data.step_data import encode_steps, load_records, supervised_labels  # noqa: E402
from alignment.data.tasks import extract_final_number  # noqa: E402


def group_by_problem(records: list, samples: int | None = None) -> list[list]:
    """The held-out records as one list per problem: runs of ``samples`` records when given (the data
    tool writes each problem's solutions together), else runs of the same question.

    Raises:
        ValueError: the records do not split into whole groups of ``samples``.
    """
    if samples:
        if len(records) % samples:
            raise ValueError(f"{len(records)} held-out solutions are not whole groups of {samples} per problem")
        return [records[i : i + samples] for i in range(0, len(records), samples)]
    groups: list[list] = []
    for r in records:
        if groups and groups[-1][0].question == r.question:
            groups[-1].append(r)
        else:
            groups.append([r])
    return groups


def step_probabilities(model_dir: str, records: list, separator: str = "\n", batch_size: int = 16,
                       dtype: str = "float32") -> list[list[float]]:
    """P(step correct) = sigmoid(head) at each step's last token, per record, from the HF export of a
    process / outcome reward model (``*ForSequenceClassification``: its ``score`` head applied at
    every position of its base model's last hidden states), run in ``dtype``."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model = AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    encoded = [encode_steps(tokenizer, r.prompt, r.completions, separator) if r.completions else None
               for r in records]
    out: list[list[float]] = [[] for _ in records]
    todo = [i for i, e in enumerate(encoded) if e is not None]
    for start in range(0, len(todo), batch_size):
        idx = todo[start : start + batch_size]
        width = max(len(encoded[i][0]) for i in idx)
        ids = torch.zeros(len(idx), width, dtype=torch.long)
        mask = torch.zeros(len(idx), width, dtype=torch.long)
        for row, i in enumerate(idx):  # right padding: a causal model's earlier positions do not see it
            ids[row, : len(encoded[i][0])], mask[row, : len(encoded[i][0])] = torch.tensor(encoded[i][0]), 1
        with torch.no_grad():
            hidden = model.base_model(input_ids=ids, attention_mask=mask).last_hidden_state
            logits = model.score(hidden)[..., 0].float()
        for row, i in enumerate(idx):
            out[i] = torch.sigmoid(logits[row, encoded[i][2]]).tolist()
    return out


def step_accuracy(labels: list[list[bool | None]], probs: list[list[float]]) -> float:
    """Fraction of labelled steps whose P(correct) > 0.5 agrees with the label (None: not labelled)."""
    pairs = [(p > 0.5) == y for ys, ps in zip(labels, probs) for p, y in zip(ps, ys) if y is not None]
    return sum(pairs) / max(len(pairs), 1)


def rerank(groups: list[list], scorers: dict[str, list[list[float]]]) -> dict[str, float]:
    """Accuracy of each pick over the problems: ``random`` (expected), ``majority_vote``, one per
    scorer and aggregation (``<name>_prod`` / ``_min`` / ``_last``), and ``pass@N``. ``scorers``:
    per name, the step probabilities of every record in ``groups`` order."""

    n = max(len(groups), 1)
    result = {"random": sum(sum(r.outcome for r in g) / len(g) for g in groups) / n,
              "majority_vote": sum(g[majority_vote([extract_final_number("\n".join(r.completions)) for r in g])].outcome
                                   for g in groups) / n}
    for name, probs in scorers.items():
        for how in (("last",) if name == "orm" else ("prod", "min", "last")):
            picked, k = 0, 0
            for g in groups:
                scores = [aggregate_steps(p, how) for p in probs[k : k + len(g)]]
                picked += g[pick_best(scores)].outcome
                k += len(g)
            result[f"{name}_{how}"] = picked / n
    result[f"pass@{len(groups[0]) if groups else 0}"] = sum(any(r.outcome for r in g) for g in groups) / n
    return result


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default="outputs/prm_data", help="tools/make_prm_data.py's --out")
    p.add_argument("--prm", help="HF export of the process reward model")
    p.add_argument("--orm", help="HF export of the outcome reward model")
    p.add_argument("--out", help="JSON results (default <data>/rerank.json)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="bfloat16: ~5x faster on CPUs with AMX, scores within ~1e-2")
    args = p.parse_args(argv)

    records = load_records(args.data, "heldout")
    meta_path = Path(args.data) / "meta.json"
    meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
    groups = group_by_problem(records, meta.get("samples"))
    ordered = [r for g in groups for r in g]
    separator = meta.get("separator", "\n")
    scorers, accuracy = {}, {}
    for name, model_dir, supervision in (("prm", args.prm, "process"), ("orm", args.orm, "outcome")):
        if model_dir:
            scorers[name] = step_probabilities(model_dir, ordered, separator, dtype=args.dtype)
            labels = [supervised_labels(r, supervision) for r in ordered]
            key = "prm_step_accuracy" if name == "prm" else "orm_outcome_accuracy"
            accuracy[key] = step_accuracy(labels, scorers[name])
    result = {"problems": len(groups), "samples": len(groups[0]), **rerank(groups, scorers), **accuracy}
    print(f"best-of-{result['samples']} on {result['problems']} held-out problems")
    print("| pick | accuracy |\n|---|---|")
    for key, value in result.items():
        if key not in ("problems", "samples"):
            print(f"| {key} | {value:.3f} |")
    Path(args.out or Path(args.data) / "rerank.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
