"""``chat-pipeline keys create | list | show | update | rotate | revoke``: virtual keys in the
database the ``[spend]`` table names (or ``--database-env``'s)."""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
from collections.abc import Callable, Mapping
from datetime import UTC, datetime, timedelta
from typing import Any

from pipeline.keys._model import Budget, IssuedKey, VirtualKey
from pipeline.keys._store import DatabaseKeyStore

__all__ = ["add_commands", "key_fields", "run"]

_SPAN = re.compile(r"(\d+)([smhd])")
_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def _when(text: str) -> datetime:
    """A time: ISO 8601 with its zone, or a span from now (``30d``, ``12h``)."""
    span = _SPAN.fullmatch(text.strip())
    if span:
        return datetime.now(UTC) + timedelta(seconds=int(span[1]) * _SECONDS[span[2]])
    try:
        when = datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
    except ValueError:
        raise ValueError(
            "expires_at: expected ISO 8601 with a zone, or a span such as 30d"
        ) from None
    if when.tzinfo is None:
        raise ValueError("expires_at: expected a time with its zone (Z or +hh:mm)")
    return when


def key_fields(data: Mapping[str, Any]) -> dict[str, Any]:
    """Key settings from JSON values (the admin API's body, the CLI's options): a budget
    as ``{"limit", "period", "soft"}`` (or null to remove it), `expires_at` as ISO 8601 or
    a span from now. The store checks every value."""
    fields = dict(data)
    if "budget" in fields and fields["budget"] is not None:
        budget = fields["budget"]
        if not isinstance(budget, Mapping):
            raise ValueError("budget: expected {limit, period, soft}")
        fields["budget"] = Budget(**budget)
    if isinstance(fields.get("expires_at"), str):
        fields["expires_at"] = _when(fields["expires_at"])
    return fields


