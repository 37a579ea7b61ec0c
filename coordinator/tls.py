"""The SuperLink's TLS certificate against the clock and the coordinator's host, before it starts.

``privacy.CertificatePaths.check`` says the three files fit together; this says the server
certificate will also pass a TLS client's checks: it is valid now, and its SubjectAltName names
the host the coordinator (its health check, the ``flwr`` CLI) connects to. Either failing used to
surface as a SuperLink that never answered, after ``start-timeout``.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
from pathlib import Path

from cryptography import x509

from aggregation._errors import shown
from clients.config import ConfigError
from privacy import CertificatePaths

WILDCARD_HOSTS = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}  # listen on all -> reached over loopback


def connect_host(host: str) -> str:
    """The address the coordinator reaches a SuperLink listening on ``host`` at: ``host`` itself, or
    loopback (127.0.0.1, ::1) for a listen-on-all address (0.0.0.0, ::)."""
    return WILDCARD_HOSTS.get(host, host)


def check_server_certificate(paths: CertificatePaths, host: str, now: dt.datetime | None = None) -> None:
    """ConfigError (naming the file) unless the CA and server certificates are valid at ``now``
    (default: the current time) and the server certificate's SubjectAltName covers
    ``connect_host(host)``: an IP host must be an IP entry, a name an exact DNS entry or one
    ``*.`` wildcard over its first label. For a listen-on-all host (0.0.0.0, ::) the name agents use
    is not known here, so loopback, which the coordinator itself uses, is what must be covered."""
    now = now or dt.datetime.now(dt.timezone.utc)
    certs = {p: x509.load_pem_x509_certificate(p.read_bytes()) for p in (paths.ca_cert, paths.server_cert)}
    for path, cert in certs.items():
        _check_validity(cert, path, now)
    _check_san(certs[paths.server_cert], paths.server_cert, host)


def _check_validity(cert: x509.Certificate, path: Path, now: dt.datetime) -> None:
    start, end = cert.not_valid_before_utc, cert.not_valid_after_utc
    if now > end:
        raise ConfigError(f"{path} must be a certificate that is valid now. Found it expired on {end:%Y-%m-%d %H:%M:%S} "
                          "UTC; run `fedshield certs init DIR --force` to make a new set.")
    if now < start:
        raise ConfigError(f"{path} must be a certificate that is valid now. Found it valid only from "
                          f"{start:%Y-%m-%d %H:%M:%S} UTC (is this machine's clock right?).")


def _check_san(cert: x509.Certificate, path: Path, host: str) -> None:
    target = connect_host(host)
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        dns, ips = [], []
    else:
        dns, ips = san.get_values_for_type(x509.DNSName), san.get_values_for_type(x509.IPAddress)
    try:
        ok = ipaddress.ip_address(target) in ips
    except ValueError:
        ok = any(_dns_match(pattern, target) for pattern in dns)
    if ok:
        return
    found = ", ".join([f"DNS:{d}" for d in dns] + [f"IP:{i}" for i in ips])
    why = "" if target == host else f" (coordinator.host {host or repr(host)} listens on every address; the coordinator reaches it on {target})"
    raise ConfigError(f"{path} must name the coordinator host {target} in its SubjectAltName, which TLS clients check"
                      f"{why}. Found {shown(found) if found else 'no SubjectAltName'}; run `fedshield certs init DIR "
                      f"--force --san {target}` to make one that does.")


def _dns_match(pattern: str, name: str) -> bool:
    pattern, name = pattern.lower().rstrip("."), name.lower().rstrip(".")
    if pattern.startswith("*."):
        first, _, rest = name.partition(".")
        return bool(first) and rest == pattern[2:]
    return pattern == name
