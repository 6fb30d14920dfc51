"""Workers on one machine sharing its cores (`worker.core_share`): an engine takes its burst
count only while every other member is idle, gets its base count back between layers when
one starts computing, and a killed member's last state is cleared by the next one to join.
Members are real processes: a slot is held by a lock the kernel drops when its holder dies."""
from __future__ import annotations

import subprocess
import sys

import pytest

from pdserve.worker.core_share import NUM_SLOTS, CoreShare

MEMBER = """
import sys
from pdserve.worker.core_share import CoreShare
share = CoreShare(sys.argv[1], 1, 2)
print("slot", share.slot, flush=True)
for line in sys.stdin:
    share.step_threads(forward=line.strip() == "compute")
    print("done", flush=True)
"""


class Member:
    """Another worker's share, in a process of its own, told to compute or idle."""

    def __init__(self, path) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", MEMBER, str(path)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        self.slot = int(self._answer().split()[1])

    def _answer(self) -> str:
        line = self.proc.stdout.readline()  # the child answers at once or dies (EOF)
        assert line, f"member exited with {self.proc.wait(10)}"
        return line

    def tell(self, what: str) -> None:
        self.proc.stdin.write(what + "\n")
        self.proc.stdin.flush()
        assert self._answer().strip() == "done"

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(10)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(10)


@pytest.fixture
def members(tmp_path):
    made: list[Member] = []

    def make() -> Member:
        made.append(Member(tmp_path / "share"))
        return made[-1]

    yield make
    for m in made:
        m.close()


def test_an_engine_bursts_only_while_every_other_member_is_idle(tmp_path, members):
    share = CoreShare(tmp_path / "share", base=1, burst=2)
    try:
        other = members()
        assert other.slot != share.slot
        assert share.step_threads(forward=True) == 2  # the other is idle
        assert share.layer_threads() is None  # keep it
        other.tell("compute")
        assert share.layer_threads() == 1  # back to the base count at the next layer
        assert share.step_threads(forward=True) == 1
        other.tell("idle")
        assert share.step_threads(forward=True) == 2
        assert share.step_threads(forward=False) == 1  # nothing to compute: the base count
    finally:
        share.close()
    assert (tmp_path / "share").read_bytes() == bytes(NUM_SLOTS)  # every member idle, none computing


def test_a_member_that_computes_holds_the_others_to_their_base_count_until_it_is_idle(tmp_path, members):
    share = CoreShare(tmp_path / "share", base=1, burst=2)
    try:
        share.step_threads(forward=True)
        other = members()
        other.tell("compute")
        assert not share.others_idle()
        other.tell("compute")  # telling it again changes nothing
        assert share.step_threads(forward=True) == 1
        other.tell("idle")
        assert share.others_idle()
    finally:
        share.close()


def test_a_killed_members_state_is_cleared_by_the_next_member_to_join(tmp_path, members):
    share = CoreShare(tmp_path / "share", base=1, burst=2)
    try:
        dead = members()
        dead.tell("compute")
        dead.kill()  # its byte still says computing
        assert share.step_threads(forward=True) == 1
        restarted = members()  # `up` restarts it: joining clears every slot nobody holds
        assert share.step_threads(forward=True) == 2
        restarted.tell("compute")
        assert share.step_threads(forward=True) == 1
    finally:
        share.close()


def test_a_share_refuses_a_burst_below_its_base():
    with pytest.raises(ValueError, match="base"):
        CoreShare("/nonexistent/share", base=2, burst=1)
