"""A request's scope from HTTP: its tenant's cache salt and the agent session it continues.

    scope = request_scope(request, cache_salt=body.cache_salt, session_id=body.session_id)

The session is named by a header, as agent gateways send it: ``X-Session-Id``, or Dynamo's
``X-Dynamo-Session-ID``, or Claude Code's ``X-Claude-Code-Session-Id``; or by the body's ``session_id`` (vLLM's field). A body and a header
that name two sessions are a 400. The salt is the body's ``cache_salt`` (vLLM's field, on
every route), checked by vLLM's rule.
"""

from __future__ import annotations

from fastapi import Request

from dualpath.server.errors import bad_request
from dualpath.types import RequestScope, check_cache_salt

# Header names a session id arrives under, first found wins (HTTP headers are case-blind).
SESSION_HEADERS = ("x-session-id", "x-dynamo-session-id", "x-claude-code-session-id")
MAX_SESSION_ID_CHARS = 256


def request_scope(
    request: Request, *, cache_salt: object = None, session_id: object = None
) -> RequestScope:
    """The request's scope; a 400 naming the field for a bad salt or session id."""
    try:
        check_cache_salt(cache_salt)
    except ValueError as exc:
        raise bad_request(str(exc), "cache_salt") from exc
    header_session = next(
        (request.headers[name] for name in SESSION_HEADERS if name in request.headers), None
    )
    if session_id is not None and not isinstance(session_id, str):
        raise bad_request("session_id must be a string", "session_id")
    if session_id is not None and header_session is not None and session_id != header_session:
        raise bad_request(
            f"the body's session_id {session_id!r} and the header's {header_session!r} differ",
            "session_id",
        )
    session = session_id if session_id is not None else header_session
    if session is not None and not 0 < len(session) <= MAX_SESSION_ID_CHARS:
        raise bad_request(
            f"a session id must have 1 to {MAX_SESSION_ID_CHARS} characters", "session_id"
        )
    return RequestScope(cache_salt=cache_salt, session_id=session)  # type: ignore[arg-type]
