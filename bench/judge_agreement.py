"""How good a small model is as an LLM judge, run inside the process as a job runs it
(``reward.functions: [{name: judge, model: HF_DIR}]``, :mod:`alignment.rewards.judge`): on the worked
example's held-out greatest-common-divisor questions (``examples/own_task``), each with its right
answer and a wrong one (the right one + 1).

    python bench/judge_agreement.py [--model smollm2] [--heldout data/gcd/heldout.jsonl] [--dtype float32]

* pointwise (the default template: "correct" or "incorrect"): the fraction of replies with a verdict,
  and how often the verdict is right, on right and on wrong answers;
* pairwise (the default pairwise template, both orders): the fraction of comparisons with a verdict,
  how often the right answer wins, and how often the two orders agree (a judge without position bias
  always does).

Prints one table; the JSON (``--out``) holds every reply. The answers are not the policy's: this
measures the judge alone.
"""

from __future__ import annotations

import argparse
import json
import time

from alignment.data.prompt_data import read_table
from alignment.data.tasks import FILE_TASK, Problem
from alignment.models.hf_assets import prepare_hf_dir
from alignment.rewards.judge import PAIR_TEMPLATE, TEMPLATE, parse_preference, parse_score, render, settings_of
from alignment.rewards.judge_models import backend, close_local


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2", help="the judge: smollm2, an HF directory or a .gguf")
    ap.add_argument("--heldout", default="data/gcd/heldout.jsonl",
                    help="questions with an `answer` (python examples/own_task/make_data.py --out data/gcd)")
    ap.add_argument("--problems", type=int, default=100)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--out", default="judge_agreement.json")
    ap.add_argument("--replies", help="score the replies of an earlier --out again (no model run), e.g. after a "
                                      "parser change")
    args = ap.parse_args()

    rows = list(read_table(args.heldout, "--heldout"))[: args.problems]
    problems = []
    for r in rows:
        prompt = r["prompt"]
        question = prompt if isinstance(prompt, str) else [m for m in prompt if m["role"] == "user"][-1]["content"]
        problems.append(Problem(question, str(r["answer"]), FILE_TASK))
    wrong = [str(int(p.answer) + 1) for p in problems]
    asks = [render(TEMPLATE, p, a) for p, w in zip(problems, wrong) for a in (p.answer, w)]
    pair_asks = [render(PAIR_TEMPLATE, p, a, b) for p, w in zip(problems, wrong)
                 for a, b in ((p.answer, w), (w, p.answer))]
    t0 = time.perf_counter()
    if args.replies:
        saved = json.loads(open(args.replies).read())
        settings = settings_of({})
        replies = [r["reply"] for r in saved["pointwise"] + saved["pairwise"]]
        assert [r["prompt"] for r in saved["pointwise"] + saved["pairwise"]] == asks + pair_asks, "other questions"
    else:
        settings = settings_of({"model": str(prepare_hf_dir(args.model)), "dtype": args.dtype, "max_model_len": 1024})
        replies = backend(settings).replies([[{"role": "user", "content": t}] for t in asks + pair_asks])
        close_local()
    seconds = time.perf_counter() - t0
    point, pair = replies[: len(asks)], replies[len(asks):]
    verdicts = [parse_score(r, settings) for r in point]
    right_ok = [v for v in verdicts[0::2] if v is not None]
    wrong_ok = [v for v in verdicts[1::2] if v is not None]
    prefs = [parse_preference(r, settings) for r in pair]
    both = [(a, b) for a, b in zip(prefs[0::2], prefs[1::2]) if a is not None and b is not None]
    wins = [(a + (1 - b)) / 2 for a, b in both]  # how much the right answer is preferred, both orders
    n = len(problems)
    pct = lambda k, m: f"{100 * k / m:.1f} %" if m else "n/a"  # noqa: E731
    print(f"judge {args.model} ({args.dtype}), {n} questions x (right, wrong) answers, {seconds:.0f} s for "
          f"{len(replies)} replies\n")
    print("| mode | replies with a verdict | the verdict is right |")
    print("|---|---|---|")
    print(f"| pointwise, right answers | {pct(len(right_ok), n)} | {pct(sum(v == 1.0 for v in right_ok), len(right_ok))} |")
    print(f"| pointwise, wrong answers | {pct(len(wrong_ok), n)} | {pct(sum(v == 0.0 for v in wrong_ok), len(wrong_ok))} |")
    print(f"| pairwise (both orders) | {pct(sum(p is not None for p in prefs), 2 * n)} | right answer preferred "
          f"{pct(sum(w > 0.5 for w in wins), len(wins))}, tied {pct(sum(w == 0.5 for w in wins), len(wins))}; "
          f"the two orders agree {pct(sum(a == 1 - b for a, b in both), len(both))} |")
    with open(args.out, "w") as f:
        json.dump({"pointwise": [{"prompt": a, "reply": r} for a, r in zip(asks, point)],
                   "pairwise": [{"prompt": a, "reply": r} for a, r in zip(pair_asks, pair)]}, f, indent=1)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
