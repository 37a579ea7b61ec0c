"""Transport security material: CA + server certificate, OpenSSH node keys, and their checks."""

from __future__ import annotations

import ipaddress
import os
import stat

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID

from privacy import (
    CertificatePaths,
    PrivacyError,
    check_ca_certificate,
    check_node_private_key,
    check_public_key,
    init_certificates,
    new_node_key,
)
from privacy.transport import CA_KEY


def _mode(p) -> int:
    return stat.S_IMODE(os.stat(p).st_mode)


def _cert(p) -> x509.Certificate:
    return x509.load_pem_x509_certificate(p.read_bytes())


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> CertificatePaths:
    return init_certificates(tmp_path_factory.mktemp("certs"), extra_names=("node.example.org", "10.1.2.3"))


@pytest.fixture(scope="module")
def node_key(tmp_path_factory):
    return new_node_key(tmp_path_factory.mktemp("keys") / "node-1")


@pytest.fixture(scope="module")
def foreign_keys(tmp_path_factory):
    """RSA and ed25519 keys in every format the checks might be handed."""
    d = tmp_path_factory.mktemp("foreign")
    out = {}
    for kind, key in (("rsa", rsa.generate_private_key(65537, 1024)), ("ed25519", ed25519.Ed25519PrivateKey.generate())):
        priv = d / kind
        priv.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                                           serialization.NoEncryption()))
        pub = d / f"{kind}.pub"
        pub.write_bytes(key.public_key().public_bytes(serialization.Encoding.OpenSSH,
                                                      serialization.PublicFormat.OpenSSH))
        pem = d / f"{kind}.pem"
        pem.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                          serialization.NoEncryption()))
        out[kind] = (priv, pub, pem)
    return out


# --------------------------------------------------------------------------- certificates


def test_init_creates_all_files(certs):
    d = certs.ca_cert.parent
    assert certs == CertificatePaths.in_dir(d)
    for p in (certs.ca_cert, certs.server_cert, certs.server_key, d / CA_KEY):
        assert p.is_file() and p.stat().st_size > 0
    assert certs.check() is certs


def test_server_certificate_is_issued_by_the_ca(certs):
    ca, srv = _cert(certs.ca_cert), _cert(certs.server_cert)
    srv.verify_directly_issued_by(ca)
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca is True
    assert srv.extensions.get_extension_for_class(x509.BasicConstraints).value.ca is False
    eku = srv.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert ExtendedKeyUsageOID.SERVER_AUTH in list(eku)
    assert isinstance(ca.public_key(), ec.EllipticCurvePublicKey)
    assert isinstance(ca.public_key().curve, ec.SECP384R1)
    assert srv.not_valid_before_utc < srv.not_valid_after_utc


def test_server_certificate_is_not_self_signed(certs):
    srv = _cert(certs.server_cert)
    with pytest.raises(ValueError):
        srv.verify_directly_issued_by(srv)


def test_server_key_matches_certificate(certs):
    key = serialization.load_pem_private_key(certs.server_key.read_bytes(), None)
    assert key.public_key().public_numbers() == _cert(certs.server_cert).public_key().public_numbers()
    ca_key = serialization.load_pem_private_key((certs.ca_cert.parent / CA_KEY).read_bytes(), None)
    assert ca_key.public_key().public_numbers() == _cert(certs.ca_cert).public_key().public_numbers()


def test_san_has_localhost_loopback_and_extra_names(certs):
    san = _cert(certs.server_cert).extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["localhost", "node.example.org"]
    assert san.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("127.0.0.1"),
                                                       ipaddress.ip_address("10.1.2.3")]


def test_private_keys_are_0600_and_certificates_are_not_secret(certs):
    assert _mode(certs.server_key) == 0o600
    assert _mode(certs.ca_cert.parent / CA_KEY) == 0o600
    assert _mode(certs.server_cert) & 0o077 != 0o077  # plain public file; only its key is secret


def test_refuses_to_overwrite_without_force(tmp_path):
    paths = init_certificates(tmp_path)
    before = paths.ca_cert.read_bytes()
    with pytest.raises(PrivacyError, match="must not already hold certificates.*--force"):
        init_certificates(tmp_path)
    assert paths.ca_cert.read_bytes() == before
    init_certificates(tmp_path, force=True)
    assert paths.ca_cert.read_bytes() != before
    _cert(paths.server_cert).verify_directly_issued_by(_cert(paths.ca_cert))