def add_commands(commands: Any) -> None:
    """Add ``keys`` to the CLI's subcommands."""
    keys = commands.add_parser("keys", help="create, list, show, update, rotate or revoke keys")
    actions = keys.add_subparsers(dest="action", required=True)

    def common(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--config", metavar="FILE", help="the TOML file with a [spend] table")
        parser.add_argument("--env", metavar="NAME", help="environment overlay")
        parser.add_argument(
            "--database-env",
            metavar="VAR",
            help="the environment variable holding the database's URL (instead of --config)",
        )
        parser.add_argument("--format", choices=("table", "json"), default="table")

    def settings(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--team", help="the team whose budgets and limits it counts against")
        parser.add_argument("--user", help="the user whose budget it counts against")
        parser.add_argument(
            "--models", nargs="+", metavar="GLOB", help="model names it may ask for (globs)"
        )
        parser.add_argument("--rpm", type=int, help="requests a minute")
        parser.add_argument("--tpm", type=int, help="tokens a minute")
        parser.add_argument("--budget", metavar="AMOUNT", help="what it may spend")
        parser.add_argument("--period", choices=("day", "week", "month"), help="of the budget")
        parser.add_argument("--soft", metavar="AMOUNT", help="the budget's soft limit")
        parser.add_argument("--expires", metavar="WHEN", help="ISO 8601, or a span: 30d, 12h")
        parser.add_argument(
            "--metadata", action="append", metavar="NAME=VALUE", help="a label (repeatable)"
        )

    create = actions.add_parser("create", help="a new key; its secret is shown once")
    create.add_argument("name")
    settings(create)
    common(create)
    listed = actions.add_parser("list", help="every key (never a secret)")
    common(listed)
    show = actions.add_parser("show", help="one key, by id or name")
    show.add_argument("ref")
    common(show)
    update = actions.add_parser("update", help="change a key's settings")
    update.add_argument("ref")
    update.add_argument("--name", dest="new_name", help="a new name")
    update.add_argument("--no-budget", action="store_true", help="remove its budget")
    settings(update)
    common(update)
    rotate = actions.add_parser("rotate", help="a new secret; the old one works --grace seconds")
    rotate.add_argument("ref")
    rotate.add_argument("--grace", type=float, default=0.0, metavar="SECONDS")
    common(rotate)
    revoke = actions.add_parser("revoke", help="refuse the key from now on (every replica)")
    revoke.add_argument("ref")
    common(revoke)


def _changes(args: argparse.Namespace) -> dict[str, Any]:
    changes: dict[str, Any] = {}
    for name in ("team", "user", "rpm", "tpm"):
        if getattr(args, name, None) is not None:
            changes[name] = getattr(args, name)
    if args.models is not None:
        changes["models"] = args.models
    if args.budget is not None:
        budget: dict[str, Any] = {"limit": args.budget, "period": args.period}
        if args.soft is not None:
            budget["soft"] = args.soft
        changes["budget"] = budget
    elif args.period is not None or args.soft is not None:
        raise ValueError("budget: --period and --soft need --budget")
    if getattr(args, "no_budget", False):
        changes["budget"] = None
    if args.expires is not None:
        changes["expires_at"] = args.expires
    if args.metadata:
        labels = {}
        for item in args.metadata:
            name, sep, value = item.partition("=")
            if not sep:
                raise ValueError("metadata: expected NAME=VALUE")
            labels[name] = value
        changes["metadata"] = labels
    if getattr(args, "new_name", None) is not None:
        changes["name"] = args.new_name
    return key_fields(changes)


def _table(keys: list[VirtualKey]) -> str:
    rows = [("NAME", "ID", "PREFIX", "TEAM", "USER", "MODELS", "RPM", "TPM", "BUDGET", "STATE")]
    now = datetime.now(UTC)
    for key in keys:
        budget = key.budget
        rows.append(
            (
                key.name,
                key.id,
                key.prefix + "...",
                key.team or "-",
                key.user or "-",
                ",".join(key.models) or "*",
                str(key.rpm or "-"),
                str(key.tpm or "-"),
                f"{budget.limit}/{budget.period or 'ever'}" if budget else "-",
                key.usable(now) or "active",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "".join(
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        + "\n"
        for row in rows
    )


def _show(key: VirtualKey, fmt: str) -> str:
    data = key.as_dict()
    budget = key.budget
    if budget is not None and fmt != "json":
        data["budget"] = f"{budget.limit} a {budget.period}" if budget.period else f"{budget.limit}"
        if budget.soft is not None:
            data["budget"] += f" (soft limit {budget.soft})"
    if fmt == "json":
        return json.dumps(data, indent=2) + "\n"
    return "".join(f"{name:<11} {_text(value)}\n" for name, value in data.items())


def _text(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, list):
        return ", ".join(map(str, value)) or "*"
    if isinstance(value, dict):
        return json.dumps(value) if value else "-"
    return str(value)


def _issued(issued: IssuedKey, fmt: str) -> str:
    if fmt == "json":
        return json.dumps({"secret": issued.secret, **issued.key.as_dict()}, indent=2) + "\n"
    return (
        f"secret      {issued.secret}\n"
        "            (shown once: only its hash is kept)\n" + _show(issued.key, fmt)
    )


def run(args: argparse.Namespace, database_of: Callable[[argparse.Namespace], Any]) -> int:
    """Run a ``keys`` command; `database_of` opens the database the arguments name."""
    from pipeline.errors import ConfigError, KeyNotFoundError, SchemaVersionError

    try:
        database = database_of(args)
        changes = _changes(args) if args.action in ("create", "update") else {}
    except (ConfigError, ValueError, TypeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    store = DatabaseKeyStore(database, auto_upgrade=False)

    async def act() -> str:
        try:
            action, fmt = args.action, args.format
            if action == "create":
                return _issued(await store.create(args.name, **changes), fmt)
            if action == "list":
                keys = await store.list()
                if fmt == "json":
                    return json.dumps([k.as_dict() for k in keys], indent=2) + "\n"
                return _table(keys)
            if action == "show":
                return _show(await store.get(args.ref), fmt)
            if action == "update":
                return _show(await store.update(args.ref, **changes), fmt)
            if action == "rotate":
                return _issued(await store.rotate(args.ref, grace=args.grace), fmt)
            return _show(await store.revoke(args.ref), fmt)
        finally:
            await store.aclose()

    try:
        print(asyncio.run(act()), end="")
    except KeyNotFoundError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except (ValueError, TypeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except SchemaVersionError as exc:
        print(str(exc), file=sys.stderr)
        return 1
    except Exception as exc:  # the database's failure, told by its type
        print(f"{database.describe()} failed ({type(exc).__name__})", file=sys.stderr)
        return 1
    return 0
