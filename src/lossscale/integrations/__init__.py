"""Adapters at the extension points of training frameworks; each is an optional extra, imported on demand.

=========================================  ===================================  ===================================
module                                     framework extension point            install (in a clone of lossscale)
=========================================  ===================================  ===================================
``lossscale.integrations.lightning``       precision plugins, a callback        ``pip install '.[lightning]'``
``lossscale.integrations.fabric``          Fabric's precision plugin            ``pip install '.[lightning]'``
``lossscale.integrations.accelerate``      the ``Accelerator``'s scaler slot    ``pip install '.[accelerate]'``
``lossscale.integrations.transformers``    the Trainer's accelerator, callback  ``pip install '.[transformers]'``
=========================================  ===================================  ===================================

lossscale is installed from a clone of its repository (it is on no package index), so an extra is installed
there: ``pip install '.[lightning]'`` in the clone's folder. Importing ``lossscale`` or ``lossscale.integrations``
imports no framework; importing one of the modules above without its framework raises an ImportError that names
the extra to install.
"""

from __future__ import annotations

import importlib
from types import ModuleType


def require(framework: str, extra: str, integration: str) -> ModuleType:
    """Import ``framework`` for ``lossscale.integrations.<integration>``; an ImportError names the extra."""
    try:
        return importlib.import_module(framework)
    except ImportError as err:
        raise ImportError(
            f"lossscale.integrations.{integration} needs the '{framework}' package, which could not be imported "
            f"({err}); install it with the '{extra}' extra, in a clone of the lossscale repository: "
            f"pip install '.[{extra}]'"
        ) from err
