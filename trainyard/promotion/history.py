"""The model's champion history: the stack `rollback` walks back, kept in a registered-model tag."""

from __future__ import annotations

import json
from typing import Any, Optional

from trainyard.promotion.records import LOG_LIMIT, Action, PromotionError


def next_history(
    history: dict[str, Any], *, action: Action, version: str, current: Optional[str], entry: dict[str, Any]
) -> dict[str, Any]:
    """The champion history after `version` becomes champion.

    The stack holds champions in order; a promotion pushes, a rollback to a
    version on the stack drops everything after it (so rolling back twice goes
    two steps back), a rollback to a version never champion pushes it.
    """
    stack = [str(v) for v in history.get("stack", [])]
    if not stack and current is not None:
        stack = [current]
    if action == "rollback" and version in stack:
        stack = stack[: len(stack) - stack[::-1].index(version)]
    else:
        stack.append(version)
    log = [*history.get("log", []), entry][-LOG_LIMIT:]
    return {"stack": stack[-LOG_LIMIT:], "log": log}


def rollback_target(history: dict[str, Any], current: Optional[str]) -> str:
    """The version a rollback without `--version` returns to: the champion before the current one.

    Raises:
        PromotionError: There is no champion, or no earlier one on record.
    """
    if current is None:
        raise PromotionError("there is no champion to roll back from")
    stack = [str(v) for v in history.get("stack", [])]
    if not stack or stack[-1] != current:
        raise PromotionError(
            f"the champion history does not end at the current champion v{current} (stack {stack}); "
            "the alias was moved outside trainyard: name the version with --version"
        )
    if len(stack) < 2:
        raise PromotionError(f"v{current} is the first champion on record; there is nothing to roll back to")
    return stack[-2]


def parse_history(raw: Optional[str], model: str, tag: str) -> dict[str, Any]:
    """The champion history from the model's history tag (empty when there is none).

    Raises:
        PromotionError: The tag is not valid JSON.
    """
    if not raw:
        return {"stack": [], "log": []}
    try:
        history = json.loads(raw)
    except json.JSONDecodeError as e:
        raise PromotionError(f"tag {tag} of {model!r} is not valid JSON: {e}") from e
    return history if isinstance(history, dict) else {"stack": [], "log": []}
