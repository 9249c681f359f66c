"""The server's HTTP errors, with OpenAI's body `{"error": {"message", "type", "param", "code"}}`."""
from __future__ import annotations


class APIError(Exception):
    """An HTTP error with an OpenAI-style body."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 type: str = "invalid_request_error", code: str | int | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(param: str | None, message: str) -> APIError:
    """A 400 naming the field at fault (`param`)."""
    return APIError(400, message, param)


def model_not_found(name: str) -> APIError:
    """What vLLM answers for a model it does not serve: 404, "The model `X` does not exist." (type
    NotFoundError, code 404); `param` names the field."""
    return APIError(404, f"The model `{name}` does not exist.", "model", type="NotFoundError", code=404)
