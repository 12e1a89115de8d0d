"""Owner claims: the reader's checks on real files, and the store's use of them.

The files are real (a private directory under /tmp, reached through the real / and /tmp);
the checks that need a file of another owner run as root.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from trainmon_exporter.claims import CLAIM_PROBLEMS, OwnerClaims
from trainmon_exporter.settings import Settings

from ..conftest import InProcessExporter, connect, sample, short_tmpdir, wait_for
from ..helpers.exporter import HELLO, store_of
from ..helpers.uids import ATTACKER, ATTACKER_GID, OWNER, OWNER_GID, User, run_as, shared_exporter
from ..helpers.uids import needs_root as needs_root_uids

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to chown files")
OTHER = 43003  # a uid that is neither root nor this process's


@pytest.fixture
def claims_dir() -> Iterator[Path]:
    d = short_tmpdir()
    os.chmod(d, 0o700)
    owners = d / "owners"
    owners.mkdir(mode=0o755)
    os.chmod(owners, 0o755)
    yield owners
    shutil.rmtree(d, ignore_errors=True)


def claim(directory: Path, run: str, text: str, mode: int = 0o644) -> Path:
    f = directory / run
    f.write_text(text)
    os.chmod(f, mode)
    return f


def problems(claims: OwnerClaims) -> dict[str, int]:
    return {k: v for k, v in claims.invalid.items() if v}


def test_a_claim_names_its_uid_and_absence_is_no_claim(claims_dir: Path) -> None:
    claims = OwnerClaims(claims_dir)
    claim(claims_dir, "slurm-42", "1234\n")
    claim(claims_dir, "slurm-43", "0")
    assert claims.lookup("slurm-42") == 1234
    assert claims.lookup("slurm-43") == 0
    assert claims.lookup("slurm-44") is None  # no file
    assert claims.lookup(".") is None and claims.lookup("..") is None
    assert OwnerClaims(claims_dir / "absent").lookup("slurm-42") is None
    assert OwnerClaims(None).lookup("slurm-42") is None
    assert problems(claims) == {}
    (claims_dir / "slurm-42").unlink()  # the epilog removed it: read fresh, so gone at once
    assert claims.lookup("slurm-42") is None
    with pytest.raises(ValueError, match="absolute"):
        OwnerClaims(Path("relative"))


def test_a_directory_replaced_or_made_unsafe_is_noticed(claims_dir: Path) -> None:
    """The directory's descriptor is kept between look-ups only while the path names it and
    it passes its checks."""
    claims = OwnerClaims(claims_dir)
    claim(claims_dir, "slurm-42", "1000")
    assert claims.lookup("slurm-42") == 1000
    claims_dir.rename(claims_dir.parent / "old")  # moved away, a new one in its place
    claims_dir.mkdir(mode=0o755)
    os.chmod(claims_dir, 0o755)
    claim(claims_dir, "slurm-42", "1001")
    assert claims.lookup("slurm-42") == 1001
    shutil.rmtree(claims_dir)  # gone: no claims
    assert claims.lookup("slurm-42") is None
    claims_dir.mkdir(mode=0o755)
    os.chmod(claims_dir, 0o755)
    claim(claims_dir, "slurm-42", "1002")
    assert claims.lookup("slurm-42") == 1002
    os.chmod(claims_dir, 0o777)  # the kept descriptor is checked again
    assert claims.lookup("slurm-42") is None
    assert problems(claims) == {"unsafe_dir": 1}


@pytest.mark.parametrize(
    "text",
    ["", "\n", "abc", "12 34", "-1", "+5", "1e3", "٣", "4294967295", "9" * 40, "1" + " " * 70],
)
def test_a_malformed_claim_is_ignored_and_counted(claims_dir: Path, text: str) -> None:
    claims = OwnerClaims(claims_dir)
    claim(claims_dir, "slurm-42", text)
    assert claims.lookup("slurm-42") is None
    assert problems(claims) == {"malformed": 1}


def test_symbolic_links_are_never_followed(claims_dir: Path) -> None:
    good = claim(claims_dir, "slurm-1", "1000")
    (claims_dir / "slurm-42").symlink_to(good)
    claims = OwnerClaims(claims_dir)
    assert claims.lookup("slurm-42") is None
    assert problems(claims) == {"unsafe_file": 1}
    link = claims_dir.parent / "link"
    link.symlink_to(claims_dir)
    via_link = OwnerClaims(link)
    assert via_link.lookup("slurm-1") is None
    assert problems(via_link) == {"unsafe_dir": 1}
    deeper = OwnerClaims(link / ".")  # a link on the path, not only at its end
    assert deeper.lookup("slurm-1") is None
    assert problems(deeper) == {"unsafe_dir": 1}


def test_a_claim_that_others_could_write_is_ignored(claims_dir: Path) -> None:
    claims = OwnerClaims(claims_dir)
    claim(claims_dir, "slurm-42", "1000", mode=0o666)
    claim(claims_dir, "slurm-43", "1000", mode=0o664)
    os.mkfifo(claims_dir / "slurm-44", 0o644)  # never blocks the reader (O_NONBLOCK)
    (claims_dir / "slurm-45").mkdir()
    assert [claims.lookup(f"slurm-{j}") for j in (42, 43, 44, 45)] == [None] * 4
    assert problems(claims) == {"unsafe_file": 4}
    claim(claims_dir, "slurm-46", "1000", mode=0o600)  # readable by its owner only: fine
    assert claims.lookup("slurm-46") == 1000


@pytest.mark.parametrize("mode", [0o775, 0o757, 0o1777])
def test_a_directory_that_others_could_write_is_ignored(claims_dir: Path, mode: int) -> None:
    """Sticky is not enough for the claims directory itself: anyone could add a claim."""
    claim(claims_dir, "slurm-42", "1000")
    os.chmod(claims_dir, mode)
    claims = OwnerClaims(claims_dir)
    assert claims.lookup("slurm-42") is None
    assert problems(claims) == {"unsafe_dir": 1}


def test_a_world_writable_directory_on_the_path_must_be_sticky(claims_dir: Path) -> None:
    """/tmp (sticky, root's) is on the fixture's path; a plain 0777 parent is not accepted."""
    claim(claims_dir, "slurm-42", "1000")
    os.chmod(claims_dir.parent, 0o777)
    claims = OwnerClaims(claims_dir)
    assert claims.lookup("slurm-42") is None
    assert problems(claims) == {"unsafe_dir": 1}
    os.chmod(claims_dir.parent, 0o1777)
    assert claims.lookup("slurm-42") == 1000


@needs_root
def test_a_claim_or_directory_of_another_user_is_ignored(claims_dir: Path) -> None:
    claims = OwnerClaims(claims_dir)
    f = claim(claims_dir, "slurm-42", "1000")
    os.chown(f, OTHER, OTHER)
    assert claims.lookup("slurm-42") is None
    assert problems(claims) == {"unsafe_file": 1}
    os.chown(f, 0, 0)
    assert claims.lookup("slurm-42") == 1000
    os.chown(claims_dir, OTHER, OTHER)  # its owner could replace any claim
    assert claims.lookup("slurm-42") is None
    assert problems(claims) == {"unsafe_file": 1, "unsafe_dir": 1}


def test_the_setting_is_absolute_or_off() -> None:
    assert Settings().owner_claims_dir == Path("/run/trainmon-owners")
    assert Settings(owner_claims_dir="").owner_claims_dir is None
    with pytest.raises(ValueError, match="absolute"):
        Settings(owner_claims_dir="owners")


def _hello(run: str, rank: int = 0) -> dict[str, Any]:
    return HELLO | {"run": run, "rank": rank, "local_rank": rank, "world_size": 4}


def test_a_claim_decides_the_owner_whoever_connects_first(claims_dir: Path) -> None:
    store = store_of()
    store.claims = OwnerClaims(claims_dir)
    claim(claims_dir, "slurm-42", "1000")
    assert store.attach(_hello("slurm-42"), uid=1001) == "not_owner"
    assert store.attach(_hello("slurm-42"), uid=0) == "not_owner"  # root is not special
    a = store.attach(_hello("slurm-42"), uid=1000)
    assert not isinstance(a, str) and a.owner_uid == 1000
    assert store.owner_of("slurm-42") == 1000
    # Unclaimed runs stay first come, first served.
    assert not isinstance(store.attach(_hello("free"), uid=1001), str)


def test_a_claim_written_after_a_squatter_connected_takes_the_run_back(
    claims_dir: Path,
) -> None:
    """A uid that opened the run before the prolog wrote its claim loses every rank of it
    when the claimed uid connects; its connections are marked to close."""
    store = store_of()
    store.claims = OwnerClaims(claims_dir)
    s0 = store.attach(_hello("slurm-42"), uid=1001)
    s1 = store.attach(_hello("slurm-42", 1), uid=1001)
    assert not isinstance(s0, str) and not isinstance(s1, str)
    s1.disconnect(finished=False)
    claim(claims_dir, "slurm-42", "1000")
    assert store.owner_of("slurm-42") == 1000
    assert store.attach(_hello("slurm-42", 2), uid=1001) == "not_owner"
    a = store.attach(_hello("slurm-42"), uid=1000)
    assert not isinstance(a, str) and a.owner_uid == 1000 and a is not s0
    assert s0.revoked and s1.revoked
    assert store.ranks[("slurm-42", 0)] is a and ("slurm-42", 1) not in store.ranks
    assert store.admission.tenant_ranks == {1000: 1}
    # The two revoked ranks; the refused HELLO is counted by the applier that gets not_owner.
    assert store.admission.hellos_refused == {("not_owner", "", "1001"): 2}
    # The claim removed (the job ended), the run stays its ranks' owner's, as without claims.
    (claims_dir / "slurm-42").unlink()
    assert store.attach(_hello("slurm-42", 1), uid=1001) == "not_owner"


def test_an_ignored_claim_leaves_the_run_first_come(claims_dir: Path) -> None:
    store = store_of()
    store.claims = OwnerClaims(claims_dir)
    claim(claims_dir, "slurm-42", "1000", mode=0o666)
    s = store.attach(_hello("slurm-42"), uid=1001)
    assert not isinstance(s, str) and s.owner_uid == 1001
    assert store.claims.invalid == dict.fromkeys(CLAIM_PROBLEMS, 0) | {"unsafe_file": 1}


# ---------------------------------------------------------------- real uids, real exporter

# Logs from step FIRST until the exporter refuses it (or 40 steps pass), then prints why.
UNTIL_REFUSED = """
for i in range(FIRST, 40):
    r.log(i, loss=9.9)
    time.sleep(0.05)
    if r.refused_reason:
        break
print(r.refused_reason, flush=True)
"""

SQUAT_42 = 'r = init("slurm-42")' + UNTIL_REFUSED.replace("FIRST", "1")

# Opens slurm-43 before its claim exists, then on its stdin logs again.
EARLY_43 = """
r = init("slurm-43")
r.log(1, loss=9.9)
print("logged", flush=True)
input()
""" + UNTIL_REFUSED.replace("FIRST", "2")


def _refused(ex: Any, uid: int) -> float:
    return (
        sample(
            ex.metrics(), "trainmon_ingest_hellos_refused_total", reason="not_owner", uid=str(uid)
        )
        or 0.0
    )


@needs_root_uids
def test_the_claimed_uid_owns_its_run_even_when_another_connects_first(
    make_exporter: Callable[..., InProcessExporter], claims_dir: Path
) -> None:
    """The prolog's claim names OWNER: ATTACKER, first on the socket (mode 0666), is refused
    not_owner; OWNER then writes the run."""
    claim(claims_dir, "slurm-42", f"{OWNER}\n")
    ex = shared_exporter(make_exporter, socket_mode="0666", owner_claims_dir=str(claims_dir))
    out = run_as(ex.socket, ATTACKER, ATTACKER_GID, SQUAT_42)
    assert out.strip() == "not_owner"
    assert ex.rank("slurm-42", 0) is None
    assert _refused(ex, ATTACKER) >= 1
    run_as(ex.socket, OWNER, OWNER_GID, 'r = init("slurm-42"); r.log(1, loss=2.5); r.finish()')
    r = wait_for(lambda: (k := ex.rank("slurm-42", 0)) and k["status"] == "finished" and k)
    assert r["values"]["loss"] == 2.5
    run = next(x for x in ex.runs()["runs"] if x["run"] == "slurm-42")
    assert run["owner_uid"] == OWNER
    assert _refused(ex, OWNER) == 0


@needs_root_uids
def test_a_run_opened_before_its_claim_goes_to_the_claimed_uid(
    make_exporter: Callable[..., InProcessExporter],
    claims_dir: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """ATTACKER opened slurm-43 before the prolog ran; once the claim names OWNER, OWNER's
    HELLO takes the run and ATTACKER's connection is closed with not_owner."""
    ex = shared_exporter(make_exporter, socket_mode="0666", owner_claims_dir=str(claims_dir))
    early = User(ex.socket, ATTACKER, ATTACKER_GID, EARLY_43)
    assert early.proc.stdout is not None
    assert early.proc.stdout.readline().strip() == "logged"
    wait_for(lambda: (k := ex.rank("slurm-43", 0)) and k["step"] == 1)
    claim(claims_dir, "slurm-43", str(OWNER))
    run_as(ex.socket, OWNER, OWNER_GID, 'r = init("slurm-43"); r.log(1, loss=2.5); r.finish()')
    r = wait_for(lambda: (k := ex.rank("slurm-43", 0)) and k["status"] == "finished" and k)
    assert r["values"]["loss"] == 2.5
    assert f"ranks uid {ATTACKER} opened before it were dropped" in caplog.text
    early.say()
    rc, out, err = early.wait()
    assert rc == 0, err
    assert out.splitlines()[-1] == "not_owner"
    r = ex.rank("slurm-43", 0)
    assert r is not None and r["values"]["loss"] == 2.5 and r["status"] == "finished"
    assert _refused(ex, ATTACKER) >= 1


def test_ignored_claims_are_exported_by_problem(
    make_exporter: Callable[..., InProcessExporter], claims_dir: Path
) -> None:
    claim(claims_dir, "bad", "not a uid")
    ex = make_exporter(owner_claims_dir=str(claims_dir))
    trainer = connect(ex, "bad")
    trainer.log(1, loss=1.0)
    trainer.finish()
    wait_for(lambda: (k := ex.rank("bad", 0)) and k["status"] == "finished")
    m = ex.metrics()
    assert sample(m, "trainmon_owner_claims_invalid_total", problem="malformed") == 1
    assert sample(m, "trainmon_owner_claims_invalid_total", problem="unsafe_file") == 0
