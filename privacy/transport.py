"""Transport security material, made with ``cryptography`` only.

* ``init_certificates(DIR)``: a CA (ECDSA P-384) and a server certificate for
  SAN ``localhost`` and ``127.0.0.1`` (plus any extra names), for the SuperLink's TLS.
* ``new_node_key(DIR/NAME)``: an ECDSA P-384 key pair in OpenSSH format, the
  format Flower's SuperNode authentication takes (``NAME`` private, ``NAME.pub``).

Private keys are written with mode 0600 and never logged.
"""

from __future__ import annotations

import datetime as dt
import errno
import ipaddress
import os
import re
import secrets
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from ._errors import PrivacyError

CA_CERT, CA_KEY, SERVER_CERT, SERVER_KEY = "ca.crt", "ca.key", "server.crt", "server.key"
DEFAULT_SANS = ("localhost", "127.0.0.1")


@dataclass(frozen=True)
class CertificatePaths:
    ca_cert: Path
    server_cert: Path
    server_key: Path

    @classmethod
    def in_dir(cls, directory: str | os.PathLike) -> "CertificatePaths":
        d = Path(directory)
        return cls(d / CA_CERT, d / SERVER_CERT, d / SERVER_KEY)

    def check(self) -> "CertificatePaths":
        """The three files exist and fit together: PEM certificates and key, the server certificate
        signed by the CA and holding the server key's public half. Checked before the SuperLink
        starts: a mismatch used to surface as an SSL error without a file name, or as a SuperLink
        that never answered its health check (the start timeout, then a misleading message)."""
        for p in (self.ca_cert, self.server_cert, self.server_key):
            if not p.is_file():
                raise PrivacyError(_not_a_file(p, "TLS file", "exist", "; run `fedshield certs init DIR`"))
        _owner_only(self.server_key, "server key")  # whoever reads it can pass for the coordinator to every agent
        ca, cert = _load_cert(self.ca_cert), _load_cert(self.server_cert)
        try:
            key = serialization.load_pem_private_key(self.server_key.read_bytes(), password=None)
        except (ValueError, TypeError, UnsupportedAlgorithm):
            raise PrivacyError(f"{self.server_key} must be an unencrypted PEM private key. Found something else.") from None
        try:
            cert.verify_directly_issued_by(ca)
        except (ValueError, TypeError, InvalidSignature):
            raise PrivacyError(f"{self.server_cert} must be signed by the CA in {self.ca_cert}. Found a certificate "
                               "that CA did not issue; run `fedshield certs init DIR --force` to make a matching set.") from None
        if key.public_key().public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo) != \
                cert.public_key().public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo):
            raise PrivacyError(f"{self.server_key} must be the key of {self.server_cert}. Found another key.")
        return self


def _load_cert(path: Path) -> x509.Certificate:
    try:
        return x509.load_pem_x509_certificate(path.read_bytes())
    except ValueError:
        raise PrivacyError(f"{path} must be a PEM certificate. Found something else.") from None


def _os_reason(exc: OSError) -> str:
    return exc.strerror or str(exc)


def make_dir(d: Path, what: str, error: type[Exception] = PrivacyError, hint: str = "") -> None:
    """``mkdir -p d``, with one clear ``error`` (naming ``what``, then ``hint``) instead of an OSError:
    a file in the way, or a directory that cannot be made."""
    if d.exists() and not d.is_dir():
        raise error(f"{what} must be a directory. Found a file at {d}{hint}.")
    try:
        d.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise error(f"{what} {d} must be creatable. Found: {_os_reason(exc)}"
                    + (f" ({exc.filename})" if exc.filename and str(exc.filename) != str(d) else "") + f"{hint}.") from None


