"""fedshield's privacy package: transport security now; DP and secure aggregation next."""

from ._errors import PrivacyError
from .transport import (
    CertificatePaths,
    check_ca_certificate,
    check_node_private_key,
    check_public_key,
    init_certificates,
    new_node_key,
)

__all__ = [
    "CertificatePaths",
    "PrivacyError",
    "check_ca_certificate",
    "check_node_private_key",
    "check_public_key",
    "init_certificates",
    "new_node_key",
]
