"""API keys and the tenants they name: the keys file, its checks, and the lookup every request makes.

The keys file (`--api-keys-file`, TOML) lists tenants and keys:

    [tenants.acme]                  # every field optional
    priority = -1                   # --priority-order lower-first (default): lower is served first
    max_concurrent_requests = 8     # in flight at once, over every tokenizer worker
    tokens_per_minute = 60000       # prompt tokens when admitted + output tokens when finished
    slo_ttft_ms = 500               # latency objectives of its requests (telemetry/request_slo.py), each
    slo_tpot_ms = 50                # overridden per request by its header: x-llm-d-slo-ttft-ms, ...
    slo_e2e_ms = 10000

    [[keys]]
    tenant = "acme"
    role = "user"                   # user (generation, /v1/models) | admin (also /debug/*, /flush_cache, control)
    sha256 = "9f86d08..."           # the key's SHA-256 in hex; or `key = "sk-..."` (then the file is a secret)

A tenant named by a key but not under `[tenants]` has no limits and priority 0.  The
single `--api-key` (`SIGHTLINE_API_KEY`) is still accepted: tenant `default`, role admin.

Checked when the server starts (a bad file stops it): valid TOML, known fields, each
key at least 16 characters, no key twice, and permissions — never writable by group or
others (anyone could add an admin key), and, when it holds plaintext `key`s, not
readable by them either.  A reload that fails the same checks keeps the keys in force
and says why in the log.

Lookups compare SHA-256 digests with `hmac.compare_digest` against every known key, so
the time taken depends on neither the presented key nor how much of it matches.  Keys
are never logged: only tenants and roles are.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import stat
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from telemetry.request_slo import MAX_MS, Objectives

ROLES = ("user", "admin")
DEFAULT_TENANT = "default"
MIN_KEY_CHARS = 16
_SLO_FIELDS = ("slo_ttft_ms", "slo_tpot_ms", "slo_e2e_ms")
_TENANT_FIELDS = {"priority", "max_concurrent_requests", "tokens_per_minute", *_SLO_FIELDS}
_KEY_FIELDS = {"tenant", "role", "key", "sha256"}


class KeysFileError(ValueError):
    """The keys file cannot be used (its path, permissions or contents); the message never holds a key."""


@dataclass(frozen=True)
class TenantPolicy:
    """What a tenant may do: its priority and its limits (None: unlimited)."""

    priority: int = 0
    max_concurrent_requests: int | None = None
    tokens_per_minute: int | None = None
    objectives: Objectives | None = None  # its requests' latency objectives, where their headers set none

    @property
    def limited(self) -> bool:
        return self.max_concurrent_requests is not None or self.tokens_per_minute is not None


@dataclass(frozen=True)
class Principal:
    """Who sent a request: the tenant its key names and the key's role."""

    tenant: str
    role: str

    @property
    def admin(self) -> bool:
        return self.role == "admin"


ANONYMOUS = Principal(DEFAULT_TENANT, "admin")  # no key configured: one tenant, today's behaviour


def digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


@dataclass
class KeyTable:
    """Every accepted key (as a digest) with its principal, and every tenant's policy."""

    keys: list[tuple[bytes, Principal]] = field(default_factory=list)
    tenants: dict[str, TenantPolicy] = field(default_factory=dict)

    def lookup(self, presented: str | None) -> Principal | None:
        """The principal of `presented`, or None; constant time over the table, whatever is presented."""
        candidate = digest(presented or "")
        found = None
        for known, principal in self.keys:
            if hmac.compare_digest(known, candidate):
                found = principal
        return found if presented is not None else None

    def policy(self, tenant: str) -> TenantPolicy:
        return self.tenants.get(tenant, TenantPolicy())


def _int_field(where: str, name: str, value: object, low: int, high: int = 2**62) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise KeysFileError(f"{where}: {name} must be an integer in [{low}, {high}]")
    return value


def _slo_fields(where: str, spec: dict) -> Objectives | None:
    """A tenant's `slo_*_ms` fields: milliseconds in (0, 1 day]; None when it sets none."""
    values = {}
    for name in _SLO_FIELDS:
        if name in spec:
            v = spec[name]
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not 0 < v <= MAX_MS:
                raise KeysFileError(f"{where}: {name} must be a number of milliseconds in (0, {MAX_MS:.0f}]")
            values[name.removeprefix("slo_")] = float(v)
    return Objectives.from_ms(**values) if values else None


