"""The tests' fork server (``tests/workers/launch_server.py``, behind ``dist_utils.run_torchrun``) launches as
torchrun does: every rank a real process in one gloo group with a worker's environment, the script as
``__main__``; one rank failing stops the others and fails the launch with the exit codes; a launch past its
timeout is killed and the next launch still runs. Each behaviour is compared with torchrun itself where torchrun
shows it too."""
import pytest

from dist_utils import WORKERS, run_torchrun

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

PROBE = WORKERS / "launch_probe_worker.py"


def rank_lines(stdout: str) -> list:
    return sorted(line for line in stdout.splitlines() if line.startswith("rank "))


@pytest.mark.timeout(300)
def test_ranks_join_one_gloo_group_with_a_workers_environment_as_under_torchrun():
    served = rank_lines(run_torchrun(PROBE, "--sum", nproc=3, timeout=120).stdout)
    real = rank_lines(run_torchrun(PROBE, "--sum", nproc=3, timeout=120, real_torchrun=True).stdout)
    assert served == real == [f"rank {r}/3 local {r} of 3 sum 6 main __main__ argv ['--sum']" for r in range(3)]


@pytest.mark.timeout(300)
def test_one_rank_failing_stops_the_others_and_fails_the_launch():
    with pytest.raises(AssertionError) as failure:  # rank 0 would wait 600 s: a launch not stopped times out
        run_torchrun(PROBE, "--fail-rank", "1", "--code", "3", nproc=2, timeout=240)
    text = str(failure.value)
    assert text.startswith("torchrun failed") and "rank 1 exits 3" in text
    assert "rank exit codes [-15, 3]" in text  # rank 0 stopped (SIGTERM), rank 1's own code


@pytest.mark.timeout(300)
def test_a_launch_past_its_timeout_is_killed_and_the_next_one_runs():
    with pytest.raises(AssertionError, match="timed out after 5s"):
        run_torchrun(PROBE, "--hang", nproc=2, timeout=5)
    assert len(rank_lines(run_torchrun(PROBE, "--sum", nproc=2, timeout=120).stdout)) == 2
