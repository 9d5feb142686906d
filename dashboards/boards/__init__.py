"""The bundled dashboards, one module each; `BOARDS` is what the generator writes."""

from dashboards.boards import engine, latency, overview, slo, troubleshooting

BOARDS = (overview.board, latency.board, engine.board, slo.board, troubleshooting.board)
