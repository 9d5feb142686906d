"""HTTP middleware, one concern a file: response counting, request ids and trace context, Host and body checks, the
API key."""
