"""A throwaway PKI for one dev cluster, made with the `openssl` command, and kubeconfig files.

The cluster's PKI is ECDSA P-256: key generation is instant (RSA-2048 costs ~0.1-1 s per key on
2 busy cores) and kube-apiserver accepts ES256 service-account signing keys. Kueue's webhook PKI
(`create_webhook_pki`, only with Kueue) is RSA, the one key type its certificate rotator reads.
"""

from __future__ import annotations

import base64
import subprocess
from dataclasses import dataclass
from pathlib import Path

import yaml

__all__ = ["Pki", "WebhookPki", "create_pki", "create_webhook_pki", "write_kubeconfig"]

_DAYS = "30"


@dataclass(frozen=True, slots=True)
class Pki:
    """Paths of the files `create_pki` wrote (all PEM)."""

    dir: Path

    @property
    def ca_crt(self) -> Path:
        return self.dir / "ca.crt"

    @property
    def ca_key(self) -> Path:
        return self.dir / "ca.key"

    @property
    def apiserver_crt(self) -> Path:
        return self.dir / "apiserver.crt"

    @property
    def apiserver_key(self) -> Path:
        return self.dir / "apiserver.key"

    @property
    def admin_crt(self) -> Path:
        return self.dir / "admin.crt"

    @property
    def admin_key(self) -> Path:
        return self.dir / "admin.key"

    @property
    def sa_key(self) -> Path:
        """Service-account token signing key (private)."""
        return self.dir / "sa.key"

    @property
    def sa_pub(self) -> Path:
        return self.dir / "sa.pub"


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def _ec_key(path: Path) -> None:
    # genpkey writes PKCS#8, which Go and Python's ssl both read.
    _openssl(
        "genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256", "-out", str(path),
        cwd=path.parent,
    )  # fmt: skip


def _rsa_pkcs1_key(path: Path) -> None:
    # `-traditional`: PKCS#1 ("RSA PRIVATE KEY"), the only form Kueue's certificate rotator
    # (open-policy-agent/cert-controller) parses a CA key in.
    _openssl("genrsa", "-traditional", "-out", str(path), "2048", cwd=path.parent)


def _signed_cert(pki: Pki, name: str, subject: str, extensions: str) -> None:
    key, csr, crt = pki.dir / f"{name}.key", pki.dir / f"{name}.csr", pki.dir / f"{name}.crt"
    ext = pki.dir / f"{name}.ext"
    _ec_key(key)
    _openssl("req", "-new", "-key", str(key), "-out", str(csr), "-subj", subject, cwd=pki.dir)
    ext.write_text(extensions)
    _openssl(
        "x509", "-req", "-in", str(csr), "-CA", str(pki.ca_crt), "-CAkey", str(pki.ca_key),
        "-CAcreateserial", "-days", _DAYS, "-out", str(crt), "-extfile", str(ext),
        cwd=pki.dir,
    )  # fmt: skip
    csr.unlink()
    ext.unlink()


def create_pki(dir: Path) -> Pki:
    """Write a CA, the apiserver serving cert, an admin client cert and the SA key pair into `dir`.

    The admin cert is in group `system:masters`, so it bypasses RBAC. The serving cert is valid for
    127.0.0.1, localhost and the in-cluster service names.
    """
    dir.mkdir(parents=True, exist_ok=True)
    pki = Pki(dir)
    _ec_key(pki.ca_key)
    _openssl(
        "req", "-x509", "-new", "-key", str(pki.ca_key), "-out", str(pki.ca_crt), "-days", _DAYS,
        "-subj", "/CN=fleetserve-dev-cluster-ca", cwd=dir,
    )  # fmt: skip
    _signed_cert(
        pki,
        "apiserver",
        "/CN=kube-apiserver",
        "subjectAltName=IP:127.0.0.1,IP:10.0.0.1,DNS:localhost,DNS:kubernetes,"
        "DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local\n"
        "extendedKeyUsage=serverAuth\n",
    )
    _signed_cert(
        pki, "admin", "/O=system:masters/CN=dev-cluster-admin", "extendedKeyUsage=clientAuth\n"
    )
    _ec_key(pki.sa_key)
    _openssl("pkey", "-in", str(pki.sa_key), "-pubout", "-out", str(pki.sa_pub), cwd=dir)
    return pki