def test_a_lone_ca_key_also_blocks_overwrite(tmp_path):
    (tmp_path / CA_KEY).write_bytes(b"secret")
    with pytest.raises(PrivacyError):
        init_certificates(tmp_path)


def test_check_reports_missing_files(tmp_path):
    with pytest.raises(PrivacyError, match="TLS file must exist.*certs init"):
        CertificatePaths.in_dir(tmp_path).check()


@pytest.mark.parametrize("what", ["server key", "node key"])
def test_force_overwrite_still_leaves_keys_0600(tmp_path, what):
    if what == "server key":
        paths = init_certificates(tmp_path)
        os.chmod(paths.server_key, 0o644)
        init_certificates(tmp_path, force=True)
        assert _mode(paths.server_key) == 0o600
    else:
        priv, _ = new_node_key(tmp_path / "k")
        os.chmod(priv, 0o644)
        new_node_key(tmp_path / "k", force=True)
        assert _mode(priv) == 0o600


@pytest.mark.parametrize("what", ["server key", "node key"])
def test_force_writes_a_new_file_that_an_earlier_reader_cannot_see(tmp_path, what):
    """--force rewrote the key in place: a descriptor opened while the old file was readable then read
    the new private key (a review's demonstration)."""
    make = (lambda: init_certificates(tmp_path, force=True).server_key) if what == "server key" else \
        (lambda: new_node_key(tmp_path / "k", force=True)[0])
    key = make()
    os.chmod(key, 0o644)
    with open(key, "rb") as early:  # someone else, while the old key was readable
        old, inode = key.read_bytes(), os.stat(key).st_ino
        make()
        assert early.read() == old  # the old file, not the new key
    assert key.read_bytes() != old and os.stat(key).st_ino != inode and _mode(key) == 0o600
    assert not [p for p in key.parent.iterdir() if p.name.endswith(".tmp")]


@pytest.mark.parametrize("what", ["server key", "node key"])
def test_a_symbolic_link_at_a_key_path_is_refused_and_its_target_untouched(tmp_path, what):
    target = tmp_path / "elsewhere"
    target.write_bytes(b"someone else's file\n")
    if what == "server key":
        d = tmp_path / "certs"
        ca = init_certificates(d).ca_cert.read_bytes()
        (d / "server.key").unlink()
        (d / "server.key").symlink_to(target)
        with pytest.raises(PrivacyError, match="server.key must not be a symbolic link"):
            init_certificates(d, force=True)
        assert (d / "ca.crt").read_bytes() == ca  # nothing of the set was replaced
    else:
        (tmp_path / "k").symlink_to(tmp_path / "dangling")  # a dangling link does not "exist": no --force needed
        with pytest.raises(PrivacyError, match="k must not be a symbolic link"):
            new_node_key(tmp_path / "k")
        assert not (tmp_path / "dangling").exists()
    assert target.read_bytes() == b"someone else's file\n"


def test_check_ca_certificate_accepts_the_ca(certs):
    assert check_ca_certificate(certs.ca_cert) == certs.ca_cert


# --------------------------------------------------------------------------- node keys


def test_new_node_key_is_a_p256_openssh_pair(node_key):
    priv, pub = node_key
    assert pub.name == priv.name + ".pub"
    assert priv.read_bytes().startswith(b"-----BEGIN OPENSSH PRIVATE KEY-----")
    key = serialization.load_ssh_private_key(priv.read_bytes(), None)
    assert isinstance(key, ec.EllipticCurvePrivateKey) and isinstance(key.curve, ec.SECP256R1)
    text = pub.read_text()
    assert text.startswith("ecdsa-sha2-nistp256 ") and text.rstrip().endswith(" node-1")
    public = serialization.load_ssh_public_key(pub.read_bytes())
    assert isinstance(public, ec.EllipticCurvePublicKey)
    assert public.public_numbers() == key.public_key().public_numbers()
    assert _mode(priv) == 0o600


def test_two_node_keys_differ(tmp_path):
    a, _ = new_node_key(tmp_path / "a")
    b, _ = new_node_key(tmp_path / "b")
    assert a.read_bytes() != b.read_bytes()


