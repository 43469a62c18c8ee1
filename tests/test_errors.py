"""One error tree: every error a user can cause says the CLI's exit code and the API's HTTP
status, and crosses process boundaries (Ray actors pickle it) intact."""

from __future__ import annotations

import pickle

import pytest

from failbench_ray import errors as e

CASES = [
    (e.SpecError("bad field", ("model", "depth")), 2, 422),
    (e.NotApplicableError("not applicable: no peer"), 2, 422),
    (e.UsageError("--world must be at least 2"), 2, 422),
    (e.ExperimentNotFound("ab12"), 2, 404),
    (e.ExperimentNotFound("ab", ambiguous=True), 2, 404),
    (e.SweepNotFound("s1"), 2, 404),
    (e.IdempotencyConflict("key names another spec"), 1, 409),
    (e.InvalidTransition("cannot cancel a completed experiment"), 1, 409),
    (e.DatabaseError("cannot open the database"), 2, 503),
    (e.ClusterError("the local Ray cluster advertises 192.0.2.2"), 2, 503),
    (e.RecoveryError("every holder died"), 1, 500),
    (e.TrialInterrupted("cancelled"), 130, 500),
]


@pytest.mark.parametrize(("err", "exit_code", "http_status"), CASES, ids=lambda c: str(c)[:30])
def test_each_error_says_its_exit_code_and_status_and_pickles(
    err: e.FailBenchError, exit_code: int, http_status: int
) -> None:
    assert isinstance(err, e.FailBenchError)
    assert (err.exit_code, err.http_status) == (exit_code, http_status)
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is type(err) and str(back) == str(err) and vars(back) == vars(err)


def test_messages_say_what_to_change() -> None:
    assert "give more of it" in str(e.ExperimentNotFound("ab", ambiguous=True))
    assert str(e.SweepNotFound("s1")) == "no sweep with id s1 in this database"
    # not found is still a LookupError, as it was before the tree
    assert isinstance(e.SweepNotFound("s1"), LookupError)


def test_a_spec_error_is_only_for_a_spec() -> None:
    """A busy port or a bad question is a usage error (exit 2, 422), not a spec error."""
    import socket

    from failbench_ray.recommend import Question, recommend
    from service import serve as service

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        with pytest.raises(e.UsageError, match="--port") as info:
            service._listen("127.0.0.1", busy.getsockname()[1])
    assert not isinstance(info.value, e.SpecError)
    with pytest.raises(e.UsageError, match="at least 2") as asked:
        recommend(Question(architecture="ddp", state_gb=1, world=1, mtbf_hours=10))
    assert not isinstance(asked.value, e.SpecError)
