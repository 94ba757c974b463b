"""`trainyard registry`: show, promote and roll back registered models.

    trainyard registry show vision.digits              # the champion, its lineage and promotion evidence
    trainyard registry show digits --version 3         # a short name works when it is unambiguous
    trainyard registry promote vision.digits           # apply the policy to the challenger
    trainyard registry promote vision.digits --version 4 --force --reason "hotfix, INC-123"
    trainyard registry rollback vision.digits          # back to the previous champion
    trainyard registry list

`promote` and `rollback` apply the same checks as the `registered_model` asset
(`resources.registry.promotion`, applying `trainyard.promotion`'s policy), with the policy and pinned test split
recorded on the
version when it was registered. `--force` moves the alias past failing checks
and is recorded as an override with its reason. The registry, object store and
handoff publisher are the environment's (`TRAINYARD_ENV`, default `local`
under `TRAINYARD_HOME`).

`trainyard --help` imports this module to build its parser, so everything
beyond the standard library (the environment's resources, which load Dagster
and MLflow, and the pydantic-based core) is imported inside the commands.

Exit status: 0 done (or nothing to do), 1 the policy rejected the request,
2 bad input (unknown model or version), 3 the registry failed.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from typing import Any, Optional

EXIT_REJECTED = 1
EXIT_BAD_INPUT = 2
EXIT_REGISTRY = 3

LINEAGE_SHOWN = (
    ("pipeline", "pipeline"),
    ("data version", "data_version"),
    ("validation", "validation"),
    ("validation detail", "validation_summary"),
    ("test split", "test_split"),
    ("code version", "code_version"),
    ("code dirty", "code_dirty"),
    ("dependency lock", "lock_hash"),
    ("study", "study"),
    ("trial", "trial"),
    ("params", "params"),
    ("seed", "seed"),
    ("world size", "world_size"),
    ("strategy", "strategy"),
    ("checkpoint", "checkpoint_uri"),
    ("tracker run", "tracker_run"),
)
"""`show`'s lineage lines: label and `LineageRecord` field, in the order shown."""

GBT_STRATEGY = "gbt (single process)"
"""What `show` says for a LightGBM version's strategy: the distribution strategy of its spec never applied."""

OTHER_DECISIONS_SHOWN = 5
"""How many other versions' latest decisions `show` lists, newest version first."""


def register(subparsers: Any) -> None:
    """Adds `registry` and its subcommands to the `trainyard` parser."""
    parser = subparsers.add_parser("registry", help="show, promote and roll back registered models")
    sub = parser.add_subparsers(dest="registry_command", required=True)

    show = sub.add_parser("show", help="a version (default: the champion) with lineage and promotion evidence")
    show.add_argument("model", help="registered model name (e.g. vision.digits), team/pipeline, or a unique short name")
    show.add_argument("--version", help="version number or alias (default: champion)")
    show.add_argument("--json", action="store_true", help="print JSON instead of text")
    show.set_defaults(func=cmd_show)

    lst = sub.add_parser("list", help="registered models with their champion and challenger")
    lst.set_defaults(func=cmd_list)

    for name, helptext in (
        ("promote", "apply the promotion policy to a version (default: the challenger) and move champion if it passes"),
        ("rollback", "move champion back to the previous champion (or --version), after the same checks"),
    ):
        p = sub.add_parser(name, help=helptext)
        p.add_argument("model", help="registered model name (e.g. vision.digits)")
        p.add_argument(
            "--version", help="version number (promote: default challenger; rollback: default previous champion)"
        )
        p.add_argument("--force", action="store_true", help="move the alias even if checks fail (needs --reason)")
        p.add_argument("--reason", help="why; required with --force and recorded as the override's justification")
        p.set_defaults(func=cmd_promote if name == "promote" else cmd_rollback)


def _environment() -> dict[str, Any]:
    from pipelines.environments import resources_for  # lazy: loads every resource (see module docstring)

    return resources_for()


def _fail(message: str, code: int) -> int:
    print(f"trainyard registry: error: {message}", file=sys.stderr)
    return code


