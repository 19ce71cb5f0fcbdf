"""API keys: `Authorization: Bearer KEY`, compared in constant time, and each key's priority class.

Every configured key is compared (no early exit) with `hmac.compare_digest`, so the time taken does not
tell an attacker how much of a guess was right. Keys may carry a priority class (`--api-key-priority
KEY=PRIO`): it is the default and the ceiling of that key's requests, so a batch tier cannot promote
itself by sending `priority: 1000`. With no key mapping at all, clients are trusted with `priority`.
"""

from __future__ import annotations

import hmac

from llmopt.serve.errors import ApiError, error_response


class ApiKeyAuth:
    def __init__(self, keys: list[str], priorities: dict[str, int] | None = None):
        self._keys = [k.encode("utf-8") for k in keys]
        self._priorities = dict(priorities or {})

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def authenticate(self, authorization: str | None) -> str | None:
        """The matching key, None when auth is off; 401 otherwise."""
        if not self._keys:
            return None
        scheme, _, token = (authorization or "").partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            raise ApiError(401, "missing API key: send 'Authorization: Bearer <key>'", code="invalid_api_key",
                           headers={"WWW-Authenticate": "Bearer"})
        given = token.encode("utf-8", "surrogateescape")
        match = None
        for key in self._keys:
            if hmac.compare_digest(key, given):
                match = key
        if match is None:
            raise ApiError(401, "incorrect API key provided", code="invalid_api_key",
                           headers={"WWW-Authenticate": "Bearer"})
        return match.decode("utf-8")

    def priority(self, key: str | None, requested: int | None) -> int:
        """The request's priority class (higher = sooner), capped by the key's class when keys have one."""
        if not self._priorities:
            return requested or 0
        cap = self._priorities.get(key, 0) if key is not None else 0
        return cap if requested is None else min(requested, cap)


SCOPE_KEY = "llmopt.api_key"
PROTECTED_PATHS = ("/tokenize", "/detokenize")  # besides everything under /v1/


def is_protected(path: str) -> bool:
    return path.startswith("/v1/") or path in PROTECTED_PATHS


class ApiKeyMiddleware:
    """Checks keys on /v1/, /tokenize and /detokenize before the body is read or parsed (so strangers
    learn nothing about parsing); /health and /metrics stay open for probes and scrapers. The matched key
    goes in the ASGI scope."""

    def __init__(self, app, auth: ApiKeyAuth):
        self.app = app
        self.auth = auth

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and self.auth.enabled and is_protected(scope.get("path", "")):
            header = None
            for name, value in scope.get("headers", ()):
                if name == b"authorization":
                    header = value.decode("latin-1")
                    break
            try:
                scope[SCOPE_KEY] = self.auth.authenticate(header)
            except ApiError as e:
                await error_response(e)(scope, receive, send)
                return
        await self.app(scope, receive, send)
