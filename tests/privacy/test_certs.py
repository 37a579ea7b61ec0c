"""``init_certificates`` / ``new_node_key`` on bad input: one PrivacyError (one CLI line), nothing half-made."""

from __future__ import annotations

import ipaddress
import os
import re

import pytest
from cryptography import x509

from privacy import PrivacyError, init_certificates, make_dir, new_node_key
from privacy.transport import check_san
from simulations.cli import main


@pytest.mark.parametrize("name", ["not a valid name!!", "-bad.com", "bad-.com", "a_b.example", "a..b", "", "x" * 64 + ".com",
                                  "é.example", "*", "a.*.example", "999.1.1.1", "10.1.2", "1.2.3.4.5", "host.123"])
def test_san_rejects_names_that_are_neither_dns_nor_ip(tmp_path, name):
    with pytest.raises(PrivacyError, match="--san must be a DNS name .* or an IP address"):
        init_certificates(tmp_path / "c", extra_names=(name,))
    assert not (tmp_path / "c").exists()  # checked before anything is created


@pytest.mark.parametrize("name", ["node.example.org", "host-1", "*.example.com", "10.1.2.3", "::1", "fe80::1", "XN--BCHER-KVA.example",
                                  "1password.example", "node.42a"])
def test_san_accepts_dns_names_and_ips(name):
    assert check_san(name) == name


def test_accepted_sans_land_in_the_certificate(tmp_path):
    paths = init_certificates(tmp_path, extra_names=("*.example.com", "::1"))
    san = x509.load_pem_x509_certificate(paths.server_cert.read_bytes()).extensions.get_extension_for_class(
        x509.SubjectAlternativeName).value
    assert "*.example.com" in san.get_values_for_type(x509.DNSName)
    assert ipaddress.ip_address("::1") in san.get_values_for_type(x509.IPAddress)


@pytest.mark.parametrize("error", [PrivacyError, ValueError])
def test_make_dir_names_a_file_in_the_way_and_a_directory_it_cannot_make(tmp_path, error):
    f = tmp_path / "afile"
    f.write_text("x")
    with pytest.raises(error, match="^thing must be a directory. Found a file at .*afile; hint.$"):
        make_dir(f, "thing", error, hint="; hint")
    with pytest.raises(error, match="^thing .*sub must be creatable. Found: Not a directory.$"):
        make_dir(f / "sub", "thing", error)
    make_dir(tmp_path / "a" / "b", "thing", error)
    assert (tmp_path / "a" / "b").is_dir()


def test_certificate_directory_that_is_a_file(tmp_path):
    f = tmp_path / "afile"
    f.write_text("x")
    with pytest.raises(PrivacyError, match="certificate directory must be a directory. Found a file at .*afile"):
        init_certificates(f)


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux /proc (a directory nobody can create in)")
def test_node_key_parent_that_cannot_be_made(tmp_path):
    f = tmp_path / "afile"
    f.write_text("x")
    with pytest.raises(PrivacyError, match="key directory must be a directory. Found a file at .*afile"):
        new_node_key(f / "k")
    with pytest.raises(PrivacyError, match="key directory .*nope must be creatable. Found: No such file or directory"):
        new_node_key("/proc/nope/x")


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("fedshield: error: "), err
    return err[0]


def test_cli_certs_and_keys_file_system_errors_are_one_line(tmp_path, capsys):
    f = tmp_path / "default.toml"
    f.write_text("[run]\n")
    assert main(["certs", "init", str(f)]) == 2
    assert "must be a directory" in _one_error_line(capsys)
    assert main(["keys", "new", str(f / "x")]) == 2
    assert "key directory must be a directory" in _one_error_line(capsys)
    assert main(["certs", "init", str(tmp_path / "c"), "--san", "not a valid name!!"]) == 2
    assert "'not a valid name!!'" in _one_error_line(capsys)
    assert not (tmp_path / "c").exists()


