"""OpenAI's error shape, and the one place an exception becomes an HTTP status.

Every error response is ``{"error": {"message", "type", "param", "code"}}``, as OpenAI sends
it, so the official clients raise their matching exception (``BadRequestError`` for 400,
``AuthenticationError`` for 401, ``RateLimitError`` for 429, ...).
"""

from __future__ import annotations

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
        self, status: int, message: str, *, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code


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


def error_response(error: APIError) -> JSONResponse:
    body = error_body(error.status, error.message, param=error.param, code=error.code)
    return JSONResponse(body, status_code=error.status)


def install_error_handlers(app: FastAPI) -> None:
    """Map every exception that can escape a route to OpenAI's error shape."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(validation_error(exc.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(APIError(exc.status_code, str(exc.detail)))

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
