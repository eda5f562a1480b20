# SPDX-License-Identifier: Apache-2.0
"""How often the scheduler adapter asks the manager, per request and step, on vLLM's
own Scheduler (issue 51, deliverable 3): at most 2 calls on the step a request
loads, at most 1 on a step it waits (for its children), counted by a proxy around
the manager that counts every method call and attribute read."""

from __future__ import annotations

from collections import Counter

from tests.unit.v1.core.hook_transcript import (
    SchedulerShape,
    Transcript,
    make_scheduler,
)
from tests.unit.v1.core.test_chunk_hook_transcript import D1, D2, SYS, add, q

HOOKS = ("get_num_new_matched_tokens", "get_prefill_gap", "update_state_after_alloc")


class CountingProxy:
    """The manager, with every access counted by name while `counting` is set."""

    def __init__(self, manager):
        object.__setattr__(self, "_manager", manager)
        object.__setattr__(self, "calls", Counter())
        object.__setattr__(self, "counting", False)

    def __setattr__(self, name, value):
        object.__setattr__(self, name, value)

    def __getattr__(self, name):
        if self.counting:
            self.calls[name] += 1
        return getattr(self._manager, name)


def counted_step(t: Transcript, rid: str) -> Counter:
    """The adapter's accesses to the manager in one step, within the three
    per-request scheduling hooks called for `rid` and in build_connector_meta."""
    connector = t.connector
    adapter = connector._scheduler
    proxy = CountingProxy(adapter.manager)
    originals = {
        hook: getattr(connector, hook) for hook in HOOKS + ("build_connector_meta",)
    }

    def counted(hook):
        def call(*args):
            mine = hook == "build_connector_meta" or args[0].request_id == rid
            proxy.counting = mine
            try:
                return originals[hook](*args)
            finally:
                proxy.counting = False

        return call

    adapter.manager = proxy
    for hook in originals:
        setattr(connector, hook, counted(hook))
    try:
        t.step()
    finally:
        adapter.manager = proxy._manager
        for hook, fn in originals.items():
            setattr(connector, hook, fn)
    return proxy.calls


def test_a_loading_step_asks_twice_and_a_waiting_step_once(monkeypatch):
    t = Transcript(make_scheduler(SchedulerShape(), monkeypatch))
    add(t, "a", SYS, D1, q(0))
    t.step()  # a is admitted; its children are made
    waiting = counted_step(t, "a")  # the children run; a waits for them
    assert list(t.scheduler.requests) == ["a"]
    loading = counted_step(t, "a")  # a loads and computes its question
    assert not t.scheduler.requests
    print("waiting step:", dict(waiting), sum(waiting.values()))
    print("loading step:", dict(loading), sum(loading.values()))
    assert sum(waiting.values()) <= 1, waiting
    assert sum(loading.values()) <= 2, loading


def test_a_warm_request_loading_two_documents_with_boundary_recompute(monkeypatch):
    t = Transcript(make_scheduler(SchedulerShape(recompute=2), monkeypatch))
    add(t, "a", SYS, D1, D2, q(0))
    for _ in range(3):
        t.step()
    assert not t.scheduler.requests
    add(t, "b", SYS, D2, D1, q(1))
    loading = counted_step(t, "b")
    assert not t.scheduler.requests
    print("warm loading step:", dict(loading), sum(loading.values()))
    assert sum(loading.values()) <= 2, loading
