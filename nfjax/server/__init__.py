"""OpenAI-compatible HTTP server: Starlette app, engine-loop thread, SSE, Prometheus metrics."""
from nfjax.server.app import DEFAULT_MODEL_NAME, create_app, model_name_for
from nfjax.server.launch import ServerThread, serve

__all__ = ["DEFAULT_MODEL_NAME", "ServerThread", "create_app", "model_name_for", "serve"]
