"""The largest batch that trains within a memory cap, per system.

For each system, cells of one model run at growing batch sizes (doubling from the model's
own batch, then bisecting between the last batch that fit and the first that did not),
each in its own process for one warm-up and one timed step. A batch *fits* when the cell
ran and its peak resident set size (``ru_maxrss``: the whole process, libraries and the
model included) stayed within the cap. The cap is measured, not enforced, so a batch that
needs more memory than the machine has is never tried: the search stops at the first batch
over the cap.
"""

from __future__ import annotations

from collections.abc import Callable

MAX_DOUBLINGS = 6
BISECT_STEPS = 2


def largest_batch(run: Callable[[int], dict], start: int, cap_mb: float) -> dict:
    """Search the largest batch whose cell fits in ``cap_mb``; ``run(batch)`` returns a cell.

    Returns ``{"largest_batch": int | None, "peak_rss_mb": float | None, "tried": [...]}``,
    where ``tried`` lists ``{"batch", "peak_rss_mb", "status", "fits"}`` in the order tried.
    """
    tried: list[dict] = []

    def fits(batch: int) -> bool:
        cell = run(batch)
        ok = cell.get("status") == "ok" and cell.get("peak_rss_mb") is not None
        entry = {"batch": batch, "peak_rss_mb": cell.get("peak_rss_mb"), "status": cell.get("status"),
                 "fits": bool(ok and cell["peak_rss_mb"] <= cap_mb)}
        if cell.get("status") != "ok":
            entry["error"] = str(cell.get("error"))[:300]
        tried.append(entry)
        return entry["fits"]

    good, bad = None, None
    batch = start
    for _ in range(MAX_DOUBLINGS + 1):
        if fits(batch):
            good = batch
            batch *= 2
        else:
            bad = batch
            break
    if good is None:  # even the first batch is over the cap: look below it
        low = max(1, start // 2 ** MAX_DOUBLINGS)
        batch = start // 2
        while batch >= low and good is None:
            if fits(batch):
                good = batch
            else:
                bad = batch
                batch //= 2
    if good is not None and bad is not None:
        for _ in range(BISECT_STEPS):
            middle = (good + bad) // 2
            if middle in (good, bad):
                break
            if fits(middle):
                good = middle
            else:
                bad = middle
    best = next((t for t in tried if t["batch"] == good and t["fits"]), None)
    return {"largest_batch": good, "peak_rss_mb": best and best["peak_rss_mb"], "capped_by_search": bad is None,
            "tried": tried}
