"""The hooks the batcher calls as its queue and batches change: an interface here, so that the batcher
(service.models.batcher) reports to the metrics (service.telemetry.metrics) without either importing the other."""

from __future__ import annotations


class BatcherObserver:
    """Hooks for metrics; the default does nothing (service.telemetry.metrics implements them)."""

    def queue_changed(self, sentences: int, tokens: int) -> None: ...

    def batch_done(self, sentences: int, tokens: int, padded_tokens: int, seconds: float) -> None: ...

    def dropped(self, reason: str, count: int) -> None: ...


__all__ = ["BatcherObserver"]
