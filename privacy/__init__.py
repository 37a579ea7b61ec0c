"""fedshield's privacy package: transport security and differential privacy (mechanisms, accounting, budget)."""

from ._errors import PrivacyError
from ._opacus import quiet_import_opacus
from .accountant import (
    DEFAULT_ACCOUNTANT,
    Accountant,
    BudgetExhausted,
    PrivacyBudget,
    PrivacyEvent,
    RdpAccountant,
    available_accountants,
    calibrate_noise_multiplier,
    create_accountant,
    epsilon_of,
    load_accountant,
)
from .pld import PldAccountant
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
    "Accountant",
    "AdaptiveClipping",
    "BudgetExhausted",
    "CentralGaussianMechanism",
    "CertificatePaths",
    "DEFAULT_ACCOUNTANT",
    "GaussianNoise",
    "PldAccountant",
    "PrivacyBudget",
    "PrivacyError",
    "PrivacyEvent",
    "RdpAccountant",
    "available_accountants",
    "calibrate_noise_multiplier",
    "check_ca_certificate",
    "check_node_private_key",
    "check_public_key",
    "clip_scale",
    "create_accountant",
    "effective_noise_multiplier",
    "epsilon_of",
    "init_certificates",
    "load_accountant",
    "make_dir",
    "new_node_key",
    "quiet_import_opacus",
    "skellam_noise",
    "write_atomic",
]
