"""Deployment options end to end: TLS with h2 by ALPN (a streamed chat over HTTP/2), h2c, CORS (preflight
without an API key, headers on the real answer), --root-path behind a path-prefix proxy."""

from __future__ import annotations

import datetime
import ipaddress
import json
import ssl
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import Server, start_server

KEY = "deploy-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
ORIGIN = "https://app.example"
CHAT = {
    "model": "tiny",
    "messages": [{"role": "user", "content": "Hi"}],
    "max_tokens": 8,
    "stream": True,
    "ignore_eos": True,
}


def self_signed(folder: Path) -> tuple[Path, Path]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    key_file, cert_file = folder / "key.pem", folder / "cert.pem"
    key_file.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return key_file, cert_file


@pytest.fixture(scope="module", params=["trio", "asyncio"])
def tls_server(
    request: pytest.FixtureRequest, qwen2_ckpt: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Server, str, ssl.SSLContext]]:
    tmp = tmp_path_factory.mktemp("tls")
    key_file, cert_file = self_signed(tmp)
    s = start_server(
        qwen2_ckpt,
        tmp,
        "--worker-class",
        request.param,
        "--ssl-keyfile",
        str(key_file),
        "--ssl-certfile",
        str(cert_file),
        "--api-key",
        KEY,
        "--allowed-origins",
        json.dumps([ORIGIN]),
        "--root-path",
        "/llm",
        wait=False,
    )
    url = f"https://127.0.0.1:{s.port}"
    ctx = ssl.create_default_context(cafile=str(cert_file))
    _wait(s, url, ctx)
    yield s, url, ctx
    s.stop()


def _wait(s: Server, url: str, ctx: ssl.SSLContext) -> None:
    import time

    for _ in range(600):
        if s.proc.poll() is not None:
            raise RuntimeError(s.log.read_text()[-3000:])
        try:
            if httpx.get(f"{url}/health", verify=ctx, timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise RuntimeError("TLS server not healthy")


def _stream(client: httpx.Client, url: str) -> tuple[str, list[str]]:
    with client.stream("POST", url, json=CHAT, headers=AUTH) as r:
        assert r.status_code == 200, r.read()
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
        return r.http_version, lines


def test_streamed_chat_over_h2_and_http11_with_tls(tls_server: tuple[Server, str, ssl.SSLContext]) -> None:
    _s, url, ctx = tls_server
    with httpx.Client(http2=True, verify=ctx, timeout=60) as h2:
        version, lines = _stream(h2, f"{url}/v1/chat/completions")
        assert version == "HTTP/2"
        assert lines[-1] == "data: [DONE]" and len(lines) >= 8  # a role event, 8 tokens, the finish, [DONE]
        again, more = _stream(h2, f"{url}/v1/chat/completions")  # the same connection, another stream
        assert again == "HTTP/2" and more[-1] == "data: [DONE]"
    with httpx.Client(verify=ctx, timeout=60) as h1:
        version, lines = _stream(h1, f"{url}/v1/chat/completions")
        assert version == "HTTP/1.1" and lines[-1] == "data: [DONE]" and len(lines) >= 8


def test_cors_preflight_needs_no_key_and_answers_carry_headers(tls_server: tuple[Server, str, ssl.SSLContext]) -> None:
    _s, url, ctx = tls_server
    pre = httpx.options(
        f"{url}/v1/chat/completions",
        verify=ctx,
        timeout=10,
        headers={
            "Origin": ORIGIN,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type",
        },
    )
    assert pre.status_code == 200, pre.text
    assert pre.headers["access-control-allow-origin"] == ORIGIN
    assert "POST" in pre.headers["access-control-allow-methods"]
    assert "authorization" in pre.headers["access-control-allow-headers"].lower()
    real = httpx.get(f"{url}/v1/models", headers={**AUTH, "Origin": ORIGIN}, verify=ctx, timeout=10)
    assert real.status_code == 200 and real.headers["access-control-allow-origin"] == ORIGIN
    refused = httpx.get(f"{url}/v1/models", headers={"Origin": ORIGIN}, verify=ctx, timeout=10)
    assert refused.status_code == 401 and refused.headers["access-control-allow-origin"] == ORIGIN
    other = httpx.get(f"{url}/v1/models", headers={**AUTH, "Origin": "https://evil.example"}, verify=ctx, timeout=10)
    assert other.status_code == 200 and "access-control-allow-origin" not in other.headers
    bad_pre = httpx.options(
        f"{url}/v1/models",
        verify=ctx,
        timeout=10,
        headers={"Origin": "https://evil.example", "Access-Control-Request-Method": "GET"},
    )
    assert bad_pre.status_code == 400


def test_root_path_routes_with_and_without_the_prefix(tls_server: tuple[Server, str, ssl.SSLContext]) -> None:
    _s, url, ctx = tls_server
    for path in ("/llm/v1/models", "/v1/models"):  # a proxy that keeps the prefix, and one that strips it
        r = httpx.get(f"{url}{path}", headers=AUTH, verify=ctx, timeout=10)
        assert r.status_code == 200 and r.json()["data"][0]["id"] == "tiny", path
    assert httpx.get(f"{url}/llm/health", verify=ctx, timeout=10).status_code == 200  # public under the prefix too
    assert httpx.get(f"{url}/llm/v1/models", verify=ctx, timeout=10).status_code == 401


def test_h2c_prior_knowledge_streams(server: Server) -> None:
    with httpx.Client(http1=False, http2=True, timeout=60) as h2c:
        version, lines = _stream(h2c, f"{server.url}/v1/chat/completions")
    assert version == "HTTP/2" and lines[-1] == "data: [DONE]" and len(lines) >= 8
