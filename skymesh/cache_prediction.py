"""How well a routing decision's expected cached prefix (``Decision.matched_tokens``)
matched what the replica found in its cache: within one block either way, over (the
policy counted on blocks that were not there) or under.

One rule for both places that judge it: the balancer per answer, from the replica's
reported ``cached_tokens`` (``skymesh_cache_predictions_total``), and the simulator over
its per-request arrays (``SimResult.prediction_accuracy`` / ``prediction_over``). The
comparisons work on plain counts and, elementwise, on numpy arrays.
"""

from __future__ import annotations

from enum import Enum
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    import numpy as np

Tokens = TypeVar("Tokens", int, float, "np.ndarray[Any, Any]")


class PredictionResult(Enum):
    WITHIN_BLOCK = "within_block"
    OVER = "over"  # the policy counted on more than the replica had
    UNDER = "under"


def within_block(predicted_tokens: Tokens, cached_tokens: Tokens, block_tokens: int) -> Any:
    """The prediction is within one block (``block_tokens``) of the cache either way."""
    return abs(predicted_tokens - cached_tokens) <= block_tokens


def over_block(predicted_tokens: Tokens, cached_tokens: Tokens, block_tokens: int) -> Any:
    """The prediction exceeds the cache by more than one block."""
    return predicted_tokens - cached_tokens > block_tokens


def judge_prediction(predicted_tokens: int, cached_tokens: int, block_tokens: int) -> PredictionResult:
    """Within one block either way, else over or under."""
    if within_block(predicted_tokens, cached_tokens, block_tokens):
        return PredictionResult.WITHIN_BLOCK
    return PredictionResult.OVER if over_block(predicted_tokens, cached_tokens, block_tokens) else PredictionResult.UNDER
