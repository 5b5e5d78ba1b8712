"""TLS for amqps:// connections: the SSL context a connection uses, and certificate errors a user can act on.

`TLSOptions` holds what the connector's `tls.*` options say (file paths, or the files' PEM contents, so the
driver can read them once and executors need no copy of the files). `wrap(sock, ...)` performs the TLS
handshake within the connect deadline and turns OpenSSL's verdicts into `ConnectError`s that say what was
wrong (unknown CA, host name mismatch, expired certificate, client certificate required) and which option
fixes it. Verification is on by default: the certificate chain against `ca` (or the system's CAs) and the
host name against `server_name` (or the URI's host), as every managed RabbitMQ service expects.
"""

from __future__ import annotations

import os
import socket
import ssl
import tempfile
from dataclasses import dataclass, field

from .errors import ConnectError


@dataclass(frozen=True)
class TLSOptions:
    """`ca`, `cert`, `key`: a PEM file path, or the PEM text itself (starts with "-----BEGIN")."""

    ca: str | None = None
    cert: str | None = None
    key: str | None = field(default=None, repr=False)
    verify: bool = True
    server_name: str | None = None

    def context(self) -> ssl.SSLContext:
        """The client-side SSL context (TLS 1.2 or newer)."""
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        if self.verify:
            ctx.check_hostname = True
            ctx.verify_mode = ssl.CERT_REQUIRED
            if self.ca:
                _load_ca(ctx, self.ca)
            else:
                ctx.load_default_certs()
        else:
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
        if self.cert:
            _load_chain(ctx, self.cert, self.key)
        return ctx


def _is_pem(value: str) -> bool:
    return value.lstrip().startswith("-----BEGIN")


def _load_ca(ctx: ssl.SSLContext, ca: str) -> None:
    try:
        if _is_pem(ca):
            ctx.load_verify_locations(cadata=ca)
        else:
            ctx.load_verify_locations(cafile=ca)
    except (OSError, ssl.SSLError) as exc:
        raise ConnectError(f"tls.caFile: cannot load the CA certificate(s) from {_where(ca)}: {exc}") from None


def _load_chain(ctx: ssl.SSLContext, cert: str, key: str | None) -> None:
    """load_cert_chain takes only paths: PEM text is written to private temporary files first."""
    made = []
    try:
        paths = []
        for value in (cert, key):
            if value is None or not _is_pem(value):
                paths.append(value)
                continue
            fd, path = tempfile.mkstemp(prefix="spark-amqp-tls-", suffix=".pem")   # mode 0600
            made.append(path)
            with os.fdopen(fd, "w") as fh:
                fh.write(value)
            paths.append(path)
        ctx.load_cert_chain(paths[0], paths[1])
    except (OSError, ssl.SSLError) as exc:
        raise ConnectError(f"tls.certFile / tls.keyFile: cannot load the client certificate from "
                           f"{_where(cert)} and its key from {_where(key) if key else 'the same file'}: {exc}") \
            from None
    finally:
        for path in made:
            os.unlink(path)


def _where(value: str | None) -> str:
    return "the PEM text given" if value and _is_pem(value) else repr(value)


def wrap(sock: socket.socket, options: TLSOptions, host: str, redacted_uri: str, timeout: float) -> ssl.SSLSocket:
    """The TLS handshake over a connected socket; a failure is a ConnectError naming the cause and the option."""
    server_name = options.server_name or host
    sock.settimeout(max(timeout, 0.001))
    try:
        return options.context().wrap_socket(sock, server_hostname=server_name)
    except ssl.SSLCertVerificationError as exc:
        raise ConnectError(_verification_problem(exc, server_name, redacted_uri)) from None
    except ssl.SSLError as exc:
        reason = (exc.reason or str(exc)).upper()
        if "CERTIFICATE_REQUIRED" in reason or "HANDSHAKE_FAILURE" in reason and options.cert is None:
            raise ConnectError(f"TLS handshake with {redacted_uri} failed: the broker requires a client "
                               "certificate; set tls.certFile and tls.keyFile") from None
        if "UNKNOWN_CA" in reason or "BAD_CERTIFICATE" in reason:
            raise ConnectError(f"TLS handshake with {redacted_uri} failed: the broker refused our client "
                               f"certificate ({exc.reason}); check tls.certFile and tls.keyFile") from None
        if "WRONG_VERSION_NUMBER" in reason or "RECORD_LAYER" in reason:
            raise ConnectError(f"TLS handshake with {redacted_uri} failed: the port does not speak TLS "
                               "(use amqp:// for a plain port, or the broker's TLS port, usually 5671)") from None
        raise ConnectError(f"TLS handshake with {redacted_uri} failed: {exc}") from None
    except (socket.timeout, TimeoutError):
        raise ConnectError(f"TLS handshake with {redacted_uri} did not complete in time (connect timeout)") \
            from None
    except OSError as exc:
        raise ConnectError(f"TLS handshake with {redacted_uri} failed: {exc}") from None


def _verification_problem(exc: ssl.SSLCertVerificationError, server_name: str, uri: str) -> str:
    message = exc.verify_message or str(exc)
    code = exc.verify_code
    head = f"TLS: the certificate of {uri} was refused"
    if code in (10,) or "expired" in message:                    # X509_V_ERR_CERT_HAS_EXPIRED
        return f"{head}: it has expired ({message}); the broker must renew it (tls.verify=false skips the check)"
    if code in (9,) or "not yet valid" in message:
        return f"{head}: it is not valid yet ({message}); check the clocks"
    if code in (62,) or "hostname" in message.lower() or "IP address mismatch" in message:
        return (f"{head}: it is not for host {server_name!r} ({message}); connect with the host name the "
                "certificate names, or set tls.serverName to it")
    if code in (18, 19, 20, 21) or "issuer" in message or "self-signed" in message or "self signed" in message:
        return (f"{head}: it is signed by a CA this client does not trust ({message}); set tls.caFile to "
                "that CA's certificate (PEM)")
    return f"{head}: {message}"
