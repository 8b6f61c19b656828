# The kind node's base image (what kind's images/base/Dockerfile makes), from Debian packages:
# systemd, containerd, runc and the CNI plugins of the BASE_IMAGE's release, plus kind's own files
# (entrypoint, systemd units, containerd config) taken from the kind Go module. hack/images.sh
# builds it with the kind files as the context; the Kubernetes binaries and the component images
# go in afterwards (hack/images.sh node_image).
ARG BASE_IMAGE=debian:bookworm-slim
FROM ${BASE_IMAGE}
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# kind's package list, less what only rootless or storage tests use (fuse-overlayfs, nfs, iscsi).
# hadolint ignore=DL3008
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
       systemd containerd runc containernetworking-plugins \
       conntrack iptables nftables iproute2 ethtool util-linux mount kmod \
       libseccomp2 pigz e2fsprogs bash ca-certificates curl jq procps \
    && rm -rf /var/lib/apt/lists/* \
    && find /lib/systemd/system/sysinit.target.wants/ -name "systemd-tmpfiles-setup.service" -delete \
    && rm -f /lib/systemd/system/multi-user.target.wants/* \
    && rm -f /etc/systemd/system/*.wants/* \
    && rm -f /lib/systemd/system/local-fs.target.wants/* \
    && rm -f /lib/systemd/system/sockets.target.wants/*udev* \
    && rm -f /lib/systemd/system/sockets.target.wants/*initctl* \
    && rm -f /lib/systemd/system/basic.target.wants/* \
    && echo "ReadKMsg=no" >> /etc/systemd/journald.conf \
    && ln -sf /usr/lib/systemd/systemd /sbin/init
COPY usr/local/bin/ /usr/local/bin/
COPY kind/ /kind/
COPY etc/ /etc/
# kind's units and hooks expect containerd in /usr/local/bin and the CNI plugins in /opt/cni/bin;
# Debian puts them in /usr/bin and /usr/lib/cni. cri-base.json is kind's OCI base spec: the
# default spec plus the hook that mounts the node's product_uuid, without rlimits.
RUN chmod 0755 /usr/local/bin/* /kind/bin/* \
    && ln -sf /usr/bin/containerd /usr/local/bin/containerd \
    && mkdir -p /opt/cni && ln -sfn /usr/lib/cni /opt/cni/bin \
    && ctr oci spec \
       | jq '.hooks.createContainer[.hooks.createContainer| length] |= . + {"path": "/kind/bin/mount-product-files.sh"}' \
       | jq 'del(.process.rlimits)' > /etc/containerd/cri-base.json \
    && systemctl enable kubelet.service containerd.service undo-mount-hacks.service \
    && systemctl mask systemd-binfmt.service \
    && mkdir -p /etc/kubernetes/manifests \
    && containerd --version && runc --version
ENV container=docker
STOPSIGNAL SIGRTMIN+3
ENTRYPOINT ["/usr/local/bin/entrypoint", "/sbin/init"]