def test_new_node_key_creates_parent_dirs(tmp_path):
    priv, pub = new_node_key(tmp_path / "deep" / "er" / "k")
    assert priv.is_file() and pub.is_file()


def test_new_node_key_refuses_to_overwrite(tmp_path):
    priv, pub = new_node_key(tmp_path / "k")
    before = priv.read_bytes()
    with pytest.raises(PrivacyError, match="must not exist yet.*--force"):
        new_node_key(tmp_path / "k")
    assert priv.read_bytes() == before
    pub.unlink()
    (tmp_path / "j.pub").write_text("x")
    with pytest.raises(PrivacyError, match="must not exist yet"):
        new_node_key(tmp_path / "j")
    new_node_key(tmp_path / "k", force=True)
    assert priv.read_bytes() != before


def test_new_node_key_rejects_a_directory(tmp_path):
    with pytest.raises(PrivacyError, match="key path must be DIR/NAME"):
        new_node_key(tmp_path)


def test_checks_accept_generated_keys(node_key):
    priv, pub = node_key
    assert check_node_private_key(priv) == priv
    assert check_public_key(pub) == pub


def test_checks_accept_other_nist_curves(tmp_path):
    key = ec.generate_private_key(ec.SECP256R1())
    priv = tmp_path / "p256"
    priv.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                                       serialization.NoEncryption()))
    os.chmod(priv, 0o600)
    assert check_node_private_key(priv) == priv


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o644])
def test_a_node_key_others_can_read_is_refused(node_key, mode):
    """As ssh refuses an unprotected key: whoever else can read it can be this node."""
    priv, _ = node_key
    os.chmod(priv, mode)
    with pytest.raises(PrivacyError, match=f"must be readable by its owner only \\(chmod 600 .*\\). Found group/other "
                                           f"permissions {mode & 0o077:03o}"):
        check_node_private_key(priv)


def test_a_node_key_of_another_account_is_not_held_to_its_owners_mode(node_key, monkeypatch):
    """As ssh: a root-owned key, group-readable for the service user that runs the agent, is accepted
    (chmod 600, the advice, would lock that user out)."""
    priv, _ = node_key
    os.chmod(priv, 0o640)
    monkeypatch.setattr(os, "getuid", lambda: os.stat(priv).st_uid + 1)
    assert check_node_private_key(priv) == priv


# --------------------------------------------------------------------------- rejections


def _garbage(tmp_path):
    p = tmp_path / "garbage"
    p.write_bytes(b"\x00\xffnot a key at all\n")
    return p


@pytest.mark.parametrize("check", [check_node_private_key, check_public_key, check_ca_certificate])
def test_checks_reject_missing_files(tmp_path, check):
    with pytest.raises(PrivacyError, match="Found no file at"):
        check(tmp_path / "missing")
    with pytest.raises(PrivacyError, match="Found a directory at"):
        check(tmp_path)  # a directory is not a file


@pytest.mark.parametrize(("check", "rule"), [
    (check_node_private_key, "must be an unencrypted OpenSSH private key"),
    (check_ca_certificate, "must be a PEM X.509 certificate"),
])
def test_checks_reject_garbage(tmp_path, check, rule):
    p = _garbage(tmp_path)
    with pytest.raises(PrivacyError, match=rule) as info:
        check(p)
    assert str(p) in str(info.value)


@pytest.mark.parametrize("text", [b"ecdsa-sha2-nistp384 !!!notbase64!!!\n", b"ecdsa-sha2-nistp384\n", b"",
                                  b"ecdsa-sha2-nistp384 AAAA\n"])
def test_public_key_check_rejects_malformed_known_type(tmp_path, text):
    p = tmp_path / "bad.pub"
    p.write_bytes(text)
    with pytest.raises(PrivacyError, match="must be an OpenSSH public key") as info:
        check_public_key(p)
    assert str(p) in str(info.value)


@pytest.mark.parametrize("what", ["garbage", "pem private key", "openssh private key", "rsa pem"])
def test_public_key_check_rejects_non_public_key_files(tmp_path, certs, node_key, foreign_keys, what):
    p = {"garbage": _garbage(tmp_path), "pem private key": certs.server_key, "openssh private key": node_key[0],
         "rsa pem": foreign_keys["rsa"][2]}[what]
    with pytest.raises(PrivacyError, match="must be an OpenSSH public key"):
        check_public_key(p)