def resolve_model(registry: Any, text: str) -> str:
    """A registered model name from what the user typed.

    Accepts the exact name (`vision.digits`), `team/pipeline` (`vision/digits`)
    or a suffix after the team that is unique (`digits`).

    Raises:
        LookupError: No model, or several, match (the message lists the candidates).
    """
    names = registry.list_models()
    wanted = text.replace("/", ".")
    if wanted in names:
        return wanted
    matches = [n for n in names if n.endswith(f".{wanted}")]
    if len(matches) == 1:
        return matches[0]
    if matches:
        raise LookupError(f"model {text!r} is ambiguous: {', '.join(matches)}")
    known = ", ".join(names) or "none yet (run `trainyard demo` or a promote job)"
    raise LookupError(f"no registered model {text!r}; registered models: {known}")


def _version(registry: Any, model: str, version: Optional[str]) -> Any:
    from resources.registry import RegistryNotFound  # lazy: loads MLflow (see module docstring)

    if version is None or not version.isdigit():
        alias = version or "champion"
        info = registry.get_alias(model, alias)
        if info is None:
            raise LookupError(f"{model} has no alias {alias!r}; give a version number with --version")
        return info
    try:
        return registry.get_version(model, version)
    except RegistryNotFound as e:
        raise LookupError(f"{model} has no version {version}") from e


def describe(registry: Any, model: str, info: Any, handoff: Any = None) -> dict[str, Any]:
    """Everything `show` prints, as a JSON-serialisable dict."""
    from trainyard import lineage as lin  # lazy: pydantic (see module docstring)
    from trainyard import promotion as pr
    from trainyard.spec import GBT_MODEL_PATH

    tags = info.tags
    registered = registry.get_model_tags(model)
    history = json.loads(registered.get(lin.HISTORY_TAG) or "{}") if registered.get(lin.HISTORY_TAG) else {}
    aliases = {}
    for alias in (pr.CHAMPION, pr.CHALLENGER):
        holder = registry.get_alias(model, alias)
        aliases[alias] = holder.version if holder else None
    params = {k[len(lin.PARAMS_PREFIX):]: v for k, v in tags.items() if k.startswith(lin.PARAMS_PREFIX)}
    lineage = {}
    for label, name in LINEAGE_SHOWN:
        if name == "params":
            value = json.dumps(params, sort_keys=True) if params else None
        else:
            value = tags.get(lin.LineageRecord.tag(name))
        if value not in (None, ""):
            lineage[label] = value
    # A LightGBM trial trains in one process whatever `distribution` says, and its
    # lineage still records the spec's default strategy: showing it would mislead.
    if tags.get(lin.LineageRecord.tag("model")) == GBT_MODEL_PATH and "strategy" in lineage:
        lineage["strategy"] = GBT_STRATEGY
    lineage["mlflow run"] = info.run_id
    p = lin.PROMOTION_PREFIX
    checks = json.loads(tags.get(f"{p}checks", "[]"))
    smoke = json.loads(tags.get(lin.SMOKE_EVIDENCE_TAG, "{}"))
    out: dict[str, Any] = {
        "model": model,
        "version": info.version,
        "model_uri": info.model_uri,
        "aliases": aliases,
        "is_champion": aliases[pr.CHAMPION] == info.version,
        "artifact_uri": registry.artifact_uri(model, info.version),
        "metrics": pr.recorded_metrics(tags),
        "lineage": lineage,
        "promotion": {
            "decision": tags.get(f"{p}decision"),
            "action": tags.get(f"{p}action"),
            "at": tags.get(f"{p}at"),
            "by": tags.get(f"{p}by"),
            "reason": tags.get(f"{p}reason"),
            "override": tags.get(f"{p}override") == "true",
            "override_reason": tags.get(f"{p}override_reason") or None,
            "champion_before": tags.get(f"{p}champion_before") or None,
            "checks": checks,
            "smoke_test": smoke,
            "policy": json.loads(tags[lin.POLICY_TAG]) if tags.get(lin.POLICY_TAG) else None,
            "replaced": tags.get(lin.CHAMPION_REPLACED_TAG),
            "rolled_back": tags.get(lin.CHAMPION_ROLLED_BACK_TAG),
        },
        "handoff": {"event_uri": tags.get(lin.HANDOFF_URI_TAG), "webhook": tags.get(lin.HANDOFF_WEBHOOK_TAG)},
        "history": history.get("log", [])[-10:],
        "other_decisions": other_decisions(registry, model, exclude={info.version, aliases[pr.CHAMPION]}),
    }
    return out


