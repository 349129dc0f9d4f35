"""Hydra's config module: ``train.yaml`` (the defaults list and Hydra's settings); the groups' options are
the dataclasses ``torchrec_herald.config`` registers in Hydra's ConfigStore (imported here, so composing
from this module always finds them)."""

import torchrec_herald.config  # noqa: F401  (registers the config groups)
