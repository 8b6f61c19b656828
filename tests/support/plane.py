"""The real control plane tests run against: etcd, kube-apiserver (RBAC), controller-manager,
KubeRay's CRDs and operator, from hack/controlplane.sh's cache. No kubelet: pods stay Pending.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from support.pki import Pki, admin_kubeconfig_yaml, make_pki, token_kubeconfig_yaml
from support.processes import Process, free_port, port_open, start_process

if TYPE_CHECKING:
    from kubernetes.client import ApiClient

REPO = Path(__file__).resolve().parents[2]
CONTROLPLANE_SH = REPO / "hack" / "controlplane.sh"
START_TIMEOUT_SECONDS = 120.0
SERVICE_CIDR = "10.0.0.0/24"
SA_ISSUER = "https://kubernetes.default.svc.cluster.local"
KUBERAY_CRDS = ("rayclusters", "rayjobs", "rayservices", "raycronjobs")


class PlaneError(RuntimeError):
    """The control plane could not be started or a command against it failed."""


def pinned_versions() -> dict[str, str]:
    """hack/versions.env as a dict (K8S_VERSION, HELM_VERSION, KUBERAY_VERSION, ...)."""
    values: dict[str, str] = {}
    for raw in (REPO / "hack" / "versions.env").read_text().splitlines():
        line = raw.strip()
        if line and not line.startswith("#") and "=" in line:
            key, value = line.split("=", 1)
            values[key] = value
    return values


@dataclass(frozen=True)
class Binaries:
    """Where the cached control-plane binaries live (hack/controlplane.sh's layout)."""

    kube_apiserver: Path
    kube_controller_manager: Path
    kubectl: Path
    helm: Path
    kuberay_operator: Path
    kuberay_crds: Path
    etcd: Path

    @classmethod
    def expected(cls) -> Binaries:
        versions = pinned_versions()
        cache = Path(os.environ.get("RLJOB_CACHE_DIR") or Path.home() / ".cache" / "rljob")
        kube = cache / f"k8s-{versions['K8S_VERSION']}" / "bin"
        kuberay = cache / f"kuberay-{versions['KUBERAY_VERSION']}"
        return cls(
            kube_apiserver=kube / "kube-apiserver",
            kube_controller_manager=kube / "kube-controller-manager",
            kubectl=kube / "kubectl",
            helm=cache / f"helm-{versions['HELM_VERSION']}" / "bin" / "helm",
            kuberay_operator=kuberay / "bin" / "kuberay-operator",
            kuberay_crds=kuberay / "crds",
            etcd=Path(shutil.which("etcd") or "/usr/bin/etcd"),
        )

    @classmethod
    def locate(cls, build_if_missing: bool = True) -> Binaries:
        """The cached binaries; on a fresh machine, build them first (minutes, printed)."""
        found = cls.expected()
        if found.missing():
            if not build_if_missing:
                raise PlaneError(
                    f"control-plane binaries missing ({', '.join(found.missing())}); "
                    f"run {CONTROLPLANE_SH} install"
                )
            print(
                f"control-plane binaries missing ({', '.join(found.missing())}): "
                f"building them with `{CONTROLPLANE_SH} install` (minutes on a fresh machine)",
                flush=True,
            )
            subprocess.run(["bash", str(CONTROLPLANE_SH), "install"], check=True)
            return cls.locate(build_if_missing=False)
        return found

    def missing(self) -> list[str]:
        paths = [
            self.kube_apiserver,
            self.kube_controller_manager,
            self.kubectl,
            self.helm,
            self.kuberay_operator,
            self.etcd,
            self.kuberay_crds / "ray.io_rayjobs.yaml",
        ]
        return [str(p) for p in paths if not p.is_file()]


@dataclass
class KubeRayOperator:
    """The real KubeRay operator binary running against the plane, as admin, all namespaces."""

    process: Process
    on_stop: Callable[[], None]

    def alive(self) -> bool:
        return self.process.alive()

    def log_tail(self, lines: int = 40) -> str:
        return self.process.log_tail(lines)

    def stop(self) -> None:
        self.process.stop()
        self.on_stop()


@dataclass
class ControlPlane:
    """etcd + kube-apiserver (RBAC) + kube-controller-manager on loopback, in a temp dir.

    `start()` returns once /readyz answers and the controllers work (the default ServiceAccount
    exists); `stop()` kills every process it started and removes the temp dir.
    """

    bins: Binaries = field(default_factory=Binaries.locate)
    workdir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="rljob-plane-")))
    processes: list[Process] = field(default_factory=list)
    server: str = ""
    ca_pem: bytes = b""
    kubeconfig: Path = field(init=False)
    log_dir: Path = field(init=False)
    _controller_manager: Process | None = None
    _kuberay: KubeRayOperator | None = None
    _etcd_dir: Path | None = None

    def __post_init__(self) -> None:
        self.kubeconfig = self.workdir / "admin.kubeconfig"
        self.log_dir = self.workdir / "logs"

    # -- lifecycle --

    def start(self) -> ControlPlane:
        started = time.monotonic()
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        print(f"control plane up in {time.monotonic() - started:.1f}s at {self.server}", flush=True)
        return self

    def _start(self) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        pki = make_pki(self.workdir / "pki")
        self.ca_pem = pki.ca_pem
        etcd_port = self._start_etcd()
        self._start_apiserver(pki, etcd_port)
        self._start_controller_manager(pki)

    def _start_etcd(self) -> int:
        # etcd fsyncs every write; on tmpfs that is free, which is most of its start-up time.
        shm = Path("/dev/shm")
        self._etcd_dir = Path(
            tempfile.mkdtemp(prefix="rljob-etcd-", dir=shm if shm.is_dir() else self.workdir)
        )
        port, peer = free_port(), free_port()
        etcd = self._spawn(
            "etcd",
            [
                self.bins.etcd,
                "--name=default",
                f"--data-dir={self._etcd_dir / 'data'}",
                f"--listen-client-urls=http://127.0.0.1:{port}",
                f"--advertise-client-urls=http://127.0.0.1:{port}",
                f"--listen-peer-urls=http://127.0.0.1:{peer}",
                f"--initial-advertise-peer-urls=http://127.0.0.1:{peer}",
                f"--initial-cluster=default=http://127.0.0.1:{peer}",
            ],
        )
        self._wait_for(f"etcd on port {port}", lambda: port_open(port), etcd)
        return port

    def _start_apiserver(self, pki: Pki, etcd_port: int) -> None:
        port = free_port()
        self.server = f"https://127.0.0.1:{port}"
        apiserver = self._spawn(
            "kube-apiserver",
            [
                self.bins.kube_apiserver,
                f"--etcd-servers=http://127.0.0.1:{etcd_port}",
                "--bind-address=127.0.0.1",
                "--advertise-address=127.0.0.1",
                f"--secure-port={port}",
                f"--cert-dir={self.workdir / 'certs'}",
                f"--tls-cert-file={pki.serving_cert}",
                f"--tls-private-key-file={pki.serving_key}",
                f"--client-ca-file={pki.ca_cert}",
                "--authorization-mode=Node,RBAC",
                f"--service-account-issuer={SA_ISSUER}",
                f"--service-account-key-file={pki.sa_pub}",
                f"--service-account-signing-key-file={pki.sa_key}",
                f"--service-cluster-ip-range={SERVICE_CIDR}",
                "--allow-privileged=true",
                "--profiling=false",
                # No kubelet/node network here: nothing would reach the `kubernetes` Service.
                "--endpoint-reconciler-type=none",
            ],
        )
        self.kubeconfig.write_text(admin_kubeconfig_yaml(self.server, pki))
        self._wait_for(
            "kube-apiserver /readyz",
            lambda: self.kubectl("get", "--raw", "/readyz", check=False).returncode == 0,
            apiserver,
        )

    def _start_controller_manager(self, pki: Pki) -> None:
        kcm = self._spawn(
            "kube-controller-manager",
            [
                self.bins.kube_controller_manager,
                f"--kubeconfig={self.kubeconfig}",
                "--controllers=*",
                # Each controller acts as its own ServiceAccount (system:serviceaccount:
                # kube-system:<controller>), so RBAC applies to them as in a real cluster.
                "--use-service-account-credentials=true",
                f"--service-account-private-key-file={pki.sa_key}",
                f"--root-ca-file={pki.ca_cert}",
                f"--service-cluster-ip-range={SERVICE_CIDR}",
                "--leader-elect=false",
                "--secure-port=0",
            ],
        )
        self._controller_manager = kcm
        # The controller-manager creates every namespace's "default" ServiceAccount; pods are
        # refused by the ServiceAccount admission plugin until it exists.
        self._wait_for(
            "kube-controller-manager to create the default ServiceAccount",
            lambda: self._has_default_service_account("default"),
            kcm,
        )

    def stop(self) -> None:
        """Stop every process this plane started (newest first) and remove its files."""
        for process in reversed(self.processes):
            process.stop()
        self.processes.clear()
        self._kuberay = None
        self._controller_manager = None
        if os.environ.get("RLJOB_KEEP_PLANE"):
            print(f"RLJOB_KEEP_PLANE: control-plane files kept in {self.workdir}")
            return
        for directory in (self.workdir, self._etcd_dir):
            if directory is not None:
                shutil.rmtree(directory, ignore_errors=True)

    def logs(self, lines: int = 40) -> str:
        """The last lines of each component's log (for failure messages)."""
        return "\n".join(
            f"--- {p.name} ({p.log_path})\n{p.log_tail(lines)}" for p in self.processes
        )

    def _spawn(self, name: str, argv: list[Any], env: dict[str, str] | None = None) -> Process:
        process = start_process(name, argv, self.log_dir, env=env)
        self.processes.append(process)
        return process

    def _wait_for(
        self,
        what: str,
        probe: Callable[[], bool],
        process: Process | None,
        timeout: float = START_TIMEOUT_SECONDS,
    ) -> None:
        """Poll `probe` until true; fail with every log tail if `process` dies or time runs out."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if process is not None and not process.alive():
                raise PlaneError(f"{process.name} exited while waiting for {what}:\n{self.logs()}")
            if probe():
                return
            time.sleep(0.2)
        raise PlaneError(f"timed out after {timeout:.0f}s waiting for {what}:\n{self.logs()}")

    def _has_default_service_account(self, namespace: str) -> bool:
        return (
            self.kubectl("get", "serviceaccount", "default", "-n", namespace, check=False)
        ).returncode == 0

    # -- commands --

    def kubectl(
        self,
        *args: str,
        kubeconfig: Path | None = None,
        check: bool = True,
        input: str | None = None,
        timeout: float = 60.0,
    ) -> subprocess.CompletedProcess[str]:
        """Run the real kubectl against the plane (as admin unless a kubeconfig is given)."""
        argv = [str(self.bins.kubectl), f"--kubeconfig={kubeconfig or self.kubeconfig}", *args]
        result = subprocess.run(
            argv, capture_output=True, text=True, input=input, timeout=timeout, check=False
        )
        if check and result.returncode != 0:
            raise PlaneError(
                f"kubectl {' '.join(args)} failed ({result.returncode}):\n{result.stderr}"
            )
        return result

    def kubectl_json(self, *args: str, kubeconfig: Path | None = None) -> Any:
        """`kubectl ... -o json`, parsed."""
        return json.loads(self.kubectl(*args, "-o", "json", kubeconfig=kubeconfig).stdout)

    def helm(
        self, *args: str, check: bool = True, timeout: float = 180.0
    ) -> subprocess.CompletedProcess[str]:
        """Run the real helm against the plane as admin (its caches inside the plane's dir)."""
        env = {
            **os.environ,
            "KUBECONFIG": str(self.kubeconfig),
            "HELM_CACHE_HOME": str(self.workdir / "helm" / "cache"),
            "HELM_CONFIG_HOME": str(self.workdir / "helm" / "config"),
            "HELM_DATA_HOME": str(self.workdir / "helm" / "data"),
        }
        result = subprocess.run(
            [str(self.bins.helm), *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
            check=False,
        )
        if check and result.returncode != 0:
            raise PlaneError(
                f"helm {' '.join(args)} failed ({result.returncode}):\n{result.stderr}"
            )
        return result

    def api_client(self, kubeconfig: Path | None = None) -> ApiClient:
        """A kubernetes-client ApiClient for the plane (admin unless a kubeconfig is given)."""
        from kubernetes import config

        return config.new_client_from_config(config_file=str(kubeconfig or self.kubeconfig))

    def apply_yaml(self, text: str, *, kubeconfig: Path | None = None) -> str:
        """Server-side apply of one or more YAML documents; returns kubectl's output."""
        args = ["apply", "--server-side", "--field-manager=rljob-tests", "--force-conflicts"]
        return self.kubectl(*args, "-f", "-", kubeconfig=kubeconfig, input=text).stdout

    def create_namespace(self, name: str) -> str:
        """Create namespace `name` and wait until pods can be created in it."""
        self.apply_yaml(
            yaml.safe_dump({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})
        )
        self._wait_for(
            f"the default ServiceAccount of namespace {name}",
            lambda: self._has_default_service_account(name),
            self._controller_manager,
            timeout=30,
        )
        return name

    def delete_namespace(self, name: str) -> None:
        """Start deleting namespace `name` (the namespace controller finishes it)."""
        self.kubectl("delete", "namespace", name, "--wait=false", "--ignore-not-found")

    def sa_kubeconfig(self, namespace: str, name: str, expiration_seconds: int = 3600) -> Path:
        """A kubeconfig authenticating as ServiceAccount namespace/name with a token from the
        TokenRequest API; the ServiceAccount is created when missing."""
        self.apply_yaml(
            yaml.safe_dump(
                {
                    "apiVersion": "v1",
                    "kind": "ServiceAccount",
                    "metadata": {"name": name, "namespace": namespace},
                }
            )
        )
        token = self.kubectl(
            "create", "token", name, "-n", namespace, f"--duration={expiration_seconds}s"
        ).stdout.strip()
        path = self.workdir / "kubeconfigs" / f"{namespace}.{name}.kubeconfig"
        path.parent.mkdir(exist_ok=True)
        path.write_text(
            token_kubeconfig_yaml(self.server, self.ca_pem, f"{namespace}:{name}", token)
        )
        path.chmod(0o600)
        return path

    # -- KubeRay --

    def install_kuberay_crds(self) -> None:
        """KubeRay's CRDs of the pinned release (RayCluster, RayJob, RayService, RayCronJob),
        applied server-side (too large for client-side apply) and waited Established."""
        for crd in sorted(self.bins.kuberay_crds.glob("ray.io_*.yaml")):
            self.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(crd))
        self.kubectl(
            "wait",
            "--for=condition=Established",
            "--timeout=60s",
            *(f"crd/{plural}.ray.io" for plural in KUBERAY_CRDS),
            timeout=90,
        )

    def start_kuberay_operator(self) -> KubeRayOperator:
        """The real KubeRay operator (one per plane: a second call returns the running one),
        watching all namespaces, as admin, no leader election, no metrics listener."""
        if self._kuberay is not None and self._kuberay.alive():
            return self._kuberay
        self.install_kuberay_crds()
        probe_port = free_port()
        process = self._spawn(
            "kuberay-operator",
            [
                self.bins.kuberay_operator,
                "--enable-leader-election=false",
                "--metrics-addr=0",  # controller-runtime: "0" disables the metrics listener
                f"--health-probe-bind-address=127.0.0.1:{probe_port}",
                "--log-stdout-encoder=console",
            ],
            env={"KUBECONFIG": str(self.kubeconfig)},
        )
        self._wait_for(
            "kuberay-operator /readyz",
            lambda: _http_ok(f"http://127.0.0.1:{probe_port}/readyz"),
            process,
            timeout=60,
        )
        self._kuberay = KubeRayOperator(process, on_stop=self._forget_kuberay)
        return self._kuberay

    def _forget_kuberay(self) -> None:
        if self._kuberay is not None and self._kuberay.process in self.processes:
            self.processes.remove(self._kuberay.process)
        self._kuberay = None


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return False
