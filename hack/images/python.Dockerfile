# Python 3.11 on Debian bookworm from Debian's packages: the PYTHON_IMAGE the operator and CPU
# worker Dockerfiles build from where no registry is reachable (hack/images.sh).
ARG BASE_IMAGE=debian:bookworm-slim
FROM ${BASE_IMAGE}
# hadolint ignore=DL3008
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
       python3 python3-venv python-is-python3 ca-certificates \
    && rm -rf /var/lib/apt/lists/*
