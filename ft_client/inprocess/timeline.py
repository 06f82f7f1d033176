"""Where the time of an in-process restart went (pure: numbers in, numbers out).

Each rank stamps the wall-clock moment (``time.time()``) at which it ended each
phase of a restart (`events.Restart.times`). A job-wide phase ends when the
last rank has ended it, and never before the previous phase ended, so the
phases of `breakdown` follow each other without gap or overlap and add up to
the total: from the fault (or the monitor's hang verdict) to every rank making
progress again. Used by the Wrapper's log line, ft-launcher's summary rows and
bench/.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

FAULT = "fault"
"""When the fault was recorded in the store (the writer's clock)."""
PHASES: tuple[tuple[str, str], ...] = (
    ("notify", "seen"),            # the rank learned of the fault
    ("abort", "aborted"),          # its abort hook returned (collectives freed)
    ("interrupt", "left"),         # its main thread was out of the training function
    ("finalize", "finalized"),     # process groups released, finalize and health_check done
    ("barrier", "barrier"),        # every rank met at the restart barrier
    ("reinit", "pg_ready"),        # re-entered and init_process_group returned (CallWrapper's)
    ("first_step", "first_progress"),  # the first ping(), heartbeat or section after re-entry
)
POINTS = tuple(point for _, point in PHASES)


def breakdown(origin: float, ranks: Iterable[Mapping[str, float]]) -> dict[str, float | None]:
    """Phase durations (seconds, ms resolution) and ``total``, from ``origin`` (the fault
    or the verdict) over every rank's stamps. A rank without ``pg_ready`` (it did not
    use `CallWrapper.init_process_group`) counts from its re-entry (``entered``); a
    phase nobody stamped is None, and so is ``total`` until every rank made progress."""
    ranks = list(ranks)
    out: dict[str, float | None] = {}
    end = origin
    done = 0.0  # ms-rounded time from origin to the end of the last phase: the phases add up exactly
    for name, point in PHASES:
        stamps = [_stamp(r, point) for r in ranks]
        if not ranks or any(s is None for s in stamps):
            out[name] = None
            continue
        end = max(end, *(s for s in stamps if s is not None))
        now_done = round(end - origin, 3)
        out[name] = round(now_done - done, 3)
        done = now_done
    complete = bool(ranks) and all(_stamp(r, "first_progress") is not None for r in ranks)
    out["total"] = done if complete else None
    return out


def _stamp(times: Mapping[str, float], point: str) -> float | None:
    v = times.get(point)
    if v is None and point == "pg_ready":
        v = times.get("entered")
    return v


def describe(b: Mapping[str, float | None]) -> str:
    """``notify 0.012s, abort 0.001s, ...`` for a log line (phases not measured are left out)."""
    return ", ".join(f"{name} {b[name]:.3f}s" for name, _ in PHASES if b.get(name) is not None)
