"""Evaluation metrics on response texts: behaviour (refusal, repetition, empty or garbled answers,
length) and comparisons (win rates with a binomial confidence interval). Pure functions, no model."""

from __future__ import annotations

import math
import re
import unicodedata
from collections.abc import Sequence

#: What counts as a refusal (case-insensitive regular expressions, any match): the openings
#: chat models refuse with. Documented in docs/guides/evaluation.md; extend it here.
REFUSAL_PATTERNS: tuple[str, ...] = (
    r"\bI(?:'m| am) (?:sorry|afraid),? (?:but )?I (?:can(?:no|')t|am unable|won't)",
    r"\bI(?:'m| am) (?:unable|not able) to (?:help|assist|provide|answer|comply|do that)",
    r"\bI can(?:no|')t (?:help|assist|provide|answer|comply|do that|fulfil)",
    r"\bI (?:won't|will not|must decline|refuse) to\b",
    r"\bas an AI(?: language model)?,? I (?:can(?:no|')t|am not able|don't)",
    r"\bagainst my (?:guidelines|policy|policies|programming)\b",
    r"\bI(?:'m| am) not (?:comfortable|allowed|permitted) (?:to|with)\b",
)
_REFUSAL = re.compile("|".join(f"(?:{p})" for p in REFUSAL_PATTERNS), re.IGNORECASE)
#: characters of ordinary text: letters, digits, punctuation, symbols, whitespace (Unicode categories)
_ORDINARY = ("L", "N", "P", "S", "Z")


def is_refusal(text: str) -> bool:
    """Whether ``text`` matches one of :data:`REFUSAL_PATTERNS`."""
    return _REFUSAL.search(text) is not None


def repeated_ngram_fraction(text: str, n: int = 4) -> float:
    """Fraction of the word ``n``-grams of ``text`` that repeat an earlier one (0: none repeats,
    towards 1: a loop); 0 for texts shorter than ``n`` + 1 words.

    Raises:
        ValueError: ``n`` < 1.
    """
    if n < 1:
        raise ValueError(f"n={n}: must be >= 1")
    words = text.split()
    grams = [tuple(words[i : i + n]) for i in range(len(words) - n + 1)]
    if len(grams) < 2:
        return 0.0
    return 1.0 - len(set(grams)) / len(grams)


def is_repetitive(text: str, n: int = 4, threshold: float = 0.5) -> bool:
    """More than ``threshold`` of the word ``n``-grams repeat (a degenerate loop)."""
    return repeated_ngram_fraction(text, n) > threshold


def is_empty(text: str) -> bool:
    """Nothing but whitespace."""
    return not text.strip()


def is_garbled(text: str, min_ordinary: float = 0.9) -> bool:
    """Undecodable bytes (U+FFFD) or fewer than ``min_ordinary`` of the characters ordinary text
    (letters, digits, punctuation, symbols, spaces; control and private-use characters are not).
    An empty text is empty, not garbled."""
    if not text:
        return False
    if "\ufffd" in text:
        return True
    ordinary = sum(unicodedata.category(c)[0] in _ORDINARY or c in "\n\t" for c in text)
    return ordinary / len(text) < min_ordinary


def behaviour(texts: Sequence[str], lengths: Sequence[int]) -> dict[str, float]:
    """Behaviour of responses ``texts`` (``lengths``: their token counts): ``mean_length``
    (tokens), ``refusal_rate``, ``repetition_rate`` (:func:`is_repetitive`), ``empty_rate`` and
    ``garbled_rate``, each the fraction of responses.

    Raises:
        ValueError: no texts, or ``lengths`` not one per text.
    """
    if not texts or len(texts) != len(lengths):
        raise ValueError(f"{len(texts)} responses and {len(lengths)} lengths: need one length per response, >= 1")
    n = len(texts)
    return {"mean_length": sum(lengths) / n, "refusal_rate": sum(map(is_refusal, texts)) / n,
            "repetition_rate": sum(map(is_repetitive, texts)) / n, "empty_rate": sum(map(is_empty, texts)) / n,
            "garbled_rate": sum(map(is_garbled, texts)) / n}


def wilson_interval(successes: float, n: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion ``successes / n`` (Wilson 1927; the default
    ``z`` gives 95 %). ``successes`` may be fractional (ties counted as halves). ``n`` = 0: (0, 1).

    Raises:
        ValueError: ``successes`` outside [0, n].
    """
    if not 0 <= successes <= n:
        raise ValueError(f"successes={successes} outside [0, n={n}]")
    if n == 0:
        return 0.0, 1.0
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return max(0.0, centre - half), min(1.0, centre + half)


def win_rate(a: Sequence[float], b: Sequence[float], tie: float = 0.0) -> dict[str, float]:
    """Pairwise comparison of ``a`` against ``b`` (one score each per prompt, higher is better; a
    judge's rewards or a verifier's 0/1): ``wins``, ``ties`` (``|a - b| <= tie``), ``losses``,
    ``win_rate`` = (wins + ties / 2) / n and its 95 % Wilson interval ``ci_low``, ``ci_high``.

    Raises:
        ValueError: ``a`` and ``b`` of different lengths, or empty.
    """
    if len(a) != len(b) or not a:
        raise ValueError(f"{len(a)} and {len(b)} scores: need one pair per prompt, >= 1")
    wins = sum(x - y > tie for x, y in zip(a, b))
    ties = sum(abs(x - y) <= tie for x, y in zip(a, b))
    rate = (wins + ties / 2) / len(a)
    low, high = wilson_interval(wins + ties / 2, len(a))
    return {"wins": wins, "ties": ties, "losses": len(a) - wins - ties, "win_rate": rate,
            "ci_low": low, "ci_high": high}
