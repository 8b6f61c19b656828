# A Debian image with a few packages and, optionally, one binary: kube-proxy (nftables, conntrack),
# etcd (Debian's etcd-server), the node network daemon (iproute2, curl, jq).
ARG BASE_IMAGE=debian:bookworm-slim
FROM ${BASE_IMAGE}
ARG PACKAGES
# hadolint ignore=DL3008
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends ${PACKAGES} \
    && rm -rf /var/lib/apt/lists/*
COPY bin/ /usr/local/bin/
