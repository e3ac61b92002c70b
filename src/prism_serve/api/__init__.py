"""HTTP layer: the OpenAI-compatible server (server.py), request and response shapes (protocol.py),
errors in OpenAI's JSON shape (errors.py), /metrics (metrics.py) and the admin routes (admin.py)."""
