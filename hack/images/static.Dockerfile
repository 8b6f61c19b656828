# One static Go binary on an empty image (the Kubernetes control-plane components, CoreDNS, pause,
# KubeRay's operator). hack/images.sh builds it with a context holding only that binary.
FROM scratch
ARG BINARY
ARG DEST=/usr/local/bin
ARG USER_ID=0
COPY ${BINARY} ${DEST}/${BINARY}
ENV PATH=/usr/local/bin:/usr/bin:/bin
USER ${USER_ID}:${USER_ID}