def write_atomic(path: Path, data: bytes, mode: int = 0o666, exact: bool = False) -> None:
    """Write ``data`` to a new file beside ``path`` (exclusive, never through a link; ``mode`` less the
    umask, or exactly ``mode`` when ``exact``), fsync it, and rename it over ``path``: a crash leaves the
    old file or the new one, never part of one, and a reader that had the old one open keeps reading it.
    OSError as raised; the temporary file is removed on failure. The directory is fsynced after the
    rename, so the new name survives a power loss too (a local-DP ledger that fell back to its old
    epsilon would under-count the privacy spent)."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
    try:
        with os.fdopen(fd, "wb") as fh:
            if exact:
                os.fchmod(fh.fileno(), mode)  # the umask may have taken bits from ``mode``
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


# Errors that say a directory cannot be opened or fsynced here (not POSIX, some network or FUSE file
# systems, a directory we may write but not read), not that the write failed.
_NO_DIR_FSYNC = {errno.EACCES, errno.EPERM, errno.EISDIR, errno.EINVAL, errno.EBADF, errno.ENOTSUP,
                 getattr(errno, "EOPNOTSUPP", errno.ENOTSUP)}


def _fsync_dir(directory: Path) -> None:
    """Make a rename in ``directory`` durable. Where directories cannot be opened or fsynced, the rename
    stands as the file system keeps it; any other error (EIO, ENOSPC) is raised: the write is not durable."""
    try:
        fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError as exc:
        if exc.errno in _NO_DIR_FSYNC:
            return
        raise
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in _NO_DIR_FSYNC:
            raise
    finally:
        os.close(fd)


def _write(path: Path, data: bytes, private: bool) -> None:
    """A key or certificate, through :func:`write_atomic`. Rewriting ``path`` in place (``--force``) kept
    its inode: a process that had it open before read the new private key through that descriptor, and a
    symbolic link planted at ``path`` sent the key to the link's target."""
    _no_dirs_in_the_way(path)  # (checked for the whole set first by the callers)
    try:
        write_atomic(path, data, 0o600 if private else 0o644, exact=True)
    except OSError as exc:
        if exc.filename is not None and str(exc.filename) != str(path):  # creating or renaming the new file beside it
            raise PrivacyError(f"{path.parent} must be a writable directory (a key or certificate is written beside "
                               f"its final name, then renamed into place). Found: {_os_reason(exc)}.") from None
        raise PrivacyError(f"{path} must be writable. Found: {_os_reason(exc)}.") from None


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "fedshield"), x509.NameAttribute(NameOID.COMMON_NAME, cn)])


_DNS_LABEL = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)")


def check_san(name: str) -> str:
    """``name`` if it is an IP address or a DNS name (``*.`` allowed as the first label), else a PrivacyError."""
    try:
        ipaddress.ip_address(name)
        return name
    except ValueError:
        pass
    labels = name[2:].split(".") if name.startswith("*.") else name.split(".")
    if not (0 < len(name) <= 253 and all(_DNS_LABEL.fullmatch(label) for label in labels)):
        raise PrivacyError(f"--san must be a DNS name (letters, digits, '-' and dots; '*.' may start it) or an IP "
                           f"address. Found {name!r}.")
    if labels[-1].isdigit():  # no top-level domain is numeric: a mistyped address (999.1.1.1), not a host name
        raise PrivacyError(f"--san must be a DNS name (whose last label is not all digits) or an IP address. Found "
                           f"{name!r}.")
    return name


def _san(names: tuple[str, ...]) -> x509.SubjectAlternativeName:
    entries: list[x509.GeneralName] = []
    for n in names:
        try:
            entries.append(x509.IPAddress(ipaddress.ip_address(n)))
        except ValueError:
            entries.append(x509.DNSName(n))
    return x509.SubjectAlternativeName(entries)


def init_certificates(directory: str | os.PathLike, extra_names: tuple[str, ...] = (), days: int = 825,
                      force: bool = False) -> CertificatePaths:
    """Create a CA and a server certificate signed by it in ``directory``."""
    d = Path(directory)
    extra_names = tuple(check_san(n) for n in extra_names)  # before anything is created
    make_dir(d, "certificate directory")
    paths = CertificatePaths.in_dir(d)
    if not force and any(p.exists() for p in (paths.ca_cert, paths.server_cert, paths.server_key, d / CA_KEY)):
        raise PrivacyError(f"certificate directory must not already hold certificates. Found them in {d}; use --force to replace.")
    _no_dirs_in_the_way(paths.ca_cert, paths.server_cert, paths.server_key, d / CA_KEY)
    now = dt.datetime.now(dt.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP384R1())
    ca_cert = (
        x509.CertificateBuilder().subject_name(_name("fedshield CA")).issuer_name(_name("fedshield CA"))
        .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
                                     key_encipherment=False, data_encipherment=False, key_agreement=False,
                                     encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA384())
    )
    srv_key = ec.generate_private_key(ec.SECP384R1())
    names = tuple(dict.fromkeys(DEFAULT_SANS + tuple(extra_names)))
    srv_cert = (
        x509.CertificateBuilder().subject_name(_name(names[0])).issuer_name(ca_cert.subject)
        .public_key(srv_key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=days))
        .add_extension(_san(names), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA384())
    )
    pem_key = dict(encoding=serialization.Encoding.PEM, format=serialization.PrivateFormat.PKCS8,
                   encryption_algorithm=serialization.NoEncryption())
    _write(d / CA_KEY, ca_key.private_bytes(**pem_key), private=True)
    _write(paths.ca_cert, ca_cert.public_bytes(serialization.Encoding.PEM), private=False)
    _write(paths.server_key, srv_key.private_bytes(**pem_key), private=True)
    _write(paths.server_cert, srv_cert.public_bytes(serialization.Encoding.PEM), private=False)
    return paths


def _no_dirs_in_the_way(*paths: Path) -> None:
    """Before anything is written (--force replaces files, not directories or links): a private key must
    not be left behind because a later file of the set could not be written."""
    for p in paths:
        if p.is_symlink():
            raise PrivacyError(f"{p} must not be a symbolic link (a key or certificate is written only as a plain "
                               "file). Found a link; remove it.")
        if p.is_dir():
            raise PrivacyError(f"{p} must be a file (or not exist yet). Found a directory; move it away.")


