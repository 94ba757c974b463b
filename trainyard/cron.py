"""Cron strings as Dagster schedules accept them, checked without importing Dagster.

A `RetrainPolicy(cron=...)` is validated when the team module is imported, in the
Dagster-free core, so the rule is written here: five fields (minute, hour, day
of month, month, day of week), each `*`, a number or name, a range `a-b`, a
step `*/n` / `a-b/n` / `a/n`, or a comma list of those; or one of the macros
below. A test holds this to Dagster's own validator on valid and invalid strings.

Example:
    >>> is_valid_cron("0 3 * * MON-FRI")
    True
    >>> is_valid_cron("0 3 30 2 *")  # February 30th never comes
    False
"""

from __future__ import annotations

import re

MACROS = frozenset({"@yearly", "@annually", "@monthly", "@weekly", "@daily", "@midnight", "@hourly"})
_MONTHS = {m: i + 1 for i, m in enumerate("jan feb mar apr may jun jul aug sep oct nov dec".split())}
_DAYS = {d: i for i, d in enumerate("sun mon tue wed thu fri sat".split())}
# (low, high, names) of each field, in order.
_FIELDS: tuple[tuple[int, int, dict[str, int]], ...] = (
    (0, 59, {}),
    (0, 23, {}),
    (1, 31, {}),
    (1, 12, _MONTHS),
    (0, 7, _DAYS),
)
_ITEM = re.compile(r"^(?P<start>\*|[0-9a-z]+)(?:-(?P<end>[0-9a-z]+))?(?:/(?P<step>[0-9]+))?$")


def _value(token: str, low: int, high: int, names: dict[str, int]) -> int | None:
    value = names.get(token) if not token.isdigit() else int(token)
    if value is None or not low <= value <= high:
        return None
    return value


def _field_values(field: str, index: int) -> set[int] | None:
    """The values a field selects, or None when it is not valid."""
    low, high, names = _FIELDS[index]
    selected: set[int] = set()
    for item in field.lower().split(","):
        if index in (2, 4) and item == "?":  # "no specific value", as croniter reads it
            item = "*"
        if index == 2 and item == "l":  # the last day of the month
            selected.add(high)
            continue
        if index == 4 and re.fullmatch(r"[0-7a-z]+#[1-5]", item):  # the n-th weekday of the month
            item = item.split("#")[0]
        m = _ITEM.match(item)
        if m is None:
            return None
        step = int(m["step"]) if m["step"] is not None else 1
        if step < 1:
            return None
        if m["start"] == "*":
            if m["end"] is not None:
                return None
            start, end = low, high
        else:
            start_v = _value(m["start"], low, high, names)
            if start_v is None:
                return None
            start = start_v
            end_v = _value(m["end"], low, high, names) if m["end"] is not None else None
            if m["end"] is not None and end_v is None:
                return None
            end = end_v if end_v is not None else (high if m["step"] is not None else start)
        if end < start:  # a range that wraps, e.g. hours 22-2
            span = high - low + 1
            selected.update(low + (v - low) % span for v in range(start, end + span + 1, step))
            continue
        selected.update(range(start, end + 1, step))
    return selected


def is_valid_cron(cron: str) -> bool:
    """Whether Dagster accepts `cron` as a schedule (see the module docstring for the rule)."""
    text = cron.strip()
    if text.lower() in MACROS:
        return True
    fields = text.split()
    if len(fields) != 5:
        return False
    values = [_field_values(f, i) for i, f in enumerate(fields)]
    if any(v is None for v in values):
        return False
    # A schedule that can never fire (February 30th or 31st) is refused, as Dagster does.
    return not (values[3] == {2} and values[2] in ({30}, {31}))
