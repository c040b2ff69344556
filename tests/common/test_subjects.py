"""Subject names: the rlfleet.<cluster>.<tier>.<verb> scheme and its validation."""

from __future__ import annotations

import pytest

from rlfleet.common.control import transport as subjects
from rlfleet.common.control.transport import check_subject, tier_of


def test_subject_layout() -> None:
    assert subjects.subject("prod", "rollout", "generate") == "rlfleet.prod.rollout.generate"
    assert subjects.worker_subject("c1", "reward", "w-7") == "rlfleet.c1.reward.worker.w-7"
    assert subjects.membership_subject("c1", "reward") == "rlfleet.c1.reward.membership"
    assert subjects.ping_subject("c1") == "rlfleet.c1.controller.ping"


@pytest.mark.parametrize("verb", ["*", ">", "worker.r1", "a.b.c"])
def test_verbs_may_be_wildcards_or_dotted(verb: str) -> None:
    assert subjects.subject("c", "trainer", verb).endswith(f".trainer.{verb}")


@pytest.mark.parametrize(
    ("cluster", "tier", "verb", "fragment"),
    [
        ("a.b", "rollout", "x", "cluster"),
        ("", "rollout", "x", "cluster"),
        ("c", "roll out", "x", "tier"),
        ("c", "*", "x", "tier"),
        ("c", "rollout", "", "verb"),
        ("c", "rollout", "a..b", "verb"),
        ("c", "rollout", "a.*", "verb"),
    ],
)
def test_bad_tokens_are_refused_by_name(cluster: str, tier: str, verb: str, fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment):
        subjects.subject(cluster, tier, verb)


def test_tier_of_reads_the_tier_token() -> None:
    assert tier_of(subjects.subject("c", "reward", "score")) == "reward"
    assert tier_of("other.subject") == ""


@pytest.mark.parametrize("good", ["a", "a.b.c", "_INBOX.x-1"])
def test_check_subject_accepts_plain_subjects(good: str) -> None:
    check_subject(good, wildcards=False)


@pytest.mark.parametrize("bad", ["", "a..b", "a.*", "a.>", "a b", ".a", "a."])
def test_check_subject_refuses_bad_send_subjects(bad: str) -> None:
    with pytest.raises(ValueError, match="subject"):
        check_subject(bad, wildcards=False)


def test_check_subject_wildcards_only_where_allowed() -> None:
    check_subject("a.*.c", wildcards=True)
    check_subject("a.>", wildcards=True)
    with pytest.raises(ValueError):
        check_subject("a.>.c", wildcards=True)
    with pytest.raises(ValueError):
        check_subject("a.b*", wildcards=True)
