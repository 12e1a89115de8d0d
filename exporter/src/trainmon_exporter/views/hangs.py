"""The merged view of a hung run: each distinct stack once, the ranks in it, the suspects first.

Every hung rank answered with its stacks and collective state (docs/hangs.md); a person paged
for a hang wants the one rank that is not where the others are. :func:`merged` groups a run's
ranks by their training thread's stack (file, line and function of every frame), says of each
stack how many ranks are in it and how many are not ("3 ranks in all_reduce, 1 not"), and
names the suspects with the rule the recording rules apply across nodes in Prometheus
(deploy/prometheus/trainmon.rules.yml):

- a rank whose last collective sequence id (started where the Flight Recorder tracks it, else
  enqueued) lags the largest of its process group among the ranks seen: it never joined the
  collective the others wait in;
- a rank whose frame (its training thread's innermost frame in the user's code, the label of
  ``trainmon_hang_frame_info``) differs from the one frame most ranks share; with no single
  such frame (two against two), no rank is named for its frame.

One exporter sees its own node's ranks: the status page merges in those of its
``status_peers`` and ``trainmon status`` those of every ``--url`` (:func:`merge_runs`), and the
ranks no one has seen are counted in each stack's "not". Used by the JSON API, the status page
and the terminal alike; it reads only the API's models.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from trainmon_exporter.views.api import (
    FrameView,
    HangView,
    RankView,
    RunHangView,
    RunsResponse,
    RunView,
    StackView,
)

__all__ = ["NO_ANSWER", "WAITING", "merge_runs", "merged", "suspects"]

NO_ANSWER = "(no answer)"
"""The function of the ranks that did not answer in time (the frame label says the same)."""
WAITING = "(asked)"
"""The function of the ranks asked whose answer has not come yet."""


def _joined(h: HangView) -> dict[str, int]:
    """Per process group, the last collective the rank joined: started, else enqueued."""
    out = {}
    for g in h.groups:
        seq = g.started if g.started >= 0 else g.enqueued
        if seq >= 0:
            out[g.id] = seq
    return out


def suspects(ranks: Sequence[RankView]) -> tuple[set[int], str | None]:
    """The ranks named as suspects, and the frame most ranks share (None: no single one).

    Over the ranks whose evidence is in (captured, or no answer), as the recording rules do.
    """
    known = [(r.rank, r.hang) for r in ranks if r.hang is not None and r.hang.status != "pending"]
    named: set[int] = set()
    frames = Counter(h.frame for _, h in known if h.frame)
    common = frames.most_common(2)
    shared = None
    if common and (len(common) == 1 or common[1][1] < common[0][1]):
        shared = common[0][0]
        named |= {rank for rank, h in known if h.frame and h.frame != shared}
    by_group: dict[str, dict[int, int]] = {}
    for rank, h in known:
        for group, seq in _joined(h).items():
            by_group.setdefault(group, {})[rank] = seq
    for seqs in by_group.values():
        top = max(seqs.values())
        named |= {rank for rank, seq in seqs.items() if seq < top}
    return named, shared


def _key(h: HangView) -> tuple[tuple[str, int, str], ...]:
    if h.status == "pending":
        return (("", 0, WAITING),)
    training = next((t for t in h.threads if t.training), None)
    if h.status == "no_answer" or training is None or not training.frames:
        return (("", 0, NO_ANSWER),)
    return tuple((f.file, f.line, f.function) for f in training.frames)


def _headline(function: str, n: int, not_in: int) -> str:
    ranks = f"{n} rank{'' if n == 1 else 's'}"
    if function == WAITING:
        return f"{ranks} asked, no answer yet"
    if function == NO_ANSWER:
        return f"{ranks} did not answer, {not_in} did or were not seen"
    return f"{ranks} in {function}, {not_in} not"


def merged(ranks: Sequence[RankView], world_size: int) -> RunHangView | None:
    """The merged view of ``ranks`` (one run's, from any exporters); None without evidence.

    ``world_size``: the run's, so that the ranks not seen count in each stack's "not".
    """
    with_hang = [(r, r.hang) for r in ranks if r.hang is not None]
    if not with_hang:
        return None
    world = max(world_size, len({r.rank for r, _ in with_hang}))
    named, shared = suspects(ranks)
    groups: dict[tuple[tuple[str, int, str], ...], list[tuple[RankView, HangView]]] = {}
    for r, h in with_hang:
        groups.setdefault(_key(h), []).append((r, h))
    stacks = []
    for key, members in groups.items():
        function = key[-1][2]
        rank_ids = sorted(r.rank for r, _ in members)
        waits = Counter(h.collective for _, h in members if h.collective).most_common(1)
        first = members[0][1]
        training = next((t for t in first.threads if t.training), None)
        frames: list[FrameView] = (
            [] if training is None or function in (NO_ANSWER, WAITING) else training.frames
        )
        stacks.append(
            StackView(
                headline=_headline(function, len(rank_ids), world - len(rank_ids)),
                ranks=rank_ids,
                not_in=world - len(rank_ids),
                function=function,
                frame=first.frame if function != WAITING else None,
                collective=waits[0][0] if waits else "",
                suspect=any(rank in named for rank in rank_ids),
                frames=frames,
            )
        )
    stacks.sort(key=lambda st: (not st.suspect, -len(st.ranks), st.ranks))
    waits = Counter(h.collective for _, h in with_hang if h.collective).most_common(1)
    hung = sum(1 for _, h in with_hang if h.hung)
    up = any(r.up for r, _ in with_hang)
    return RunHangView(
        state="hung" if hung else ("recovered" if up else "ended"),
        since=min(h.requested_at for _, h in with_hang),
        hung=hung,
        seen=len(with_hang),
        world_size=world,
        suspects=sorted(named),
        frame=shared,
        collective=waits[0][0] if waits else None,
        stacks=stacks,
    )


def merge_runs(
    responses: Sequence[RunsResponse], only: RunsResponse | None = None
) -> list[RunView]:
    """The runs with hang evidence, each with its ranks from every response and its merged view.

    A rank seen by two exporters (it moved) is taken from the one where it is connected, else
    the one asked last. ``only``: keep the runs that have ranks in it (the status page merges
    its peers' ranks into its own runs, never shows a peer's other runs).
    """
    keep = None if only is None else {(r.namespace, r.run) for r in only.runs}
    runs: dict[tuple[str, str], tuple[RunView, dict[int, RankView]]] = {}
    for response in responses:
        for run in response.runs:
            key = (run.namespace, run.run)
            if keep is not None and key not in keep:
                continue
            _, seen = runs.setdefault(key, (run, {}))
            for r in run.ranks:
                old = seen.get(r.rank)
                if old is None or _newer(r, old):
                    seen[r.rank] = r
    out = []
    for key in sorted(runs):
        first, by_rank = runs[key]
        ranks = [by_rank[k] for k in sorted(by_rank)]
        world = max([first.world_size, *(r.world_size for r in ranks)])
        view = merged(ranks, world)
        if view is not None:
            out.append(first.model_copy(update={"ranks": ranks, "hang": view, "world_size": world}))
    return out


def _newer(a: RankView, b: RankView) -> bool:
    """Whether ``a`` is the better view of a rank two exporters both hold than ``b``."""
    if a.up != b.up:
        return a.up
    ta = -1.0 if a.hang is None else a.hang.requested_at
    tb = -1.0 if b.hang is None else b.hang.requested_at
    return ta > tb


def _ago(seconds: float) -> str:
    s = max(0, int(seconds))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def gpu_words(r: RankView) -> str | None:
    """A hung rank's GPU when it answered, in words: power (of its limit), SM activity."""
    h = r.hang
    if h is None or (h.gpu_power_watts is None and h.gpu_sm_active_ratio is None):
        return None
    parts = []
    if h.gpu_power_watts is not None:
        limit = h.gpu_power_limit_watts
        parts.append(f"{h.gpu_power_watts:.0f} W" + (f" of {limit:.0f} W" if limit else ""))
    if h.gpu_sm_active_ratio is not None:
        parts.append(f"SM active {h.gpu_sm_active_ratio:.0%}")
    return ", ".join(parts)


def summary(run: RunView, now: float) -> str:
    """One line on a run's hang: how many ranks, since when, the suspects, the collective."""
    v = run.hang
    assert v is not None
    state = {"hung": "hung", "recovered": "recovered since", "ended": "ended since"}[v.state]
    head = f"{v.hung} of {v.world_size} ranks hung" if v.state == "hung" else state
    who = ", ".join(f"rank {s}" for s in v.suspects) if v.suspects else "none named"
    waits = f"; most wait in {v.collective}" if v.collective else ""
    return (
        f"{run.label}: {head} (asked {_ago(now - v.since)} ago, {v.seen} seen); "
        f"suspects: {who}{waits}"
    )


def text_lines(run: RunView, now: float, frames: int = 8) -> list[str]:
    """The merged view as plain lines (``trainmon status``): stacks, suspects' frames, GPUs.

    Each stack: its headline, its ranks, where they are and what they wait in; a suspect
    stack's innermost ``frames`` frames follow it, innermost first. Then each rank's GPU
    (power and SM activity when it answered) and what its capture could not say.
    """
    v = run.hang
    assert v is not None
    out = [summary(run, now)]
    for st in v.stacks:
        where = f" at {st.frame}" if st.frame and st.frame != NO_ANSWER else ""
        waits = f", waiting in {st.collective}" if st.collective else ""
        mark = "  SUSPECT" if st.suspect else ""
        ranks = ",".join(str(r) for r in st.ranks)
        out.append(f"  {st.headline}: ranks {ranks}{where}{waits}{mark}")
        if st.suspect:
            for f in list(reversed(st.frames))[:frames]:
                tag = "" if f.user else "  (library)"
                out.append(f"      {f.function} ({f.file}:{f.line}){tag}")
    for r in run.ranks:
        if r.hang is None:
            continue
        gpu = gpu_words(r)
        if gpu:
            out.append(f"  rank {r.rank} GPU when asked: {gpu}")
        for note in r.hang.notes:
            out.append(f"  rank {r.rank}: {note}")
    return out
