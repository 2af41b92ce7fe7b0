"""Adapters at the extension points of training frameworks; each is an optional extra, imported on demand.

=========================================  ===================================  ===========================
module                                     framework extension point            extra
=========================================  ===================================  ===========================
``lossscale.integrations.lightning``       precision plugins, a callback        ``lossscale[lightning]``
``lossscale.integrations.fabric``          Fabric's precision plugin            ``lossscale[lightning]``
``lossscale.integrations.accelerate``      the ``Accelerator``'s scaler slot    ``lossscale[accelerate]``
``lossscale.integrations.transformers``    the Trainer's accelerator, callback  ``lossscale[transformers]``
=========================================  ===================================  ===========================

Importing ``lossscale`` or ``lossscale.integrations`` imports no framework; importing one of the modules
above without its framework raises an ImportError that names the extra to install.
"""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["require"]


def require(framework: str, extra: str, integration: str) -> ModuleType:
    """Import ``framework`` for ``lossscale.integrations.<integration>``; an ImportError names the extra."""
    try:
        return importlib.import_module(framework)
    except ImportError as err:
        raise ImportError(
            f"lossscale.integrations.{integration} needs the '{framework}' package, which could not be imported "
            f"({err}); install it with: pip install 'lossscale[{extra}]'"
        ) from err
