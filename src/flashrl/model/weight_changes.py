"""How much of the rollout policy one weight update changed (`Engine.update_weights(count_changed=True)`)."""

from __future__ import annotations


class ChangeCounts:
    """Stored rollout-weight elements that one update changed, quantized codes and high-precision
    values (norms, embeddings, layers kept dense) apart: how far the rollout policy follows the
    trainer (an update smaller than half a grid step leaves the stored value as it was)."""

    def __init__(self) -> None:
        self.changed = {True: 0, False: 0}
        self.total = {True: 0, False: 0}

    def add(self, quantized: bool, changed: int, total: int) -> None:
        self.changed[quantized] += changed
        self.total[quantized] += total

    def fractions(self) -> dict[str, float]:
        """``weights_changed_frac`` (all), ``codes_changed_frac``, ``dense_changed_frac``; a part
        the model does not have is left out."""
        out = {}
        total = sum(self.total.values())
        if total:
            out["weights_changed_frac"] = sum(self.changed.values()) / total
        for quantized, key in ((True, "codes_changed_frac"), (False, "dense_changed_frac")):
            if self.total[quantized]:
                out[key] = self.changed[quantized] / self.total[quantized]
        return out
