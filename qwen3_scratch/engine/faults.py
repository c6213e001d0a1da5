"""Where a fault inside one engine step stops: at the request that caused it, or at the engine.

A step does three kinds of work. Two of them touch only state that belongs to one request, so an
exception there can be pinned on a request and fail it alone (HTTP 500 for that client; the others
go on):
  - the forward passes: a decode batch or a prompt chunk that raises is run again one request at a
    time (`each_alone`); the requests that fail alone are failed, the others keep the logits of their
    solo run. Re-running is safe because a failed forward advanced nothing: `num_computed` moves and
    blocks are sealed only after the forward returned, so the retry rewrites the same cache slots;
  - sampling, appending the token and detokenizing (stop strings), per sequence.
The third, scheduling (the queues, the block pool, the prefix cache), is shared by every request: an
exception there means the engine's own bookkeeping can no longer be trusted, so it propagates and
the engine is dead (the server answers 503 and exits so that a supervisor restarts it).

One more way to die: if the forward fails for `MAX_FAILED_FORWARDS` requests in a row with no
success in between, the model or the device is broken rather than a request, and failing every
request one by one forever would only hide that (`ForwardHealth`).
"""

from collections.abc import Callable, Sequence
from dataclasses import dataclass

MAX_FAILED_FORWARDS = 8


class EngineDeadError(RuntimeError):
    """The engine cannot go on: every request in it, and every new one, must fail."""


@dataclass
class Failed:
    """The result slot of an item whose work raised when run alone."""

    error: BaseException


def each_alone(call: Callable[[list], list], items: Sequence) -> list:
    """call(items) -> one result per item. If that raises, each item is tried alone, so a fault stays
    with the item that causes it: the returned list then holds Failed(error) for each item that fails
    alone and its own result for every other."""
    try:
        return call(list(items))
    except Exception as error:
        if len(items) == 1:
            return [Failed(error)]
    results = []
    for item in items:
        try:
            results.append(call([item])[0])
        except Exception as error:
            results.append(Failed(error))
    return results


class ForwardHealth:
    """Counts forward passes that failed since the last one that worked."""

    def __init__(self, limit: int = MAX_FAILED_FORWARDS):
        self.limit, self.failed_in_a_row = limit, 0

    def record(self, results: list) -> None:
        failed = sum(isinstance(r, Failed) for r in results)
        if failed < len(results):
            self.failed_in_a_row = 0
            return
        self.failed_in_a_row += failed
        if self.failed_in_a_row >= self.limit:
            error = next(r.error for r in results if isinstance(r, Failed))
            raise EngineDeadError(
                f"the model's forward failed for {self.failed_in_a_row} requests in a row, none worked in between "
                f"(last: {type(error).__name__}: {error}); the model or the device is broken"
            ) from error
