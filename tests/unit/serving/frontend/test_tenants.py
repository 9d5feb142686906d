"""The keys file and its checks, the per-tenant limiter, the cache namespaces."""

from __future__ import annotations

import hashlib

import pytest

from serving.frontend.errors import APIError
from serving.frontend.tenants.keys import KeysFileError, Principal, TenantPolicy, load, parse
from serving.frontend.tenants.limits import TenantLimiter
from serving.frontend.tenants.namespace import cache_namespace
from serving.frontend.tenants.store import KeyStore

KEY_A, KEY_B = "sk-tenant-a-0123456789", "sk-tenant-b-0123456789"
FILE = f"""
[tenants.a]
priority = 2
max_concurrent_requests = 2
tokens_per_minute = 600

[[keys]]
tenant = "a"
key = "{KEY_A}"

[[keys]]
tenant = "b"
role = "admin"
sha256 = "{hashlib.sha256(KEY_B.encode()).hexdigest()}"
"""


def test_keys_name_tenants_and_roles():
    table, plaintext = parse(FILE)
    assert plaintext
    assert table.lookup(KEY_A) == Principal("a", "user") and table.lookup(KEY_B) == Principal("b", "admin")
    assert table.lookup(KEY_A + "x") is None and table.lookup(None) is None and table.lookup("") is None
    assert table.policy("a") == TenantPolicy(2, 2, 600) and table.policy("b") == TenantPolicy()


@pytest.mark.parametrize(
    "bad, says",
    [
        ("[[keys]]\ntenant = 'a'\nkey = 'short'", "at least 16"),
        ("[[keys]]\ntenant = 'a'\nrole = 'root'\nkey = 'sk-0123456789abcdef'", "role"),
        ("[[keys]]\ntenant = 'a'\nkey = 'sk-0123456789abcdef'\nsha256 = 'ab'", "exactly one"),
        (
            "[[keys]]\ntenant = 'a'\nkey = 'sk-0123456789abcdef'\n[[keys]]\ntenant = 'b'\nkey = 'sk-0123456789abcdef'",
            "twice",
        ),
        ("[tenants.a]\nmax_concurrent_requests = 0", "integer in"),
        ("[tenants.a]\nburst = 3", "fields"),
        ("[[keys]]\ntenant = 'a'\nsha256 = 'zz'", "64 hex"),
        ("keys = [", "TOML"),
    ],
)
def test_a_bad_file_is_refused_without_showing_a_key(bad, says):
    with pytest.raises(KeysFileError, match=says) as err:
        parse(bad)
    assert "sk-0123456789abcdef" not in str(err.value)


def test_permissions_are_checked(tmp_path):
    path = tmp_path / "keys.toml"
    path.write_text(FILE)
    path.chmod(0o644)  # plaintext keys readable by others
    with pytest.raises(KeysFileError, match="readable by group or others"):
        load(path)
    path.chmod(0o620)
    with pytest.raises(KeysFileError, match="writable"):
        load(path)
    path.chmod(0o600)
    assert len(load(path, "sk-single-key-0123456789").keys) == 3
    hashed = tmp_path / "hashed.toml"
    hashed.write_text(FILE.replace(f'key = "{KEY_A}"', f'sha256 = "{hashlib.sha256(KEY_A.encode()).hexdigest()}"'))
    hashed.chmod(0o644)  # digests only: readable is fine
    assert load(hashed).lookup(KEY_A) == Principal("a", "user")


def test_a_failed_reload_keeps_the_keys_in_force(tmp_path):
    path = tmp_path / "keys.toml"
    path.write_text(FILE)
    path.chmod(0o600)
    store, results = KeyStore(str(path), None), []
    store.on_reload = results.append
    path.write_text("not toml [")
    store.poll()
    assert results == ["failed"] and store.table.lookup(KEY_A) is not None
    path.write_text(FILE.replace(KEY_A, KEY_A + "-new"))
    store.poll()
    assert results == ["failed", "ok"] and store.table.lookup(KEY_A) is None
    assert store.table.lookup(KEY_A + "-new") == Principal("a", "user") and store.tenants() == ["a", "b"]


def test_concurrency_and_token_rate_per_tenant():
    now = [0]
    policies = {"a": TenantPolicy(max_concurrent_requests=2), "t": TenantPolicy(tokens_per_minute=600)}
    lim = TenantLimiter(lambda t: policies.get(t, TenantPolicy()), clock=lambda: now[0])
    assert lim.acquire("a", (1, "r1"), 10) is None and lim.acquire("a", (2, "r2"), 10) is None
    r = lim.acquire("a", (1, "r3"), 10)
    assert r.limit == "concurrency" and "2" in r.message and r.retry_after == 1
    assert lim.acquire("other", (1, "x"), 10**6) is None  # no limits
    lim.release((2, "r2"), 5)
    assert lim.acquire("a", (1, "r3"), 10) is None
    assert lim.drop_worker(1) == 3 and lim.in_flight["a"] == 0  # r1, r3 and x died with worker 1
    # the bucket: 600 a minute, charged the prompt at admission and the output at the end
    assert lim.acquire("t", (0, "p"), 500) is None
    lim.release((0, "p"), 300)  # 600 - 500 - 300: 200 in debt
    r = lim.acquire("t", (0, "q"), 100)
    assert r.limit == "tokens" and r.retry_after == 30  # 300 tokens at 10 a second
    now[0] += 30 * 10**9
    assert lim.acquire("t", (0, "q"), 100) is None


def test_namespaces_follow_the_sharing_policy():
    assert cache_namespace("tenant", "a", None) != cache_namespace("tenant", "b", None)
    assert cache_namespace("tenant", "a", "s1") not in (
        cache_namespace("tenant", "a", None),
        cache_namespace("tenant", "a", "s2"),
    )
    assert cache_namespace("salt-only", "a", None) == cache_namespace("salt-only", "b", None) == ""
    assert cache_namespace("salt-only", "a", "s") == cache_namespace("salt-only", "b", "s") != ""
    assert cache_namespace("global", "a", None) == ""
    with pytest.raises(APIError) as err:
        cache_namespace("global", "a", "s")
    assert err.value.status == 400 and err.value.code == "cache_salt_unsupported"
    assert "acme" not in cache_namespace("tenant", "acme", None)  # a digest, not the name
