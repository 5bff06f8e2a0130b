"""API keys and their limits: ``--api-key`` / ``--api-key-file``, and the constant-time lookup.

The key file holds one key per line, optionally followed by ``FIELD=VALUE`` settings::

    # blank lines and lines starting with # are skipped
    sk-plain-key
    sk-abc123 name=team-a rpm=60 tpm=20000 max_concurrent=4 priority=0

``name`` (letters, digits, ``._-``; default ``key-`` + the first 8 hex digits of the key's
SHA-256) is what logs, metrics and the engine's fair share see: the key itself is never logged
or sent to the engine. ``rpm``, ``tpm`` and ``max_concurrent`` are per-key limits (whole
numbers >= 1; absent: unlimited); ``priority`` (a whole number, lower runs first) applies under
``--scheduling-policy priority``. See ``quotas.py`` for how each limit is counted. ``admin=1``
marks an operator's key (``--api-key`` keys are admins): it reads every key's usage and the
recent errors on ``/dashboard/stats``; any other key, its own usage only.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from dataclasses import dataclass, field, replace
from pathlib import Path

LIMIT_FIELDS = ("rpm", "tpm", "max_concurrent")
FIELDS = ("name", *LIMIT_FIELDS, "priority", "admin")
_BOOLEANS = {"1": True, "true": True, "yes": True, "0": False, "false": False, "no": False}
_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")


@dataclass(frozen=True)
class ApiKey:
    """One accepted key; ``secret`` is kept out of ``repr`` so a log line cannot leak it."""

    secret: bytes = field(repr=False)
    name: str
    rpm: int | None = None  # requests per minute
    tpm: int | None = None  # tokens per minute (see quotas.py for what counts)
    max_concurrent: int | None = None  # requests in flight at once
    priority: int = 0  # under --scheduling-policy priority: the most urgent a request may be
    admin: bool = False  # may read every key's usage and the recent errors on /dashboard/stats

    @property
    def has_limits(self) -> bool:
        return any(getattr(self, name) is not None for name in LIMIT_FIELDS)


def default_name(secret: str) -> str:
    """A name that identifies a key in logs without revealing it: a short hash."""
    return "key-" + hashlib.sha256(secret.encode()).hexdigest()[:8]


def load_api_keys(keys: list[str] | None, key_file: str | None) -> list[ApiKey]:
    """Keys from ``--api-key`` (repeatable; no limits) and ``--api-key-file`` (see the module doc).
    ValueError naming the file, line and what to change."""
    # --api-key is the operator's: an admin key (the file's keys are admins only with admin=1).
    found = [ApiKey(k.strip().encode(), default_name(k.strip()), admin=True) for k in keys or [] if k.strip()]
    if key_file is not None:
        found += _read_key_file(key_file)
    return _unique(found, key_file)


def _read_key_file(path: str) -> list[ApiKey]:
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as exc:
        raise ValueError(f"cannot read --api-key-file {path!r}: {exc.strerror}") from None
    keys = [
        parse_key_line(line, f"--api-key-file {path!r} line {number}")
        for number, line in enumerate(lines, 1)
        if line.strip() and not line.strip().startswith("#")
    ]
    if not keys:
        raise ValueError(f"--api-key-file {path!r} holds no keys (one key per line)")
    return keys


def parse_key_line(line: str, where: str) -> ApiKey:
    """``KEY [FIELD=VALUE ...]`` as an ApiKey; ``where`` starts every error message."""
    secret, *settings = line.split()
    if "=" in secret and secret.split("=", 1)[0] in FIELDS:
        raise ValueError(f"{where}: the line starts with {secret.split('=', 1)[0]}=; put the key first")
    values: dict[str, int | str | bool] = {}
    for setting in settings:
        name, sep, value = setting.partition("=")
        if not sep or name not in FIELDS:
            raise ValueError(f"{where}: {setting!r} is not FIELD=VALUE with FIELD one of {', '.join(FIELDS)}")
        if name in values:
            raise ValueError(f"{where}: {name} is set twice; keep one")
        values[name] = _field_value(name, value, where)
    name = str(values.pop("name", default_name(secret)))
    return ApiKey(secret.encode(), name, **values)  # type: ignore[arg-type]


def _field_value(name: str, value: str, where: str) -> int | str | bool:
    if name == "admin":
        if value.lower() not in _BOOLEANS:
            raise ValueError(f"{where}: admin={value!r} must be 1 or 0 (true or false)")
        return _BOOLEANS[value.lower()]
    if name == "name":
        if not _NAME.fullmatch(value):
            raise ValueError(f"{where}: name={value!r}: use 1-64 letters, digits, '.', '_' or '-'")
        return value
    try:
        number = int(value)
    except ValueError:
        number = None
    if number is None or (name != "priority" and number < 1):
        wanted = "a whole number" if name == "priority" else "a whole number >= 1 (leave it out for no limit)"
        raise ValueError(f"{where}: {name}={value!r} must be {wanted}")
    return number


def _unique(keys: list[ApiKey], key_file: str | None) -> list[ApiKey]:
    """The keys, each once. Names identify tenants in metrics and in the fair share, so two keys
    may not share one; a key listed twice with different settings is an error too (which would
    apply?). No message shows a key."""
    by_secret: dict[bytes, ApiKey] = {}
    names: set[str] = set()
    for key in keys:
        seen = by_secret.get(key.secret)
        if seen is not None and replace(seen, admin=key.admin) == key:
            # The same key and settings twice (say --api-key and the file): harmless; it is an
            # admin if either listing makes it one.
            by_secret[key.secret] = replace(seen, admin=seen.admin or key.admin)
            continue
        if seen is not None:
            raise ValueError(f"the API key named {key.name!r} is listed again as {seen.name!r}; list it once")
        if key.name in names:
            raise ValueError(
                f"two API keys are named {key.name!r} (--api-key / --api-key-file {key_file!r}); "
                "give each key its own name=NAME"
            )
        by_secret[key.secret] = key
        names.add(key.name)
    return list(by_secret.values())


def describe_keys(keys: list[ApiKey], policy: str) -> str:
    """The keys for the start-up log: names and limits, never the keys."""
    parts = []
    for key in keys:
        limits = [f"{name} {getattr(key, name)}" for name in LIMIT_FIELDS if getattr(key, name) is not None]
        if key.priority:
            limits.append(
                f"priority {key.priority}"
                + ("" if policy == "priority" else " (ignored: not --scheduling-policy priority)")
            )
        parts.append(f"{key.name} ({', '.join(limits) or 'no limits'})")
    return f"API keys: {'; '.join(parts)}; the engine serves keys in turn (fair share)"


class KeyRing:
    """The accepted keys; ``match`` compares the given token with every key in constant time
    (``hmac.compare_digest``, no early exit, no branch on which key matched)."""

    def __init__(self, keys: list[ApiKey]) -> None:
        self.keys = keys

    def __bool__(self) -> bool:
        return bool(self.keys)

    def match(self, token: str) -> ApiKey | None:
        given = token.encode()
        found = 0  # 1 + the index of the matching key; keys are unique, so at most one matches
        for index, key in enumerate(self.keys):
            found |= (index + 1) * hmac.compare_digest(given, key.secret)
        return self.keys[found - 1] if found else None
