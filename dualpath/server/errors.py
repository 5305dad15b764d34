"""OpenAI's error shape, and the one place an exception becomes an HTTP status.

Every error response is ``{"error": {"message", "type", "param", "code"}}``, as OpenAI sends
it, so the official clients raise their matching exception (``BadRequestError`` for 400,
``AuthenticationError`` for 401, ``RateLimitError`` for 429, ...).
"""

from __future__ import annotations

import json
import logging
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from dualpath.errors import DualPathError

logger = logging.getLogger(__name__)

_STATUS_TO_TYPE = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable_error",
}


class APIError(Exception):
    """An error the client should see: status, message and (optionally) the bad parameter."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers  # e.g. a 503's Retry-After


def unavailable(reason: str, retry_after_s: int) -> APIError:
    """A 503 for a server that cannot serve now but will (engines joining or lost): clients
    and load balancers read ``Retry-After`` (RFC 9110 §10.2.3) and come back."""
    return APIError(503, reason, headers={"Retry-After": str(retry_after_s)})


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


def error_body(
    status: int, message: str, *, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {
        "error": {
            "message": message,
            "type": _STATUS_TO_TYPE.get(status, HTTPStatus(status).phrase.replace(" ", "")),
            "param": param,
            "code": code,
        }
    }


class ErrorJSONResponse(JSONResponse):
    """JSON with every non-ASCII character escaped: an error message may quote the client's
    input, and a lone surrogate in it ("\\ud800" is legal JSON) cannot be written as UTF-8."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


def log_error(error: APIError) -> None:
    """Every error answer in the log (INFO; the access log line beside it has the request id):
    what a client was told, for the operator whose agent stopped on it."""
    logger.info("answered %d: %s", error.status, error.message)


def error_response(error: APIError) -> JSONResponse:
    log_error(error)
    body = error_body(error.status, error.message, param=error.param, code=error.code)
    return ErrorJSONResponse(body, status_code=error.status, headers=error.headers)


def install_error_handlers(app: FastAPI) -> None:
    """Map every exception that can escape a route to OpenAI's error shape."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        content_type = request.headers.get("content-type")
        if not _is_json(content_type) and _is_body_error(exc.errors()):
            # The body was not parsed at all: say why, rather than "not a valid dictionary".
            got = "no Content-Type" if not content_type else f"Content-Type {content_type!r}"
            return error_response(
                bad_request(
                    f"the request body must be JSON sent with 'Content-Type: application/json' "
                    f"(got {got})",
                    "body",
                )
            )
        return error_response(validation_error(exc.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        response = error_response(APIError(exc.status_code, str(exc.detail)))
        response.headers.update(exc.headers or {})  # a 405's Allow (RFC 9110)
        return response

    @app.exception_handler(DualPathError)
    async def _dualpath_error(request: Request, exc: DualPathError) -> JSONResponse:
        logger.error("request failed: %s", exc)
        return error_response(APIError(500, f"{type(exc).__name__}: {exc}"))


def validation_error(errors: Any) -> APIError:
    """A pydantic/FastAPI validation failure as a 400 naming the first bad parameter."""
    messages, param = [], None
    for error in errors:
        location = [str(part) for part in error.get("loc", ()) if part != "body"]
        name = ".".join(location) or "body"
        param = param or name
        if error.get("type") == "extra_forbidden":
            messages.append(f"unrecognized request argument: {name}")
        elif error.get("type") == "json_invalid":
            messages.append(f"request body is not valid JSON: {error.get('msg')}")
        else:
            messages.append(f"{name}: {error.get('msg')}")
    return bad_request("; ".join(messages) or "invalid request", param)


def _is_json(content_type: str | None) -> bool:
    """FastAPI's rule for parsing a body as JSON: application/json or application/*+json."""
    if not content_type:
        return False
    media_type = content_type.split(";", 1)[0].strip().lower()
    return media_type == "application/json" or (
        media_type.startswith("application/") and media_type.endswith("+json")
    )


def _is_body_error(errors: Any) -> bool:
    return any(tuple(error.get("loc", ())) == ("body",) for error in errors)
