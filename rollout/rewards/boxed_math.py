"""boxed_math: 1.0 when the response's last \\boxed{...} matches the label, else 0.0.

Both sides are normalized (LaTeX spacing and sizing commands, $, \\text{}, degrees and percent
signs, a leading `x =`, a trailing period are dropped; \\dfrac/\\tfrac become \\frac) and
compared by value when both are numbers (integers, decimals, `1,000`, `a/b`, `\\frac{a}{b}`),
else as strings. A label that itself holds a \\boxed{} is compared by its content.
"""

from __future__ import annotations

import math
import re
from fractions import Fraction
from typing import Any, Optional

from rollout.rewards.label import require_label

_BOX_COMMANDS = ("\\boxed", "\\fbox")
_DROP = (
    "\\left",
    "\\right",
    "\\!",
    "\\,",
    "\\;",
    "\\:",
    "\\displaystyle",
    "$",
    "^{\\circ}",
    "^\\circ",
    "\\%",
    "%",
)
_WRAPPERS = re.compile(r"\\(?:text|textbf|mathrm|mbox)\{([^{}]*)\}")
_FRAC = re.compile(r"^(-?)\\frac\{([^{}]+)\}\{([^{}]+)\}$")
_THOUSANDS = re.compile(r"^-?\d{1,3}(,\d{3})+(\.\d+)?$")
_ASSIGNMENT = re.compile(r"^[a-zA-Z]\s*=\s*(.+)$")


def boxed_math_rm(args: Any, sample: Any) -> float:
    answer = extract_boxed(sample.response)
    if answer is None:
        return 0.0
    label = require_label(sample, "boxed_math")
    return float(answers_match(answer, extract_boxed(label) or label))


def extract_boxed(text: str) -> Optional[str]:
    """Content of the last \\boxed{...} (or \\fbox{...}, or `\\boxed 5`), nested braces included."""
    start, command = max((text.rfind(c), c) for c in _BOX_COMMANDS)
    if start < 0:
        return None
    i = start + len(command)
    if text.startswith(" ", i):  # "\boxed 5": the argument runs to the next space or $
        match = re.match(r"\s+([^\s$]+)", text[i:])
        return match.group(1) if match else None
    if not text.startswith("{", i):
        return None
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j]
    return None  # unbalanced: the response was cut off inside the box


def normalize(answer: str) -> str:
    s = answer.strip()
    for token in _DROP:
        s = s.replace(token, "")
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    previous = None
    while previous != s:  # unwrap nested \text{\textbf{...}}
        previous, s = s, _WRAPPERS.sub(r"\1", s)
    s = s.strip().rstrip(".").strip()
    assignment = _ASSIGNMENT.match(s)
    if assignment:
        s = assignment.group(1)
    return s.replace(" ", "")


def to_number(answer: str) -> Optional[Fraction]:
    """The value of a normalized answer, or None when it is not a plain number."""
    s = answer
    if _THOUSANDS.match(s):
        s = s.replace(",", "")
    frac = _FRAC.match(s)
    if frac:
        s = f"{frac.group(1)}{frac.group(2)}/{frac.group(3)}"
    try:
        if s.count("/") == 1:
            num, den = s.split("/")
            return Fraction(num) / Fraction(den)
        return Fraction(s)
    except (ValueError, ZeroDivisionError):
        return None


def answers_match(answer: str, label: str) -> bool:
    a, b = normalize(answer), normalize(label)
    if a == b:
        return True
    x, y = to_number(a), to_number(b)
    if x is None or y is None:
        return False
    return x == y or math.isclose(float(x), float(y), rel_tol=1e-6, abs_tol=1e-9)
