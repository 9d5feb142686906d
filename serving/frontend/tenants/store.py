"""The keys in force in one process, reloaded without a restart.

Every process that checks keys or limits (the single front end; with several tokenizer
workers, each worker and the hub) holds a `KeyStore`.  It reloads the keys file when the
file changes (its inode, size or mtime, looked at every `POLL_SECONDS`: an editor's
rename and a Kubernetes Secret's symlink swap count) and on SIGHUP (the hub passes SIGHUP
on to its workers).  A reload swaps the whole table at once: a request checks the table
it found, streams in flight are untouched, the next request sees the new keys.  A file
that fails its checks keeps the previous keys; the error is logged (never a key) and
counted in `sightline_api_key_reloads_total{result="failed"}`.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Callable

from serving.frontend.tenants.keys import KeysFileError, KeyTable, TenantPolicy, load

log = logging.getLogger("sightline.auth")
POLL_SECONDS = 1.0


class KeyStore:
    def __init__(self, path: str | None, single_key: str | None) -> None:
        self.path, self.single_key = path, single_key
        self.table: KeyTable = load(path, single_key)  # raises KeysFileError: the server does not start
        self._seen = self._signature()
        self.on_reload: Callable[[str], None] = lambda result: None  # a metric: ok | failed

    @property
    def enabled(self) -> bool:
        """Keys are required (a keys file or --api-key); without, every request is tenant `default`."""
        return bool(self.table.keys) or self.path is not None

    def policy(self, tenant: str) -> TenantPolicy:
        return self.table.policy(tenant)

    def tenants(self) -> list[str]:
        """Every tenant the keys name, sorted: the values the tenant label may take."""
        return sorted({p.tenant for _, p in self.table.keys} | set(self.table.tenants))

    def _signature(self) -> tuple | None:
        if self.path is None:
            return None
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return st.st_ino, st.st_size, st.st_mtime_ns

    def reload(self, why: str = "SIGHUP") -> bool:
        if self.path is None:
            return True
        self._seen = self._signature()
        try:
            table = load(self.path, self.single_key)
        except KeysFileError as exc:
            log.error("keys file not reloaded (%s); the previous keys stay in force: %s", why, exc)
            self.on_reload("failed")
            return False
        self.table = table
        log.info("keys file reloaded (%s): %d keys, tenants %s", why, len(table.keys), ", ".join(self.tenants()))
        self.on_reload("ok")
        return True

    def poll(self) -> None:
        if self.path is not None and self._signature() != self._seen:
            self.reload("file changed")

    async def watch(self) -> None:
        while True:
            await asyncio.sleep(POLL_SECONDS)
            self.poll()
