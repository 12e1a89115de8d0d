"""One merged view per hung run: each distinct stack once, with its ranks, suspects first.

Built from the API's models (by hand, tests/helpers/views.py), as the status page and
``trainmon status`` get them; merged across exporters as a multi-node job needs it.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from trainmon_exporter.views import hangs
from trainmon_exporter.views.api import RunsResponse
from trainmon_exporter.views.html import StatusPage, render_status
from trainmon_exporter.views.remote import PLAIN, with_peers
from trainmon_exporter.views.terminal import plain

from ...helpers import views as v


def four_ranks() -> list[Any]:
    """Rank 2 stuck in its data loader; ranks 0, 1 and 3 wait in the all-reduce after it."""
    return [
        v.rank(r, world_size=4, hang=v.hang(v.IN_LOADER if r == 2 else None, 12 if r != 2 else 11))
        for r in range(4)
    ]


def test_three_in_all_reduce_one_not_and_the_one_is_the_suspect() -> None:
    view = hangs.merged(four_ranks(), 4)
    assert view is not None
    assert view.suspects == [2] and view.state == "hung" and view.hung == 4
    assert view.frame == "train (train.py:61)" and view.collective == "gloo:all_reduce"
    first, second = view.stacks
    assert first.suspect and first.ranks == [2]
    assert first.headline == "1 rank in load_batch, 3 not"
    assert first.frame == "load_batch (train.py:57)" and first.collective == ""
    assert not second.suspect and second.ranks == [0, 1, 3]
    assert second.headline == "3 ranks in all_reduce, 1 not"
    assert second.collective == "gloo:all_reduce"
    assert [f.function for f in second.frames][-1] == "all_reduce"


def test_either_rule_names_a_suspect_and_neither_names_the_others() -> None:
    # Only the sequence ids tell: rank 1 never enqueued the collective the others wait in,
    # though it sits on the same line (a rank that skipped it, then hit the next one).
    lagging = [
        v.rank(r, world_size=3, hang=v.hang(enqueued=12 if r != 1 else 11)) for r in range(3)
    ]
    assert hangs.suspects(lagging) == ({1}, "train (train.py:61)")
    # Only the frame tells: no collective state (torch.distributed not in use).
    frames = [v.IN_LOADER if r == 0 else None for r in range(3)]
    alone = [v.rank(r, world_size=3, hang=v.hang(frames[r], groups=[])) for r in range(3)]
    assert hangs.suspects(alone)[0] == {0}
    # Two against two: no frame most ranks share, so no one is named for a frame.
    split = [v.rank(r, hang=v.hang(v.IN_LOADER if r < 2 else None, 12)) for r in range(4)]
    assert hangs.suspects(split) == (set(), None)


def test_a_rank_that_did_not_answer_is_named_and_says_why() -> None:
    ranks = [
        *four_ranks()[:3],
        v.rank(3, world_size=4, hang=v.hang(status="no_answer", notes=["no answer within 10 s"])),
    ]
    view = hangs.merged(ranks, 4)
    assert view is not None and view.suspects == [2, 3]
    heads = [s.headline for s in view.stacks]
    assert heads == [
        "1 rank in load_batch, 3 not",
        "1 rank did not answer, 3 did or were not seen",
        "2 ranks in all_reduce, 2 not",
    ]
    (run,) = hangs.merge_runs([v.runs(*ranks)])
    text = "\n".join(hangs.text_lines(run, v.T))
    assert "rank 3: no answer within 10 s" in text


def test_a_hung_ranks_gpu_is_its_power_and_sm_activity_not_its_utilisation() -> None:
    ranks = four_ranks()
    stuck = ranks[2].hang
    assert stuck is not None
    gpu = {"gpu_power_watts": 85.4, "gpu_power_limit_watts": 700.0, "gpu_sm_active_ratio": 0.02}
    ranks[2] = ranks[2].model_copy(update={"hang": stuck.model_copy(update=gpu)})
    (run,) = hangs.merge_runs([v.runs(*ranks)])
    lines = hangs.text_lines(run, v.T)
    assert "  rank 2 GPU when asked: 85 W of 700 W, SM active 2%" in lines
    assert sum("GPU when asked" in ln for ln in lines) == 1  # the others were not read


def test_pending_answers_are_not_judged_yet() -> None:
    ranks = [*four_ranks()[:3], v.rank(3, world_size=4, hang=v.hang(status="pending"))]
    view = hangs.merged(ranks, 4)
    assert view is not None and view.suspects == [2]
    assert "1 rank asked, no answer yet" in [s.headline for s in view.stacks]


def test_the_view_outlives_the_hang_until_the_ranks_expire() -> None:
    ranks = [
        r.model_copy(update={"hang": r.hang.model_copy(update={"hung": False})})
        for r in four_ranks()
    ]
    view = hangs.merged(ranks, 4)
    assert view is not None and view.state == "recovered" and view.suspects == [2]
    ended = [r.model_copy(update={"up": False, "status": "crashed"}) for r in ranks]
    assert hangs.merged(ended, 4).state == "ended"  # type: ignore[union-attr]
    assert hangs.merged([v.rank(0)], 8) is None  # no evidence, no view


def two_nodes() -> tuple[RunsResponse, RunsResponse]:
    ranks = four_ranks()
    return v.runs(ranks[0], ranks[1]), v.runs(ranks[2], ranks[3])


def test_two_exporters_make_one_view_of_the_run() -> None:
    a, b = two_nodes()
    only_a = hangs.merged(a.runs[0].ranks, 4)
    assert only_a is not None and only_a.suspects == []  # node A alone sees no suspect
    assert [s.headline for s in only_a.stacks] == ["2 ranks in all_reduce, 2 not"]
    (run,) = hangs.merge_runs([a, b])
    assert run.hang is not None and run.hang.suspects == [2]
    assert [s.headline for s in run.hang.stacks] == [
        "1 rank in load_batch, 3 not",
        "3 ranks in all_reduce, 1 not",
    ]
    # A peer's other runs are never shown; a rank two exporters hold is taken where it runs.
    other = v.runs(v.rank(0, hang=v.hang()), run="someone-else")
    moved = v.runs(a.runs[0].ranks[0].model_copy(update={"up": False}))
    (only,) = hangs.merge_runs([a, b, other, moved], only=a)
    assert only.run == a.runs[0].run and [r.up for r in only.ranks] == [True] * 4


def test_trainmon_status_once_prints_the_merged_view_of_every_url() -> None:
    a, b = two_nodes()
    text = plain(a, v.no_gpus(), [(b, v.no_gpus())])
    hangs_section = text[text.index("# hangs") :]
    assert "gpt2-medium-finetune: 4 of 4 ranks hung" in hangs_section
    assert "suspects: rank 2; most wait in gloo:all_reduce" in hangs_section
    lines = hangs_section.splitlines()
    suspect = next(i for i, ln in enumerate(lines) if "1 rank in load_batch, 3 not" in ln)
    assert lines[suspect].endswith("SUSPECT")
    assert lines[suspect + 1].strip() == "load_batch (/job/train.py:57)"  # innermost first
    three = "3 ranks in all_reduce, 1 not: ranks 0,1,3 at train (train.py:61)"
    assert f"{three}, waiting in gloo:all_reduce" in text
    assert "# hangs" not in plain(v.runs(v.rank(0)), v.no_gpus())  # no evidence: no section


def test_the_status_page_shows_the_stacks_escaped() -> None:
    a, b = two_nodes()
    evil = v.rank(
        2,
        world_size=4,
        hang=v.hang(
            [*v.LOOP[:1], v.FrameView(file="/job/<x>.py", line=1, function="<script>", user=True)],
            11,
        ),
    )
    b = v.runs(evil, b.runs[0].ranks[1])
    page = StatusPage(
        runs=a,
        gpus=v.no_gpus(),
        socket="/run/trainmon/trainmon.sock",
        socket_problem=None,
        collectors={},
        gpu_state=None,
        hangs=hangs.merge_runs([a, b]),
    )
    html = render_status(page)
    assert "3 ranks in all_reduce, 1 not" in html and "1 rank in &lt;script&gt;, 3 not" in html
    assert "<script>" not in html
    assert html.index("suspect</b>") < html.index("3 ranks in all_reduce")


class _Peer:
    """A peer exporter's /api/v1/runs, served over real HTTP on loopback."""

    def __init__(self, body: RunsResponse) -> None:
        raw = body.model_dump_json().encode()

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                self.send_response(200 if self.path == "/api/v1/runs" else 404)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                self.wfile.write(raw)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_the_status_page_reads_its_peers_only_for_a_run_hung_here() -> None:
    a, b = two_nodes()
    local = RunsResponse(
        time=a.time, runs=[a.runs[0].model_copy(update={"hang": hangs.merged(a.runs[0].ranks, 4)})]
    )
    peer = _Peer(b)
    try:
        runs, problems = with_peers(local, [peer.url, "http://127.0.0.1:9"], PLAIN, timeout=2)
        assert [s.headline for s in runs[0].hang.stacks] == [  # type: ignore[union-attr]
            "1 rank in load_batch, 3 not",
            "3 ranks in all_reduce, 1 not",
        ]
        assert len(problems) == 1 and "status peer http://127.0.0.1:9" in problems[0]
        calm = RunsResponse(time=a.time, runs=[v.runs(v.rank(0)).runs[0]])
        assert with_peers(calm, [peer.url], PLAIN) == ([], [])  # nothing hung here: not read
    finally:
        peer.close()
    assert json.loads(runs[0].model_dump_json())["hang"]["suspects"] == [2]
