"""The hidden states a simulated server captures: a formula a client can recompute exactly.

For token ``t`` (its position in the stored ``token_ids``), layer id ``layer`` and hidden unit ``h``::

    value[t, l, h] = ((token_ids[t] * 31 + t * 7 + layer * 13 + h * 3) % 251 - 125) / 16

where the layer axis ``l`` runs over ``sorted(set(layer_ids))``, as vLLM orders
``eagle_aux_hidden_state_layer_ids``. Every value is a multiple of 1/16 between -7.8125 and
7.8125, so bf16 holds it exactly (a stored bf16 file can be checked with ``==``); fp8 holds it to
its rounding. The value moves with the token, its position and the layer, so a row shifted by one
position, a stale row or two swapped layers no longer match.

Worked by hand: token 5 at t=0, layer 2, h=0 is ((155 + 0 + 26 + 0) % 251 - 125) / 16 = 56 / 16 = 3.5.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

__all__ = ["hidden_states", "layer_axis"]

# The formula's constants: multipliers coprime to the modulus, so each input moves the value.
_TOKEN_FACTOR = 31
_POSITION_FACTOR = 7
_LAYER_FACTOR = 13
_UNIT_FACTOR = 3
_MODULUS = 251
_OFFSET = 125
# A power of two: k / 16 with |k| <= 125 needs 7 significant bits, bf16 has 8.
_DIVISOR = 16.0


def layer_axis(layer_ids: Sequence[int]) -> list[int]:
    """The layer ids in the order of the stored layer axis (vLLM's ``sorted(set(ids))``)."""
    return sorted(set(layer_ids))


def hidden_states(
    token_ids: Sequence[int], layer_ids: Sequence[int], hidden_size: int
) -> npt.NDArray[np.float32]:
    """The ``[T, L, H]`` float32 values the simulator stores for ``token_ids`` (module docstring)."""
    tokens = np.asarray(token_ids, dtype=np.int64).reshape(-1, 1, 1)
    positions = np.arange(tokens.shape[0], dtype=np.int64).reshape(-1, 1, 1)
    layers = np.asarray(layer_axis(layer_ids), dtype=np.int64).reshape(1, -1, 1)
    units = np.arange(hidden_size, dtype=np.int64).reshape(1, 1, -1)
    mixed = (
        tokens * _TOKEN_FACTOR + positions * _POSITION_FACTOR + layers * _LAYER_FACTOR + units * _UNIT_FACTOR
    )
    return ((mixed % _MODULUS - _OFFSET) / _DIVISOR).astype(np.float32)