@pytest.mark.parametrize("kind", ["rsa", "ed25519"])
def test_node_key_check_rejects_non_ecdsa_keys(foreign_keys, kind):
    priv, _, pem = foreign_keys[kind]
    with pytest.raises(PrivacyError, match="must be ECDSA on a NIST curve"):
        check_node_private_key(priv)
    with pytest.raises(PrivacyError, match="must be an unencrypted OpenSSH private key"):
        check_node_private_key(pem)


@pytest.mark.parametrize("kind", ["rsa", "ed25519"])
def test_public_key_check_rejects_non_ecdsa_keys(foreign_keys, kind):
    _, pub, _ = foreign_keys[kind]
    with pytest.raises(PrivacyError, match="enrolled public key must be ECDSA") as info:
        check_public_key(pub)
    assert ("RSAPublicKey" if kind == "rsa" else "Ed25519PublicKey") in str(info.value)


@pytest.mark.parametrize("kind", ["rsa", "ed25519"])
def test_ca_check_rejects_keys(foreign_keys, kind):
    for p in foreign_keys[kind]:
        with pytest.raises(PrivacyError, match="must be a PEM X.509 certificate"):
            check_ca_certificate(p)


def test_node_key_check_rejects_a_pem_ec_key_and_a_public_key(certs, node_key):
    with pytest.raises(PrivacyError, match="unencrypted OpenSSH private key"):
        check_node_private_key(certs.server_key)
    with pytest.raises(PrivacyError, match="unencrypted OpenSSH private key"):
        check_node_private_key(node_key[1])


def test_ca_check_rejects_der_and_private_keys(tmp_path, certs):
    der = tmp_path / "ca.der"
    der.write_bytes(_cert(certs.ca_cert).public_bytes(serialization.Encoding.DER))
    with pytest.raises(PrivacyError, match="must be a PEM X.509 certificate"):
        check_ca_certificate(der)
    with pytest.raises(PrivacyError, match="must be a PEM X.509 certificate"):
        check_ca_certificate(certs.server_key)


def test_a_key_directory_that_takes_no_new_file_is_named(tmp_path, monkeypatch):
    """A key is written beside its final name and renamed: the directory, not the file, must be writable
    (a writable key in a read-only directory was blamed on the key). Simulated: root writes anywhere."""
    import privacy.transport as transport

    priv, _ = new_node_key(tmp_path / "k")
    real_open = os.open

    def no_new_files(path, flags, *args):
        if flags & os.O_CREAT:
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, flags, *args)

    monkeypatch.setattr(transport.os, "open", no_new_files)
    with pytest.raises(PrivacyError, match=f"^{tmp_path} must be a writable directory .*Found: Permission denied"):
        new_node_key(tmp_path / "k", force=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["k", "k.pub"]


def test_write_atomic_makes_the_rename_durable(tmp_path, monkeypatch):
    """The new file is fsynced before the rename and its directory after it: without the second, a
    power loss could bring back the old file (a local-DP ledger's old epsilon) after the write returned."""
    from privacy.transport import write_atomic

    synced = []
    real = os.fsync

    def fsync(fd):
        synced.append("dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "file")
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    target = tmp_path / "ledger.json"
    write_atomic(target, b"{}")
    assert target.read_bytes() == b"{}" and synced == ["file", "dir"]
    assert [p.name for p in tmp_path.iterdir()] == ["ledger.json"]  # no temporary file left


@pytest.mark.parametrize("err, raised", [("EINVAL", False), ("ENOTSUP", False), ("EIO", True), ("ENOSPC", True)])
def test_a_directory_fsync_that_is_unsupported_is_skipped_and_a_failing_one_is_raised(tmp_path, monkeypatch, err,
                                                                                       raised):
    """A file system without directory fsync keeps the rename as it keeps it; an I/O error there means the
    write may not survive a power loss, and the caller (a ledger's save) must hear of it."""
    import errno

    from privacy.transport import write_atomic

    real = os.fsync

    def fsync(fd):
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            raise OSError(getattr(errno, err), os.strerror(getattr(errno, err)))
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    target = tmp_path / "ledger.json"
    if raised:
        with pytest.raises(OSError):
            write_atomic(target, b"{}")
    else:
        write_atomic(target, b"{}")
    assert target.read_bytes() == b"{}"  # renamed into place either way
