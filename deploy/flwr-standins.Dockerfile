# Local stand-ins for flwr/superlink, flwr/supernode, flwr/superexec, for a Docker host
# that reaches no container registry but PyPI (docs/DEPLOYMENT.md, "Docker Compose demo"):
# same user (app, uid 49999), same venv layout (/python/venv, owned by app so that
# `pip install` in a derived image works as app), WORKDIR /app, same entrypoints.
# BASE_IMAGE: any image with python3 (>= 3.11) and its venv module, e.g. the Debian one
# deploy/make-base-image.sh builds from Debian's mirror. deploy/compose-demo.sh
# --base-image IMAGE builds them; by hand:
#   for t in superlink supernode superexec; do DOCKER_BUILDKIT=0 docker build --target $t \
#     --build-arg BASE_IMAGE=IMAGE -t local/flwr-$t:1.42.0 -f deploy/flwr-standins.Dockerfile deploy; done
ARG BASE_IMAGE=local/debian-python:bookworm
FROM ${BASE_IMAGE} AS base
ARG FLWR_VERSION=1.42.0
RUN useradd --uid 49999 --user-group --create-home --home-dir /home/app --shell /bin/bash app \
    && python3 -m venv /python/venv && mkdir -p /app && chown -R app:app /python /app
ENV PATH=/python/venv/bin:$PATH PYTHONUNBUFFERED=1
USER app
RUN python -m pip install --no-cache-dir "flwr==${FLWR_VERSION}" \
    && python -c "import flwr; print(flwr.__version__)"
WORKDIR /app

FROM base AS superlink
ENTRYPOINT ["flower-superlink"]
FROM base AS supernode
ENTRYPOINT ["flower-supernode"]
FROM base AS superexec
ENTRYPOINT ["flower-superexec"]
