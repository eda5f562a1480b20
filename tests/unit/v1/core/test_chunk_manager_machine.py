# SPDX-License-Identifier: Apache-2.0
"""The manager's pins and held blocks under random admissions, children, store
fetches (ok, failed, failed with rows lent, rows returned or written off at the
held limit on a step), releases and resets
(issue 51, deliverable 1).

The model is the test's own record of who is live: admitted parents (each with
the distinct keys its admission named), writers (children and fetches handed out,
by key), failed fetches waiting for their rows, and fetches whose old rows are
held. Invariant: every pin and every held block belongs to one of them (an
entry's pin count is its admitted parents plus its live writer; held blocks
belong to a lent fetch only), and once everything is released nothing is pinned
or held; after a reset then, the pool is empty.
"""

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from vllm.v1.core.chunk_cache_manager import ChunkCacheManager
from vllm.v1.core.chunk_store_probe import StoreAnswer, StoreLookup
from vllm.v1.core.chunk_structures import (
    AdmitReason,
    ChunkContextMode,
    ChunkedPrompt,
    ChunkHash,
    ChunkNamespace,
    SegmentSpan,
)

from tests.chunk_manager_views import child_finished, report

NS = ChunkNamespace(model="m", kv_dtype="float32", tokenizer="t")
SYSTEMS = [[1, 2, 3], [4, 5]]
# Documents of 2..9 tokens (1..3 pool blocks of 4 rows).
DOCS = [list(range(100 * i, 100 * i + n)) for i, n in enumerate((2, 5, 9, 4, 7, 3), 1)]
# The store's held-rows limit (on the machine's clock).
HELD_LIMIT_S = 10.0


def prompt(segments: list[list[int]]) -> ChunkedPrompt:
    spans, start = [], 0
    for seg in segments:
        spans.append(SegmentSpan(start, start + len(seg)))
        start += len(seg)
    return ChunkedPrompt([t for seg in segments for t in seg], tuple(spans))


class Probe:
    """The store: documents whose first token is a multiple of 200 are in it;
    every answer is PENDING while `pending` is set."""

    def __init__(self):
        self.pending = False

    def lookup(self, segment_ids, context_ids, namespace):
        if self.pending:
            return StoreLookup(StoreAnswer.PENDING)
        hit = segment_ids[0] % 200 == 0
        return StoreLookup(StoreAnswer.HIT if hit else StoreAnswer.MISS, 7)


class ManagerMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.probe = Probe()
        self.m = ChunkCacheManager(
            10,
            4,
            ChunkContextMode.SINK,
            sink_token_id=1,
            store=self.probe,
            held_limit_s=HELD_LIMIT_S,
        )
        self.now = 0.0
        self.m.clock = lambda: self.now
        self.held_since: dict[str, float] = {}  # lent or waiting -> when it failed
        self.parents: dict[str, set[ChunkHash]] = {}  # live -> keys pinned
        self.children: dict[str, ChunkHash] = {}  # computing writers
        self.fetches: dict[str, ChunkHash] = {}  # reading writers
        self.waiting: dict[str, ChunkHash] = {}  # failed fetches waiting for rows
        self.lent: set[str] = set()  # fetches whose old rows are held
        self.keys: set[ChunkHash] = set()
        self.n = 0

    # ------------------------------------------------------------ helpers

    def _admit(self, rid: str) -> None:
        adm = self.m.admit(rid)
        if adm.reason == AdmitReason.ADMITTED:
            self.parents[rid] = {s.chunk_hash for s in adm.segments}
            self.keys |= self.parents[rid]
        else:
            # NOTE: deferred or refused: holds nothing (a parent admitted before a
            # reset drops its old pins when it is asked again).
            self.parents[rid] = set()
        for spec in adm.children:
            self.children[spec.request_id] = spec.chunk_hash
        for spec in adm.fetches:
            self.fetches[spec.request_id] = spec.chunk_hash
        self._take()

    def _children_of(self, outcome):
        """An outcome's children start."""
        for spec in outcome.children:
            self.children[spec.request_id] = spec.chunk_hash
        return outcome.children

    def _take(self) -> None:
        """Refusals."""
        for refusal in self.m.take_refusals():
            self.parents[refusal.request_id] = set()

    # -------------------------------------------------------------- rules

    @rule(
        system=st.sampled_from(range(len(SYSTEMS))),
        docs=st.lists(st.sampled_from(range(len(DOCS))), min_size=1, max_size=3),
    )
    def new_parent(self, system, docs):
        rid = f"p{self.n}"
        self.n += 1
        self.m.add_request(
            rid, prompt([SYSTEMS[system]] + [DOCS[d] for d in docs] + [[9]]), NS
        )
        self.parents[rid] = set()
        self._admit(rid)

    @precondition(lambda self: self.parents)
    @rule(data=st.data())
    def ask_again(self, data):
        self._admit(data.draw(st.sampled_from(sorted(self.parents))))

    @precondition(lambda self: self.parents)
    @rule(data=st.data())
    def release(self, data):
        rid = data.draw(st.sampled_from(sorted(self.parents)))
        assert self.m.release(rid)
        del self.parents[rid]

    @precondition(lambda self: self.children)
    @rule(data=st.data(), ok=st.booleans())
    def child_ends(self, data, ok):
        rid = data.draw(st.sampled_from(sorted(self.children)))
        del self.children[rid]
        outcome = self.m.finish_child(rid, ok, ended="FINISHED_ABORTED")
        self.m.puts_shipped()
        for spec in outcome.children:  # its retry, if any
            self.children[spec.request_id] = spec.chunk_hash
        self._take()

    @precondition(lambda self: self.fetches)
    @rule(data=st.data(), outcome=st.sampled_from(["ok", "failed", "lent"]))
    def fetch_ends(self, data, outcome):
        fid = data.draw(st.sampled_from(sorted(self.fetches)))
        h = self.fetches.pop(fid)
        if outcome == "ok":
            report(self.m, done=[fid])
            return
        specs = self._children_of(report(self.m, **{outcome: [fid]}))
        if not specs:
            self.waiting[fid] = h
        elif outcome == "lent":
            self.lent.add(fid)
        if outcome == "lent":
            self.held_since[fid] = self.now
        self._take()  # the child computing it instead

    @precondition(lambda self: self.lent or self.waiting)
    @rule(data=st.data())
    def rows_returned(self, data):
        fid = data.draw(st.sampled_from(sorted(self.lent | set(self.waiting))))
        specs = self._children_of(report(self.m, rows_returned=[fid]))
        del self.held_since[fid]
        if fid in self.waiting:
            del self.waiting[fid]
            assert len(specs) == 1  # its child
        else:
            self.lent.discard(fid)
            assert specs == ()
        self._take()

    @rule(seconds=st.sampled_from([0.0, HELD_LIMIT_S / 2, HELD_LIMIT_S]))
    def step(self, seconds):
        """A scheduler step, `seconds` later: the rows that stayed lent for the
        store's held limit are written off (issue 50, finding 4), those only."""
        self.now += seconds
        outcome = self.m.write_off_held()
        due = {
            f
            for f, since in self.held_since.items()
            if self.now - since >= HELD_LIMIT_S
        }
        assert set(outcome.written_off) == due
        self._children_of(outcome)
        for fid in due:
            del self.held_since[fid]
            self.lent.discard(fid)
            self.waiting.pop(fid, None)
        self._take()  # computed elsewhere, or its parents refused

    @rule()
    def toggle_pending(self):
        self.probe.pending = not self.probe.pending

    @rule()
    def reset(self):
        self.m.reset()

    @rule()
    def release_everything(self):
        """Every writer ends, every row comes back, every parent leaves."""
        self.probe.pending = False
        while self.children or self.fetches or self.waiting or self.lent:
            for fid in list(self.fetches):
                del self.fetches[fid]
                report(self.m, done=[fid])
            for fid in list(self.waiting):
                del self.waiting[fid]
                del self.held_since[fid]
                assert len(self._children_of(report(self.m, rows_returned=[fid]))) == 1
                self._take()
            for fid in list(self.lent):
                self.lent.discard(fid)
                del self.held_since[fid]
                assert report(self.m, rows_returned=[fid]).children == ()
            for rid in list(self.children):
                del self.children[rid]
                child_finished(self.m, rid)
            self._take()
        for rid in list(self.parents):
            assert self.m.release(rid)
        self.parents.clear()
        usage = self.m.pool.usage()
        assert (usage.num_entries - usage.num_evictable, usage.blocks_held) == (0, 0)
        assert self.m.stats().live_requests == 0
        self.m.reset()
        assert self.m.pool.usage().blocks_used == 0, "the pool is empty"

    # ---------------------------------------------------------- invariant

    @invariant()
    def every_pin_and_held_block_has_a_live_owner(self):
        writers = (
            list(self.children.values())
            + list(self.fetches.values())
            + list(self.waiting.values())
        )
        assert len(writers) == len(set(writers)), "one writer per key"
        expected: dict[ChunkHash, int] = {}
        for keys in self.parents.values():
            for h in keys:
                expected[h] = expected.get(h, 0) + 1
        for h in writers:
            expected[h] = expected.get(h, 0) + 1
        pool = self.m.pool
        for h in self.keys | set(writers):
            entry = pool.get(h)
            got = 0 if entry is None else entry.pin_count
            assert got == expected.get(h, 0), (h.hex()[:8], got, expected.get(h, 0))
        usage = pool.usage()
        assert usage.num_entries - usage.num_evictable == sum(
            1 for n in expected.values() if n
        )
        held = sum(len(pool.held_by(fid)) for fid in self.lent)
        assert usage.blocks_held == held, "held blocks belong to lent fetches only"


TestManagerMachine = ManagerMachine.TestCase
TestManagerMachine.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None
)
