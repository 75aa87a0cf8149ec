"""Find the request(s) whose presence makes an engine step raise, so that a step error fails only them.

Contract of `isolate(step, suspects, take_out, put_back)`, called right after `step()` raised:

- `step()` runs one engine step. The engine guarantees (rose.engine.engine.Engine.step) that a step which raises
  leaves every request as it was, so it may be called again.
- `suspects`: the ids of the requests that can be taken out of the engine and put back *without loss*: those that
  have not produced a token yet (nothing was emitted, so re-adding them from the job's arguments restarts them
  exactly). Newest first. Requests that already produced tokens are never taken out: they passed earlier steps,
  and taking them out would lose their progress.
- `take_out(id)` removes a request from the engine (abort); `put_back(id)` adds it again, as it was first added.

What it does: take every suspect out and run the step again. If it still raises, the fault lies with the others
(or the engine itself): `Isolation.error` is that exception, the suspects are back in the engine, and the caller
fails the requests that were not suspects (as a step error always did). If it passes, put the suspects back by
halves: a half that lets every one of its requests produce a token (or finish) is innocent; a half under which a
step raises is taken out again and split, down to single requests. A single request under which a step raises is
a culprit: it stays out of the engine, and `Isolation.culprits` maps it to the exception. A transient error (one
that does not come back) blames nobody.

Every step that passes here is a real step: `Isolation.outputs` holds their outputs, in order, for the caller to
handle as it handles any step's. It never raises what `step` raises; `take_out` / `put_back` errors propagate.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

TRIAL_STEPS = 32  # steps a put-back half gets to produce its first tokens (a long prompt prefills in chunks)


@dataclass
class Isolation:
    outputs: list[Any] = field(default_factory=list)  # the StepOutputs of the steps that passed, in order
    culprits: dict[str, BaseException] = field(default_factory=dict)  # taken out for good, with their error
    error: BaseException | None = None  # the step raised with every suspect out: the fault is elsewhere


def isolate(
    step: Callable[[], list[Any]],
    suspects: Sequence[str],
    take_out: Callable[[str], Any],
    put_back: Callable[[str], Any],
    trial_steps: int = TRIAL_STEPS,
) -> Isolation:
    result = Isolation()
    suspects = list(suspects)
    for rid in suspects:
        take_out(rid)
    try:
        result.outputs.extend(step())
    except Exception as exc:
        for rid in suspects:
            put_back(rid)
        result.error = exc
        return result
    pending: list[tuple[list[str], BaseException | None]] = [(suspects, None)]
    while pending:
        group, error = pending.pop()
        if len(group) == 1 and error is not None:
            result.culprits[group[0]] = error
            continue
        halves = [group] if error is None else [group[: len(group) // 2], group[len(group) // 2 :]]
        for half in halves:
            if half:
                unproven, exc = _trial(step, half, take_out, put_back, trial_steps, result.outputs)
                if exc is not None:
                    pending.append((unproven, exc))
    if result.culprits:
        log.warning("engine step error isolated to %s", ", ".join(result.culprits))
    return result


def _trial(
    step: Callable[[], list[Any]],
    group: list[str],
    take_out: Callable[[str], Any],
    put_back: Callable[[str], Any],
    max_steps: int,
    outputs: list[Any],
) -> tuple[list[str], BaseException | None]:
    """Put `group` back and step until each of it produced a token. On a step error, take out again those that had
    not (the rest are proven innocent) and return them with the error."""
    for rid in group:
        put_back(rid)
    unproven = list(group)
    for _ in range(max_steps):
        try:
            outs = step()
        except Exception as exc:
            for rid in unproven:
                take_out(rid)
            return unproven, exc
        outputs.extend(outs)
        progressed = {o.request_id for o in outs if o.new_token_ids or o.finished}
        unproven = [rid for rid in unproven if rid not in progressed]
        if not unproven:
            break
    # still prefilling or waiting after max_steps: left in the engine, they are suspects again at the next error
    return [], None
