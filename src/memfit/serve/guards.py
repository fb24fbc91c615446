"""What every request passes before a route sees it: HTTP basic auth (memfit serve --api-auth) and the
limit on a request body's size (--max-body).

Both are plain ASGI middleware rather than FastAPI's ``@app.middleware("http")``: that wrapper hands
the route a receive channel of its own, through which a route waiting on a job could no longer see its
client go away, and it reads nothing of the body before the route does, so a body too large would be
read whole before anything could refuse it.
"""

from __future__ import annotations

import base64
import binascii
import json
import logging
import secrets

from starlette.exceptions import HTTPException

from memfit.sizes import format_bytes

__all__ = ["BasicAuth", "BodyLimit"]

log = logging.getLogger("memfit.serve")


async def _answer(send, status: int, detail: str, headers: tuple[tuple[bytes, bytes], ...] = ()) -> None:
    body = json.dumps({"detail": detail}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *headers]})
    await send({"type": "http.response.body", "body": body})


def _header(scope, name: bytes) -> str | None:
    return next((value.decode("latin-1") for key, value in scope.get("headers", ()) if key.lower() == name), None)


class BasicAuth:
    """HTTP basic auth on every route, as A1111's --api-auth: ``credentials`` is "user:password". The scheme's
    name is case-insensitive ("basic" and "BASIC" too), as HTTP's authentication schemes are."""

    def __init__(self, app, *, credentials: str):
        self.app = app
        self._expected = credentials.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or self._accepts(_header(scope, b"authorization") or ""):
            return await self.app(scope, receive, send)
        await _answer(send, 401, "Not authenticated", ((b"www-authenticate", b'Basic realm="memfit"'),))

    def _accepts(self, given: str) -> bool:
        scheme, _, encoded = given.strip().partition(" ")
        if scheme.lower() != "basic":
            return False
        try:
            credentials = base64.b64decode(encoded.strip(), validate=True)
        except (binascii.Error, ValueError):
            return False
        return secrets.compare_digest(credentials, self._expected)


class BodyLimit:
    """Refuse (413, naming the limit) a request whose body is over ``max_bytes``: at once where its
    Content-Length says so, else as soon as the bytes read pass the limit (a chunked body)."""

    def __init__(self, app, *, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    def refusal(self, size: str = "") -> str:
        return (f"The request body is {size + ', ' if size else ''}more than the {format_bytes(self.max_bytes)} a "
                "request may send; send smaller images (memfit serve --max-body raises the limit).")

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = _header(scope, b"content-length")
        if declared is not None and declared.strip().isdigit() and int(declared) > self.max_bytes:
            log.info("%s %s: 413, a body of %s", scope["method"], scope["path"], format_bytes(int(declared)))
            return await _answer(send, 413, self.refusal(format_bytes(int(declared))))
        received = 0

        async def limited():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    log.info("%s %s: 413, a body of more than %s", scope["method"], scope["path"],
                             format_bytes(self.max_bytes))
                    # Raised to the route reading the body: FastAPI answers an HTTPException as it is.
                    raise HTTPException(413, self.refusal())
            return message

        await self.app(scope, limited, send)