# A node signs every Fleet request and the SuperLink verifies each signature: P-256 (128-bit security, as TLS 1.3's
# default groups) verifies in 0.08 ms against P-384's 0.36 ms, ~10% of the SuperLink's CPU per request.
NODE_KEY_CURVES = {"p256": ec.SECP256R1, "p384": ec.SECP384R1}


def new_node_key(path: str | os.PathLike, force: bool = False, curve: str = "p256") -> tuple[Path, Path]:
    """Write an ECDSA key pair (``curve``: p256 or p384) in OpenSSH format: ``path`` and ``path.pub``."""
    if curve not in NODE_KEY_CURVES:
        raise PrivacyError(f"curve must be one of {sorted(NODE_KEY_CURVES)}. Found {curve!r}.")
    priv = Path(path)
    if priv.name in ("", ".", "..") or priv.is_dir():
        raise PrivacyError(f"key path must be DIR/NAME. Found {str(path)!r}.")
    pub = priv.with_name(priv.name + ".pub")
    if not force and (priv.exists() or pub.exists()):
        raise PrivacyError(f"key path must not exist yet. Found {priv}; use --force to replace.")
    _no_dirs_in_the_way(priv, pub)
    make_dir(priv.parent, "key directory")
    key = ec.generate_private_key(NODE_KEY_CURVES[curve]())
    _write(priv, key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                                   serialization.NoEncryption()), private=True)
    _write(pub, key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
           + f" {priv.name}\n".encode(), private=False)
    return priv, pub


def _load_ec_key(path: str | os.PathLike, loader, what: str, fmt: str, missing: str):
    p = Path(path)
    if not p.is_file():
        raise PrivacyError(_not_a_file(p, what, missing))
    try:
        key = loader(p.read_bytes())
    except (ValueError, TypeError, UnsupportedAlgorithm):
        raise PrivacyError(f"{what} must be {fmt}. Found something else in {p}.") from None
    if not isinstance(key, ec.EllipticCurvePrivateKey | ec.EllipticCurvePublicKey):
        raise PrivacyError(f"{what} must be ECDSA on a NIST curve (Flower's node authentication). "
                           f"Found {type(key).__name__} in {p}.")
    return p


def check_node_private_key(path: str | os.PathLike) -> Path:
    """Fail with one clear message unless ``path`` is an ECDSA OpenSSH private key that only its owner
    can read (as ssh refuses an unprotected key: anyone else who can read it can be this node)."""
    p = _load_ec_key(path, lambda b: serialization.load_ssh_private_key(b, None), "node key",
                     "an unencrypted OpenSSH private key",
                     f"be an existing private key file (run `fedshield keys new {path}`)")
    _owner_only(p, "node key")
    return p


def _owner_only(p: Path, what: str) -> None:
    """A private key of the user running this must be readable by its owner only. As ssh: a key owned by another
    account (root's, group-readable for a service user) is that account's arrangement; chmod 600 would lock this
    user out."""
    st = p.stat()
    mode = st.st_mode & 0o077
    if os.name == "posix" and mode and st.st_uid == os.getuid():
        raise PrivacyError(f"{what} {p} must be readable by its owner only (chmod 600 {p}). Found group/other "
                           f"permissions {mode:03o}.")


def _not_a_file(p: Path, what: str, missing: str, hint: str = "") -> str:
    """The message for a path that is not a file: "<what> must <missing>" where nothing is there, "must be a
    file" where a directory is (the advice for a missing file, ``hint``, would not move it)."""
    if p.is_dir():
        return f"{what} must be a file. Found a directory at {p}."
    if p.exists():  # a device, a FIFO, a socket: reading it would block or give no key
        return f"{what} must be a regular file. Found {_kind(p)} at {p}."
    return f"{what} must {missing}. Found no file at {p}{hint}."


def _kind(p: Path) -> str:
    import stat

    mode = p.stat().st_mode
    for test, name in ((stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "something other than a file"


def check_public_key(path: str | os.PathLike) -> Path:
    """Fail with one clear message unless ``path`` is an ECDSA OpenSSH public key."""
    return _load_ec_key(path, serialization.load_ssh_public_key, "enrolled public key", "an OpenSSH public key", "exist")


def check_ca_certificate(path: str | os.PathLike) -> Path:
    p = Path(path)
    if not p.is_file():
        raise PrivacyError(_not_a_file(p, "root certificate", "exist"))
    try:
        cert = x509.load_pem_x509_certificate(p.read_bytes())
    except ValueError:
        raise PrivacyError(f"root certificate must be a PEM X.509 certificate. Found something else in {p}.") from None
    try:
        is_ca = cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    except x509.ExtensionNotFound:
        is_ca = False
    if not is_ca:
        raise PrivacyError(f"root certificate must be a CA certificate (ca.crt, not server.crt). Found a non-CA certificate in {p}.")
    return p