def other_decisions(
    registry: Any, model: str, exclude: set[Optional[str]], limit: int = OTHER_DECISIONS_SHOWN
) -> list[dict[str, Any]]:
    """The latest recorded decision of each version of `model` not in `exclude`, newest version first.

    Shows why a challenger is not champion without a second `show --version`:
    each entry has the version, its aliases, the decision (None when none was
    recorded yet), action, time, decider, reason and the checks that failed.

    Args:
        registry: The model registry.
        model: Registered model name.
        exclude: Versions already shown (the one asked for and the champion).
        limit: At most this many versions, the newest.
    """
    from trainyard import lineage as lin  # lazy: pydantic (see module docstring)

    p = lin.PROMOTION_PREFIX
    versions = sorted(
        (v for v in registry.list_versions(model) if v.version not in exclude),
        key=lambda v: int(v.version),
        reverse=True,
    )
    out = []
    for v in versions[:limit]:
        tags = v.tags
        checks = json.loads(tags.get(f"{p}checks") or "[]")
        out.append({
            "version": v.version,
            "aliases": sorted(v.aliases),
            "decision": tags.get(f"{p}decision"),
            "action": tags.get(f"{p}action"),
            "at": tags.get(f"{p}at"),
            "by": tags.get(f"{p}by"),
            "reason": tags.get(f"{p}reason"),
            "failed_checks": [c for c in checks if not c.get("passed")],
        })
    return out


def _render_other_decisions(decisions: list[dict[str, Any]]) -> list[str]:
    if not decisions:
        return []
    lines = ["", "other versions, latest decision (newest first)"]
    for o in decisions:
        held = f" [{', '.join(o['aliases'])}]" if o["aliases"] else ""
        if o["decision"] is None:
            lines.append(f"  v{o['version']}{held}: no decision recorded yet")
            continue
        lines.append(
            f"  v{o['version']}{held}: {o['decision']} ({o['action']}) at {o['at']} by {o['by']}: {o['reason']}"
        )
        lines += [f"    [FAIL] {c['name']}: {c['detail']}" for c in o["failed_checks"]]
    return lines


def render(d: dict[str, Any]) -> str:
    """The text form of `describe`'s output."""
    role = "champion: version" if d["is_champion"] else "version"
    lines = [
        f"{d['model']} {role} {d['version']}  ({d['model_uri']})" + ("" if d["is_champion"] else "  [not champion]"),
        f"  aliases          : champion -> {d['aliases']['champion'] or '-'}, challenger -> "
        f"{d['aliases']['challenger'] or '-'}",
        f"  artifacts        : {d['artifact_uri']}",
        "  metrics          : " + (", ".join(f"{k}={v:.4f}" for k, v in sorted(d["metrics"].items())) or "-"),
        "",
        "lineage",
    ]
    lines += [f"  {label:<17}: {value}" for label, value in d["lineage"].items()]
    p = d["promotion"]
    lines += ["", "promotion evidence"]
    if p["decision"] is None:
        lines.append("  no decision recorded (registered outside trainyard's promotion policy)")
    else:
        lines.append(f"  decision         : {p['decision']} ({p['action']}) at {p['at']} by {p['by']}")
        if p["override"]:
            lines.append(f"  OVERRIDE         : {p['override_reason']}")
        if p["champion_before"]:
            lines.append(f"  champion then    : version {p['champion_before']}")
        for check in p["checks"]:
            lines.append(f"  [{'pass' if check['passed'] else 'FAIL'}] {check['name']}: {check['detail']}")
        smoke = p["smoke_test"]
        if smoke.get("served_metric") is not None:
            lines.append(
                f"  smoke test       : {smoke.get('model_uri')} in {smoke.get('seconds')}s, served "
                f"{smoke['served_metric']} "
                f"{smoke['served_value']:.6f} on {smoke.get('test_rows')} rows (training-side "
                f"{smoke['training_value']:.6f})"
            )
        if p["policy"]:
            lines.append(f"  policy           : {json.dumps(p['policy'], sort_keys=True)}")
    for key, label in (("replaced", "replaced"), ("rolled_back", "rolled back")):
        if p[key]:
            lines.append(f"  {label:<17}: {p[key]}")
    if d["handoff"]["event_uri"]:
        lines += ["", f"handoff event      : {d['handoff']['event_uri']} (webhook: {d['handoff']['webhook']})"]
    if d["history"]:
        lines += ["", "champion history (newest last)"]
        for h in d["history"]:
            forced = " OVERRIDE" if h.get("override") else ""
            lines.append(
                f"  v{h['version']} {h['action']}{forced} at {h['at']} by {h['by']} "
                f"({'was v' + h['from'] if h.get('from') else 'first champion'})"
            )
    lines += _render_other_decisions(d["other_decisions"])
    return "\n".join(lines)