@pytest.mark.parametrize("path", [".", "", "/", ".."])
def test_node_key_path_without_a_name_is_one_error(path):
    """``fedshield keys new .`` used to raise ValueError (PosixPath('.') has an empty name)."""
    with pytest.raises(PrivacyError, match="key path must be DIR/NAME"):
        new_node_key(path)


@pytest.mark.parametrize("case, message", [
    ("garbage-ca", "ca.crt must be a PEM certificate. Found something else."),
    ("garbage-cert", "server.crt must be a PEM certificate. Found something else."),
    ("garbage-key", "server.key must be an unencrypted PEM private key. Found something else."),
    ("other-ca", "server.crt must be signed by the CA in"),
    ("other-key", "server.key must be the key of"),
])
def test_tls_files_that_do_not_fit_together_are_one_error_naming_the_file(tmp_path, case, message):
    """Checked before the SuperLink starts: these used to give an SSL error without a file name, or a
    SuperLink that never passed its health check (a CA that did not sign the server certificate)."""
    import shutil

    from privacy.transport import CertificatePaths

    good, other = init_certificates(tmp_path / "a"), init_certificates(tmp_path / "b")
    CertificatePaths.in_dir(tmp_path / "a").check()
    d = tmp_path / "c"
    shutil.copytree(tmp_path / "a", d)
    paths = CertificatePaths.in_dir(d)
    if case.startswith("garbage"):
        {"garbage-ca": paths.ca_cert, "garbage-cert": paths.server_cert, "garbage-key": paths.server_key}[case].write_text("junk")
    else:
        src = CertificatePaths.in_dir(tmp_path / "b")
        shutil.copy(src.ca_cert if case == "other-ca" else src.server_key, paths.ca_cert if case == "other-ca" else paths.server_key)
    with pytest.raises(PrivacyError, match=re.escape(message)):
        paths.check()
    assert good and other


def test_force_never_leaves_a_private_key_behind_when_a_later_file_cannot_be_written(tmp_path):
    """A directory where the public half (or a certificate) goes used to fail after the private key
    was written: --force left a lone private key."""
    (tmp_path / "k").mkdir()
    (tmp_path / "k" / "b.pub").mkdir()
    with pytest.raises(PrivacyError, match=r"b\.pub must be a file \(or not exist yet\)\. Found a directory"):
        new_node_key(tmp_path / "k" / "b", force=True)
    assert not (tmp_path / "k" / "b").exists()
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "ca.crt").mkdir()
    with pytest.raises(PrivacyError, match=r"ca\.crt must be a file"):
        init_certificates(tmp_path / "c", force=True)
    assert sorted(p.name for p in (tmp_path / "c").iterdir()) == ["ca.crt"]


def test_a_server_key_others_can_read_is_refused(tmp_path):
    """The agent refused such a node key; the coordinator served a world-readable server key (a review)."""
    import os

    from privacy import CertificatePaths, PrivacyError, init_certificates

    paths = init_certificates(tmp_path / "certs")
    CertificatePaths.in_dir(tmp_path / "certs").check()
    os.chmod(paths.server_key, 0o644)
    with pytest.raises(PrivacyError, match=r"server key .* must be readable by its owner only \(chmod 600"):
        CertificatePaths.in_dir(tmp_path / "certs").check()


@pytest.mark.parametrize(("args", "curve"), [([], "secp256r1"), (["--curve", "p384"], "secp384r1")])
def test_node_keys_are_p256_by_default_and_p384_on_request(tmp_path, args, curve):
    from cryptography.hazmat.primitives.serialization import load_ssh_private_key, load_ssh_public_key

    from simulations.cli import main

    assert main(["keys", "new", str(tmp_path / "k"), *args]) == 0
    priv = load_ssh_private_key((tmp_path / "k").read_bytes(), None)
    pub = load_ssh_public_key((tmp_path / "k.pub").read_bytes())
    assert priv.curve.name == pub.curve.name == curve and priv.public_key() == pub


def test_an_unknown_curve_is_one_error(tmp_path):
    with pytest.raises(PrivacyError, match="curve must be one of"):
        new_node_key(tmp_path / "k", curve="p521")
    assert not (tmp_path / "k").exists()
