"""`colibri-plan serve`: an OpenAI-compatible HTTP server over one open engine session (``worker``: the
engine thread and its bounded queue; ``gen``: one request's generation; ``schema``: the request bodies and
error replies; ``app``: the ASGI app)."""