@dataclass(frozen=True, slots=True)
class WebhookPki:
    """A webhook server's own CA and serving certificate (`create_webhook_pki`), all PEM."""

    dir: Path

    @property
    def ca_crt(self) -> Path:
        return self.dir / "ca.crt"

    @property
    def ca_key(self) -> Path:
        return self.dir / "ca.key"

    @property
    def tls_crt(self) -> Path:
        return self.dir / "tls.crt"

    @property
    def tls_key(self) -> Path:
        return self.dir / "tls.key"


def create_webhook_pki(dir: Path, *, ca_name: str, dns_name: str, days: int) -> WebhookPki:
    """Write a CA named `ca_name` (also its DNS SAN) and a serving cert for `dns_name` and
    127.0.0.1 into `dir`, as `ca.crt`, `ca.key`, `tls.crt`, `tls.key` (a kubernetes.io/tls
    Secret's keys, plus the CA's).

    RSA keys in PKCS#1 (the rotator's format; the cluster's PKI is ECDSA). Its own CA, not
    the cluster's: a webhook server that rotates its certificates keeps the CA
    key in a Secret, and the cluster CA's key signs the API server's identity.
    """
    dir.mkdir(parents=True, exist_ok=True)
    pki = WebhookPki(dir)
    _rsa_pkcs1_key(pki.ca_key)
    _openssl(
        "req", "-x509", "-new", "-key", str(pki.ca_key), "-out", str(pki.ca_crt),
        "-days", str(days), "-subj", f"/O=fleetserve dev cluster/CN={ca_name}",
        "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,keyCertSign,digitalSignature",
        "-addext", f"subjectAltName=DNS:{ca_name}", cwd=dir,
    )  # fmt: skip
    csr, ext = dir / "tls.csr", dir / "tls.ext"
    _rsa_pkcs1_key(pki.tls_key)
    _openssl(
        "req", "-new", "-key", str(pki.tls_key), "-out", str(csr), "-subj", f"/CN={dns_name}",
        cwd=dir,
    )  # fmt: skip
    ext.write_text(f"subjectAltName=DNS:{dns_name},IP:127.0.0.1\nextendedKeyUsage=serverAuth\n")
    _openssl(
        "x509", "-req", "-in", str(csr), "-CA", str(pki.ca_crt), "-CAkey", str(pki.ca_key),
        "-CAcreateserial", "-days", str(days), "-out", str(pki.tls_crt), "-extfile", str(ext),
        cwd=dir,
    )  # fmt: skip
    csr.unlink()
    ext.unlink()
    return pki


def _b64(path: Path) -> str:
    return base64.b64encode(path.read_bytes()).decode()


def write_kubeconfig(
    path: Path,
    *,
    server: str,
    ca_crt: Path,
    client_crt: Path | None = None,
    client_key: Path | None = None,
    token: str | None = None,
    user: str = "admin",
) -> Path:
    """Write a self-contained kubeconfig (certificates embedded) with one context `dev-cluster`.

    Exactly one of (client_crt and client_key) or token must be given.
    """
    if (client_crt is None) == (token is None):
        raise ValueError("write_kubeconfig needs either client_crt/client_key or token, not both")
    creds: dict[str, str] = {}
    if token is not None:
        creds["token"] = token
    else:
        assert client_key is not None, "client_key is required with client_crt"
        assert client_crt is not None
        creds["client-certificate-data"] = _b64(client_crt)
        creds["client-key-data"] = _b64(client_key)
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": "dev-cluster",
                "cluster": {"server": server, "certificate-authority-data": _b64(ca_crt)},
            }
        ],
        "users": [{"name": user, "user": creds}],
        "contexts": [{"name": "dev-cluster", "context": {"cluster": "dev-cluster", "user": user}}],
        "current-context": "dev-cluster",
    }
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    path.chmod(0o600)
    return path
