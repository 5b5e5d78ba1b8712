"""pytest plugin (entry point `pytest11`): a running embedded broker for any test suite.

    def test_publish(amqp_url):
        conn = pika.BlockingConnection(pika.URLParameters(amqp_url))

`amqp_broker` is a fresh `Broker` per test (it starts in milliseconds), so tests never share queues.

Over TLS: `amqps_broker` (a Broker with a TLS listener too), `amqps_url` (its amqps:// URL, host
`localhost`) and `amqps_ca_file` (the PEM file of the throw-away CA that signed the broker's certificate,
for the client to trust). The CA and the certificate (for "localhost" and "127.0.0.1") are made once per
test session with `trustme` (a test dependency, imported only when these fixtures are used).

    def test_tls(amqps_url, amqps_ca_file):
        ctx = ssl.create_default_context(cafile=amqps_ca_file)
        params = pika.URLParameters(amqps_url)
        params.ssl_options = pika.SSLOptions(ctx, server_hostname="localhost")
        conn = pika.BlockingConnection(params)
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from .embedded import Broker


@pytest.fixture
def amqp_broker():
    """A running embedded AMQP 0-9-1 broker on an ephemeral port, stopped after the test."""
    with Broker(port=0) as broker:
        yield broker


@pytest.fixture
def amqp_url(amqp_broker) -> str:
    """The embedded broker's URL: amqp://guest:guest@127.0.0.1:<port>/%2F"""
    return amqp_broker.url


@dataclass(frozen=True)
class _TlsFiles:
    ca_file: str        # the throw-away CA's certificate (PEM)
    cert_file: str      # the broker's certificate chain (PEM), for "localhost" and "127.0.0.1"
    key_file: str       # the broker's private key (PEM)


def write_tls_files(directory, ca=None) -> tuple:
    """(CA, _TlsFiles): a CA (a new throw-away one unless given) and a server certificate it signs for
    "localhost" and "127.0.0.1", written as PEM files into `directory`. trustme makes them."""
    import trustme

    ca = ca or trustme.CA()
    server = ca.issue_cert("localhost", "127.0.0.1")
    d = str(directory)
    files = _TlsFiles(ca_file=f"{d}/ca.pem", cert_file=f"{d}/server.pem", key_file=f"{d}/server.key")
    ca.cert_pem.write_to_path(files.ca_file)
    with open(files.cert_file, "wb") as fh:
        for pem in server.cert_chain_pems:
            fh.write(pem.bytes())
    server.private_key_pem.write_to_path(files.key_file)
    return ca, files


@pytest.fixture(scope="session")
def _amqps_tls_files(tmp_path_factory) -> _TlsFiles:
    """A throw-away CA and a server certificate signed by it, written once per session to a tmp dir."""
    try:
        import trustme  # noqa: F401
    except ImportError:
        pytest.fail("the amqps_* fixtures need trustme: pip install 'trustme>=1.1' "
                    "(or spark-amqp[test])", pytrace=False)
    return write_tls_files(tmp_path_factory.mktemp("amqps"))[1]


@pytest.fixture(scope="session")
def amqps_ca_file(_amqps_tls_files) -> str:
    """Path of the PEM certificate of the CA that signed `amqps_broker`'s certificate: trust it in the
    client (ssl.create_default_context(cafile=amqps_ca_file))."""
    return _amqps_tls_files.ca_file


@pytest.fixture
def amqps_broker(_amqps_tls_files):
    """A running embedded broker with a TLS listener (and the plain one), both on ephemeral ports,
    stopped after the test. Its certificate is for "localhost" and "127.0.0.1", signed by the CA in
    `amqps_ca_file`; client certificates are not asked for."""
    files = _amqps_tls_files
    with Broker(port=0, tls_port=0, tls_cert=files.cert_file, tls_key=files.key_file) as broker:
        yield broker


@pytest.fixture
def amqps_url(amqps_broker) -> str:
    """The embedded broker's TLS URL: amqps://guest:guest@localhost:<tls_port>/%2F"""
    return amqps_broker.tls_url
