"""The --ssl-* flags and TlsConfig without a server: half a setup is refused with the
reason before anything starts (the served side is tests/integration/test_serve_tls.py)."""

from __future__ import annotations

import argparse
import ssl
from pathlib import Path

import pytest

from kvflow.cli.tls_args import add_tls_args, resolve_tls
from kvflow.errors import ConfigError
from kvflow.services.frontend.config import FrontendConfig, TlsConfig


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_tls_args(parser.add_argument_group("server"))
    return parser.parse_args(argv)


def test_no_flags_is_plain_http() -> None:
    assert resolve_tls(parse()) is None
    config = FrontendConfig("m", 16, 16, host="::1", port=9000)
    assert config.url == "http://[::1]:9000"
    tls = TlsConfig("cert.pem", "key.pem")
    assert FrontendConfig("m", 16, 16, port=9000, tls=tls).url == "https://127.0.0.1:9000"


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--ssl-keyfile", "k.pem"], "--ssl-keyfile without --ssl-certfile"),
        (["--ssl-ca-certs", "ca.pem"], "--ssl-ca-certs without --ssl-certfile"),
        (["--ssl-cert-reqs", "2"], "--ssl-cert-reqs without --ssl-certfile"),
        (["--ssl-certfile", "missing.pem"], "TLS files do not load"),
        (["--ssl-certfile", "c.pem", "--ssl-cert-reqs", "1"], "give ssl_ca_certs"),
    ],
)
def test_half_a_setup_is_refused_with_the_reason(argv: list[str], words: str) -> None:
    with pytest.raises(SystemExit) as info:
        resolve_tls(parse(*argv))
    assert words in str(info.value.code)


def test_cert_reqs_outside_the_verify_modes_is_refused() -> None:
    with pytest.raises(SystemExit):
        parse("--ssl-certfile", "c.pem", "--ssl-cert-reqs", "3")
    with pytest.raises(ConfigError, match="0, 1 or 2"):
        TlsConfig("c.pem", cert_reqs=3)


def test_uvicorn_gets_vllms_options(tmp_path: Path) -> None:
    tls = TlsConfig("c.pem", "k.pem", "ca.pem", ssl.CERT_REQUIRED)
    assert tls.uvicorn_options() == {
        "ssl_certfile": "c.pem",
        "ssl_keyfile": "k.pem",
        "ssl_ca_certs": "ca.pem",
        "ssl_cert_reqs": ssl.CERT_REQUIRED,
    }
    (tmp_path / "c.pem").write_text("not a certificate")
    with pytest.raises(ConfigError, match="TLS files do not load"):
        TlsConfig(str(tmp_path / "c.pem")).check_files()
