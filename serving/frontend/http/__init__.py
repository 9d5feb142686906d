"""HTTP: the transport (`server.py`), the app and its route table (`app.py`), one middleware per
file (`middleware/`), the handlers by concern (`routes/`), and what they share (`state.py`)."""
