"""Which prefix-cache namespace a request reads and fills (`--prefix-cache-sharing`).

Cached prefixes are reused only inside one namespace, so `cached_tokens`, TTFT and the
cache counters of a request can say nothing about another namespace's prompts:

* `tenant` (default): the tenant its key names; a `cache_salt` narrows it to the requests
  of that tenant with the same salt.
* `salt-only`: one namespace for every request without a salt (vLLM's behaviour: tenants
  share), and one per salt.
* `global`: one namespace for everyone; a request with a `cache_salt` is refused (400
  `cache_salt_unsupported`): the salt would promise an isolation this server does not give.

The engine sees only a digest of the namespace (no tenant name, no salt).
"""

from __future__ import annotations

import hashlib

from serving.frontend.errors import bad_request

SHARING = ("tenant", "global", "salt-only")
MAX_SALT_CHARS = 256


def check_salt(salt: str | None) -> None:
    if salt is not None and not 1 <= len(salt) <= MAX_SALT_CHARS:
        raise bad_request(f"cache_salt must be 1 to {MAX_SALT_CHARS} characters", param="cache_salt")


def cache_namespace(sharing: str, tenant: str, salt: str | None) -> str:
    """The digest the Scheduler keys the request's cached prefixes by ("" is the shared namespace)."""
    if sharing == "global":
        if salt is not None:
            raise bad_request(
                "cache_salt has no effect on this server: it shares its prefix cache between all "
                "requests (--prefix-cache-sharing global)",
                param="cache_salt",
                code="cache_salt_unsupported",
            )
        return ""
    parts = ([tenant] if sharing == "tenant" else []) + ([salt] if salt is not None else [])
    if not parts:
        return ""
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:32]
