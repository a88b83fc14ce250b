"""Evaluation: fixed, versioned suites (:mod:`.suites`), their metrics (:mod:`.metrics`: pass@k,
majority vote, behaviour, win rates with confidence intervals), the grading shared by the
in-training held-out evaluation and ``tools/evaluate.py`` (:mod:`.reasoning`), one checkpoint's
generations (:mod:`.generation`), the result cache (:mod:`.cache`) and the side-by-side report
(:mod:`.report`)."""
