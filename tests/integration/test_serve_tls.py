"""HTTPS for a real `kvflow serve` (tiny random model): --ssl-certfile/--ssl-keyfile serve
https that a client trusting the test CA reaches while plain HTTP on the same port gets
no completion; --ssl-cert-reqs 2 with --ssl-ca-certs refuses a client without a
certificate and serves one whose certificate the CA signed, in every API server
process; the container health check speaks https; half a flag pair fails at once.

The CA and the certificates are made with the openssl command line for each run."""

from __future__ import annotations

import importlib.util
import ssl
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from serve_harness import KVFLOW, MODEL_NAME, Server, start_server, stop_server

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


def _load_healthcheck() -> Any:
    """docker/healthcheck.py, which is no package's module."""
    spec = importlib.util.spec_from_file_location("healthcheck", REPO / "docker" / "healthcheck.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


healthcheck = _load_healthcheck()


@dataclass(frozen=True)
class Pki:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path

    def client(self, with_cert: bool) -> ssl.SSLContext:
        context = ssl.create_default_context(cafile=str(self.ca))
        if with_cert:
            context.load_cert_chain(str(self.client_cert), str(self.client_key))
        return context


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)


def _issue(folder: Path, name: str, ca: Path, ca_key: Path, extensions: str) -> None:
    key, csr, ext = folder / f"{name}.key", folder / f"{name}.csr", folder / f"{name}.ext"
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", str(key), "-out", str(csr), "-subj", f"/CN={name}")  # fmt: skip
    ext.write_text(extensions)
    _openssl("x509", "-req", "-in", str(csr), "-CA", str(ca), "-CAkey", str(ca_key),
             "-CAcreateserial", "-days", "2", "-out", str(folder / f"{name}.pem"),
             "-extfile", str(ext))  # fmt: skip


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    folder = tmp_path_factory.mktemp("pki")
    ca, ca_key = folder / "ca.pem", folder / "ca.key"
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
             "-nodes", "-keyout", str(ca_key), "-out", str(ca), "-days", "2",
             "-subj", "/CN=kvflow test CA",
             "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign")  # fmt: skip
    _issue(folder, "server", ca, ca_key,
           "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth\n")  # fmt: skip
    _issue(folder, "client", ca, ca_key, "extendedKeyUsage=clientAuth\n")
    return Pki(
        ca,
        folder / "server.pem",
        folder / "server.key",
        folder / "client.pem",
        folder / "client.key",
    )


def _tls_flags(pki: Pki) -> list[str]:
    return ["--ssl-certfile", str(pki.server_cert), "--ssl-keyfile", str(pki.server_key)]


@pytest.fixture(scope="module")
def https(
    tiny_model_dir: Path, pki: Pki, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    log_dir = tmp_path_factory.mktemp("https")
    server = start_server(tiny_model_dir, log_dir, *_tls_flags(pki), tls=pki.client(False))
    yield server
    code, survivors = stop_server(server)
    assert code == 0 and survivors == [], server.log_tail()


@pytest.fixture(scope="module")
def mutual(
    tiny_model_dir: Path, pki: Pki, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    flags = [*_tls_flags(pki), "--ssl-ca-certs", str(pki.ca), "--ssl-cert-reqs", "2"]
    flags += ["--api-server-count", "2"]
    log_dir = tmp_path_factory.mktemp("mutual")
    server = start_server(tiny_model_dir, log_dir, *flags, tls=pki.client(True))
    yield server
    code, survivors = stop_server(server)
    assert code == 0 and survivors == [], server.log_tail()


def _complete(base_url: str, verify: ssl.SSLContext) -> httpx.Response:
    body = {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 4, "ignore_eos": True}
    with httpx.Client(verify=verify, timeout=60.0) as client:
        return client.post(base_url + "/v1/completions", json=body)


def test_https_with_the_ca_is_served_and_plain_http_is_not(https: Server, pki: Pki) -> None:
    response = _complete(https.base_url, pki.client(False))
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 4
    assert f"serving 'tiny' at {https.base_url}" in https.log_path.read_text()
    plain = https.base_url.replace("https://", "http://")
    body = {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 4}
    try:
        answer = httpx.post(plain + "/v1/completions", json=body, timeout=30.0)
    except httpx.TransportError:
        return  # the server closed the connection: no completion either
    assert answer.status_code == 400 and "choices" not in answer.text, answer.text


def test_a_client_not_trusting_the_ca_is_refused(https: Server) -> None:
    with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
        httpx.get(https.base_url + "/health", timeout=30.0)


def test_the_health_check_speaks_https(https: Server, pki: Pki) -> None:
    url = https.base_url + "/health"
    assert healthcheck.main(["http", url, "--ssl-ca-certs", str(pki.ca)]) == 0
    assert healthcheck.main(["http", url]) == 1  # the system's CAs do not know the test CA


def test_mutual_tls_refuses_a_client_without_a_certificate(mutual: Server, pki: Pki) -> None:
    for _ in range(4):  # new connections, spread over both API server processes
        with pytest.raises(httpx.TransportError):
            _complete(mutual.base_url, pki.client(False))


def test_mutual_tls_serves_a_client_with_a_certificate_the_ca_signed(
    mutual: Server, pki: Pki
) -> None:
    for _ in range(6):  # new connections, spread over both API server processes
        response = _complete(mutual.base_url, pki.client(True))
        assert response.status_code == 200, response.text
    url = mutual.base_url + "/health"
    ca, cert, key = str(pki.ca), str(pki.client_cert), str(pki.client_key)
    assert healthcheck.main(["http", url, "--ssl-ca-certs", ca]) == 1
    flags = ["--ssl-ca-certs", ca, "--ssl-certfile", cert, "--ssl-keyfile", key]
    assert healthcheck.main(["http", url, *flags]) == 0


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (["--ssl-keyfile", "server.key"], "--ssl-keyfile without --ssl-certfile"),
        (["--ssl-cert-reqs", "2"], "--ssl-cert-reqs without --ssl-certfile"),
        (["--ssl-certfile", "server.pem"], "TLS files do not load"),  # no key, none in it
        (["--ssl-certfile", "server.pem", "--ssl-keyfile", "client.key"], "do not load"),
        (
            ["--ssl-certfile", "server.pem", "--ssl-keyfile", "server.key", "--ssl-cert-reqs", "2"],
            "give ssl_ca_certs",
        ),
    ],
)
def test_half_a_tls_setup_fails_at_start(pki: Pki, flags: list[str], words: str) -> None:
    folder = pki.ca.parent
    result = subprocess.run(
        [str(KVFLOW), "serve", *flags, "--port", "1"],
        cwd=folder,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0
    assert words in result.stderr, result.stderr
