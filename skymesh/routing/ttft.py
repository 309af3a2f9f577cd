"""TTFT estimator (Mooncake / DualMap): T_queue + T_prefill of the uncached tokens.

Model: ttft = fixed_s + s_per_token * (pending prefill tokens ahead + uncached tokens).
Prefill work queued ahead on the replica and the request's own uncached prefill are both
prefill tokens the replica must run before this request's first token, so one
per-token coefficient covers both. The two coefficients are seeded from the replica
profile and refitted online by exponentially-weighted least squares (O(1) per
observation), so the estimate follows the real hardware and load.
"""

from __future__ import annotations


class TTFTEstimator:
    def __init__(
        self,
        s_per_token: float,
        fixed_s: float,
        *,
        forgetting: float = 0.995,
        prior_weight: float = 20.0,
    ) -> None:
        self.seed_s_per_token = s_per_token
        self.seed_fixed_s = fixed_s
        self.forgetting = forgetting
        # weighted sufficient statistics of (x = tokens, y = observed ttft), started with
        # a prior of `prior_weight` pseudo-observations on the seed line (at 0 and 1024)
        w = prior_weight / 2
        x0, x1 = 0.0, 1024.0
        y0, y1 = fixed_s, fixed_s + s_per_token * x1
        self._sw = 2 * w
        self._sx = w * (x0 + x1)
        self._sy = w * (y0 + y1)
        self._sxx = w * (x0 * x0 + x1 * x1)
        self._sxy = w * (x0 * y0 + x1 * y1)
        self.s_per_token = s_per_token
        self.fixed_s = fixed_s
        self.observations = 0

    def estimate(self, pending_tokens_ahead: int, uncached_tokens: int) -> float:
        return self.fixed_s + self.s_per_token * (max(0, pending_tokens_ahead) + max(0, uncached_tokens))

    def prefill_s(self, tokens: int) -> float:
        return self.s_per_token * max(0, tokens)

    def observe(self, pending_tokens_ahead: int, uncached_tokens: int, observed_ttft: float) -> None:
        if observed_ttft < 0:
            return
        x = float(max(0, pending_tokens_ahead) + max(0, uncached_tokens))
        f = self.forgetting
        self._sw = self._sw * f + 1
        self._sx = self._sx * f + x
        self._sy = self._sy * f + observed_ttft
        self._sxx = self._sxx * f + x * x
        self._sxy = self._sxy * f + x * observed_ttft
        self.observations += 1
        det = self._sw * self._sxx - self._sx * self._sx
        if det <= 1e-12:
            return
        slope = (self._sw * self._sxy - self._sx * self._sy) / det
        intercept = (self._sy - slope * self._sx) / self._sw
        # a negative slope or intercept is noise, not physics: keep the last sane fit
        if slope > 0:
            self.s_per_token = slope
            self.fixed_s = max(0.0, intercept)