def _guard(fn: Any) -> Any:
    """Maps the registry's errors onto exit codes and one-line messages."""

    @functools.wraps(fn)
    def wrapper(args: argparse.Namespace) -> int:
        from resources.handoff import HandoffError  # lazy: Dagster and MLflow (see module docstring)
        from resources.registry import RegistryError, RegistryUnavailable
        from trainyard.promotion import PromotionError

        try:
            return fn(args)
        except (LookupError, PromotionError) as e:
            return _fail(str(e).strip("'\""), EXIT_BAD_INPUT)
        except ValueError as e:
            return _fail(str(e), EXIT_BAD_INPUT)
        except RegistryUnavailable as e:
            return _fail(f"registry unavailable: {e}", EXIT_REGISTRY)
        except (RegistryError, HandoffError) as e:
            return _fail(str(e), EXIT_REGISTRY)

    return wrapper


@_guard
def cmd_show(args: argparse.Namespace) -> int:
    env = _environment()
    registry = env["registry"]
    model = resolve_model(registry, args.model)
    info = _version(registry, model, args.version)
    d = describe(registry, model, info)
    print(json.dumps(d, indent=2, sort_keys=True) if args.json else render(d))
    return 0


@_guard
def cmd_list(args: argparse.Namespace) -> int:
    registry = _environment()["registry"]
    names = registry.list_models()
    if not names:
        print("no registered models")
    for name in names:
        champion = registry.get_alias(name, "champion")
        challenger = registry.get_alias(name, "challenger")
        print(
            f"{name}: champion {champion.version if champion else '-'}, challenger "
            f"{challenger.version if challenger else '-'}, "
            f"{len(registry.list_versions(name))} version(s)"
        )
    return 0


def _decision_text(decision: Any) -> str:
    verb = {"champion": "is now champion", "rolled_back_to": "is champion again (rollback)",
            "already_champion": "is already champion; nothing to do", "rejected": "was NOT promoted"}[decision.outcome]
    lines = [f"{decision.model} version {decision.version} {verb}"]
    if decision.override:
        lines.append(f"  OVERRIDE recorded: {decision.override_reason}")
    lines += [
        f"  [{'FAIL' if not c.passed else 'WARN' if c.warning else 'pass'}] {c.name}: {c.detail}"
        for c in decision.checks
    ]
    if decision.handoff_uri:
        lines.append(f"  handoff event: {decision.handoff_uri} (webhook: {decision.webhook})")
    return "\n".join(lines)


def _check_force(args: argparse.Namespace) -> None:
    if args.force and not (args.reason or "").strip():
        raise ValueError("--force needs --reason \"...\": an override is recorded with its justification")
    if args.reason and not args.force:
        raise ValueError("--reason is only used with --force")


@_guard
def cmd_promote(args: argparse.Namespace) -> int:
    from resources.registry import promotion  # lazy: Dagster and MLflow (see module docstring)

    _check_force(args)
    env = _environment()
    model = resolve_model(env["registry"], args.model)
    decision = promotion.promote(
        env["registry"], env["handoff"], env["store"], model, version=args.version, force=args.force, reason=args.reason
    )
    print(_decision_text(decision))
    return 0 if decision.champion else EXIT_REJECTED


@_guard
def cmd_rollback(args: argparse.Namespace) -> int:
    from resources.registry import promotion  # lazy: Dagster and MLflow (see module docstring)

    _check_force(args)
    env = _environment()
    model = resolve_model(env["registry"], args.model)
    decision = promotion.rollback(
        env["registry"], env["handoff"], env["store"], model, version=args.version, force=args.force, reason=args.reason
    )
    print(_decision_text(decision))
    return 0 if decision.champion else EXIT_REJECTED
