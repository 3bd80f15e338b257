"""RidLedger: an abort that overtakes its request ends it on arrival; an abort for a rid that just ended
is dropped (a reused rid starts clean); both memories stay bounded, and an early abort expires."""

from runtime.managers.rid_ledger import RidLedger


def test_abort_before_arrival_ends_the_request_once():
    ledger = RidLedger()
    ledger.abort_unknown("a")
    assert ledger.arrived("a") is True
    assert ledger.arrived("a") is False  # spent


def test_abort_after_the_end_does_not_reach_a_reused_rid():
    ledger = RidLedger()
    ledger.finished("a")
    ledger.abort_unknown("a")
    assert ledger.arrived("a") is False
    ledger.abort_unknown("a")  # the rid is live again (arrived), so a new abort for it counts
    assert ledger.arrived("a") is True


def test_a_refused_request_spends_its_early_abort():
    ledger = RidLedger()
    ledger.abort_unknown("a")
    ledger.refused("a")
    assert ledger.arrived("a") is False


def test_memories_are_bounded_oldest_first():
    ledger = RidLedger(capacity=3)
    for rid in "abcd":
        ledger.abort_unknown(rid)
    assert ledger.arrived("a") is False and ledger.arrived("d") is True
    for rid in "wxyz":
        ledger.finished(rid)
    ledger.abort_unknown("w")  # forgotten as finished: remembered as an early abort
    assert ledger.arrived("w") is True


def test_an_early_abort_is_forgotten_after_its_ttl():
    """A stray abort (an id nobody used yet) must not end whichever request takes that id much later."""
    from runtime.managers.rid_ledger import EARLY_ABORT_TTL_S

    now = [0.0]
    ledger = RidLedger(clock=lambda: now[0])
    ledger.abort_unknown("a")
    ledger.abort_unknown("b")
    now[0] = EARLY_ABORT_TTL_S - 1
    assert ledger.arrived("a") is True  # overtook its request: still ends it
    now[0] = EARLY_ABORT_TTL_S + 1
    assert ledger.arrived("b") is False
