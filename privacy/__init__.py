"""fedshield's privacy package: transport security and differential privacy (mechanisms, accounting, budget)."""

from ._errors import PrivacyError
from ._opacus import quiet_import_opacus
from .accountant import BudgetExhausted, PrivacyBudget, PrivacyEvent, RdpAccountant, calibrate_noise_multiplier
from .dp import (
    AdaptiveClipping,
    CentralGaussianMechanism,
    GaussianNoise,
    clip_scale,
    effective_noise_multiplier,
    skellam_noise,
)
from .transport import (
    CertificatePaths,
    check_ca_certificate,
    check_node_private_key,
    check_public_key,
    init_certificates,
    make_dir,
    write_atomic,
    new_node_key,
)

__all__ = [
    "AdaptiveClipping",
    "BudgetExhausted",
    "CentralGaussianMechanism",
    "CertificatePaths",
    "GaussianNoise",
    "PrivacyBudget",
    "PrivacyError",
    "PrivacyEvent",
    "RdpAccountant",
    "calibrate_noise_multiplier",
    "check_ca_certificate",
    "check_node_private_key",
    "check_public_key",
    "clip_scale",
    "effective_noise_multiplier",
    "init_certificates",
    "make_dir",
    "new_node_key",
    "quiet_import_opacus",
    "skellam_noise",
    "write_atomic",
]
