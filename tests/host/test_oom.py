"""How far a resumed job cuts its batch after the kernel's OOM killer ended one of its runs."""
from pathlib import Path

from batchrun.host import batch_cap_after_oom, killed_by_oom


def cgroup_with_kills(directory: Path, kills: int) -> str:
    directory.mkdir(exist_ok=True)
    (directory / "memory.oom_control").write_text(f"oom_kill_disable 0\nunder_oom 0\noom_kill {kills}\n")
    return str(directory)


def run(run_no, batch, end_state, cgroup, kills_at_start):
    return {"run_no": run_no, "pid": 100 + run_no, "batch_size": batch, "end_state": end_state,
            "memory_cgroup": cgroup, "oom_kills_at_start": kills_at_start}


def test_the_halved_batch_outlives_a_resume_that_was_itself_stopped(tmp_path):
    cgroup = cgroup_with_kills(tmp_path / "cg", kills=1)
    killed = run(1, 64, "died", cgroup, 0)  # the counter went 0 -> 1 before run 2 started
    stopped = run(2, 32, "interrupted", cgroup, 1)  # Ctrl-C: no kill since it started
    assert killed_by_oom(killed, stopped) and not killed_by_oom(stopped)
    assert batch_cap_after_oom([killed, stopped]) == (32, killed)


def test_two_kills_keep_the_smaller_cap(tmp_path):
    cgroup = cgroup_with_kills(tmp_path / "cg", kills=2)
    runs = [run(1, 64, "died", cgroup, 0), run(2, 32, "died", cgroup, 1)]
    assert batch_cap_after_oom(runs) == (16, runs[1])


def test_no_cap_without_a_kill_or_when_counters_cannot_be_compared(tmp_path):
    quiet = cgroup_with_kills(tmp_path / "quiet", kills=3)
    assert batch_cap_after_oom([run(1, 64, "died", quiet, 3), run(2, 64, "failed", quiet, 3)]) is None
    assert batch_cap_after_oom([run(1, 64, "done", quiet, 0)]) is None  # finished runs were not killed
    elsewhere = cgroup_with_kills(tmp_path / "other", kills=9)
    # run 1's counter is in another cgroup than run 2's: no evidence either way
    assert batch_cap_after_oom([run(1, 64, "died", quiet, 0), run(2, 64, "died", elsewhere, 9)]) is None
    assert batch_cap_after_oom([]) is None


def test_a_run_stopped_by_a_signal_it_handled_was_not_killed_for_memory(tmp_path):
    """Ctrl-C or SIGTERM mark the run interrupted: another process's OOM kill in the same cgroup meanwhile (a busy
    desktop session) must not halve this job's batch for good."""
    busy = cgroup_with_kills(tmp_path / "cg", kills=5)
    assert not killed_by_oom(run(1, 64, "interrupted", busy, 0))
    assert killed_by_oom(run(1, 64, "died", busy, 0))