def check_permissions(path: Path, plaintext: bool) -> None:
    """Refuse a file others could write (or read, when it holds plaintext keys)."""
    mode = path.stat().st_mode
    if not stat.S_ISREG(mode):
        raise KeysFileError(f"{path} is not a regular file")
    if mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise KeysFileError(f"{path} is writable by group or others (mode {stat.S_IMODE(mode):o}); chmod 600 it")
    if plaintext and mode & (stat.S_IRGRP | stat.S_IROTH):
        raise KeysFileError(
            f"{path} holds plaintext keys and is readable by group or others (mode "
            f"{stat.S_IMODE(mode):o}); chmod 600 it, or list the keys as sha256"
        )


def parse(text: str, where: str = "keys file") -> tuple[KeyTable, bool]:
    """The table a keys file describes, and whether it holds plaintext keys; raises KeysFileError."""
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise KeysFileError(f"{where}: not valid TOML ({exc})") from None
    if set(doc) - {"tenants", "keys"}:
        raise KeysFileError(f"{where}: unknown sections {sorted(set(doc) - {'tenants', 'keys'})}")
    table, plaintext = KeyTable(), False
    for name, spec in (doc.get("tenants") or {}).items():
        if not isinstance(spec, dict) or set(spec) - _TENANT_FIELDS:
            raise KeysFileError(f"{where}: tenants.{name}: fields are {sorted(_TENANT_FIELDS)}")
        table.tenants[name] = TenantPolicy(
            priority=_int_field(f"tenants.{name}", "priority", spec.get("priority", 0), -1000, 1000),
            max_concurrent_requests=None
            if "max_concurrent_requests" not in spec
            else _int_field(f"tenants.{name}", "max_concurrent_requests", spec["max_concurrent_requests"], 1),
            tokens_per_minute=None
            if "tokens_per_minute" not in spec
            else _int_field(f"tenants.{name}", "tokens_per_minute", spec["tokens_per_minute"], 1),
            objectives=_slo_fields(f"tenants.{name}", spec),
        )
    seen: set[bytes] = set()
    for i, entry in enumerate(doc.get("keys") or []):
        at = f"{where}: keys[{i}]"
        if not isinstance(entry, dict) or set(entry) - _KEY_FIELDS:
            raise KeysFileError(f"{at}: fields are {sorted(_KEY_FIELDS)}")
        tenant, role = entry.get("tenant"), entry.get("role", "user")
        if not isinstance(tenant, str) or not tenant or len(tenant) > 64:
            raise KeysFileError(f"{at}: tenant must be a name of 1-64 characters")
        if role not in ROLES:
            raise KeysFileError(f"{at}: role must be one of {', '.join(ROLES)}")
        if ("key" in entry) == ("sha256" in entry):
            raise KeysFileError(f"{at}: give exactly one of key and sha256")
        if "key" in entry:
            key = entry["key"]
            if not isinstance(key, str) or len(key) < MIN_KEY_CHARS:
                raise KeysFileError(f"{at}: key must be at least {MIN_KEY_CHARS} characters")
            d, plaintext = digest(key), True
        else:
            try:
                d = bytes.fromhex(entry["sha256"])
            except (TypeError, ValueError):
                d = b""
            if len(d) != 32:
                raise KeysFileError(f"{at}: sha256 must be 64 hex digits")
        if d in seen:
            raise KeysFileError(f"{at}: the same key is listed twice")
        seen.add(d)
        table.keys.append((d, Principal(tenant, role)))
    return table, plaintext


def load(path: str | os.PathLike, single_key: str | None = None) -> KeyTable:
    """Read and check the keys file (None: none), adding the single `--api-key` as tenant `default`, admin."""
    table = KeyTable()
    if path is not None:
        p = Path(path)
        try:
            text = p.read_text()
        except OSError as exc:
            raise KeysFileError(f"cannot read the keys file {p}: {exc.strerror}") from None
        table, plaintext = parse(text, str(p))
        check_permissions(p, plaintext)
    if single_key:
        table.keys.append((digest(single_key), Principal(DEFAULT_TENANT, "admin")))
    return table
