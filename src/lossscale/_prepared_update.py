"""GradScaler's policy update, computed at ``step()`` before the optimizer runs and installed by ``update()``.

torch's order is ``step(optimizer)`` then ``update()``; the policy's next state depends only on the iteration's
found_inf (and the losses' finiteness), which ``step()`` already knows before the optimizer runs. Computed
there, the rule's 0-d ops run while they are in cache rather than after a kernel that streamed every
parameter and its state, where each costs 3-4x as much (as for LossScaleOptimizer, ``_pipeline._advance``).
Policies are pure, so computing early changes nothing; ``update()`` installs the prepared state only when it
is exactly what it would compute itself: the same single optimizer record stepped, no ``new_scale``, the
same loss-finiteness flag, a policy that does not observe amax, and the scale not set in between
(:meth:`lossscale.state.LossScale.commit` recomputes then). It prepares only where the previous ``update()``
saw a single optimizer, so a loop over several optimizers pays no wasted computation after its first
iteration. No host read.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from lossscale.state import LossScale, NextState

__all__ = ["PreparedUpdate", "prepare", "prepared_for"]


class PreparedUpdate(NamedTuple):
    """The next state computed for ``record`` (one optimizer's record) with ``loss_finite`` as it was."""

    record: dict
    next_state: NextState
    loss_finite: torch.Tensor | None


def prepare(owner: LossScale, records: dict[int, dict], record: dict, found_inf: torch.Tensor,
            loss_finite: torch.Tensor | None, *, clean_on_host: bool, one_optimizer: bool,
            ready: Any) -> PreparedUpdate | None:
    """The policy's next state for an iteration whose only stepped optimizer is ``record``'s (found_inf:
    its count, as ``update()`` sums it), or None where ``update()`` must compute it itself: the last
    iteration had several optimizers, another record was unscaled or stepped, or the policy observes
    amax. ``ready``: the stage of a record not yet unscaled or stepped."""
    if not one_optimizer or owner.policy.observes_amax:
        return None
    if any(r is not record and r["stage"] is not ready for r in records.values()):
        return None
    return PreparedUpdate(record, owner.next_state(found_inf, None, loss_finite, clean_on_host=clean_on_host),
                          loss_finite)


def prepared_for(prepared: PreparedUpdate | None, seen: list[dict], loss_finite: torch.Tensor | None
                 ) -> NextState | None:
    """What :func:`prepare` computed, if ``update()`` would compute the same now (``seen``: the records
    unscaled or stepped this iteration); else None."""
    if prepared is None or len(seen) != 1 or seen[0] is not prepared.record:
        return None
    return prepared.next_state if prepared.loss_finite is loss_finite else None
