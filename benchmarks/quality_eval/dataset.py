# SPDX-License-Identifier: Apache-2.0
"""A RAG QA set built offline and deterministically (no download, no model).

The corpus is invented people and organisations, so the model cannot answer from
what it memorised: every answer is a fact planted in one document. A prompt is

    system ## doc ## doc ## doc ## doc ## Question: ...\nAnswer: <answer prefix>

and the gold answer is the continuation of the answer prefix (" Valmora", " 4821").
Ending the prompt inside the answer sentence measures retrieval, not output format
(a 135M model rarely follows "answer with one word").

* single-hop: the fact is in one document (a person's city, job, code, colour; an
  organisation's founding year); the other documents are distractors of the same
  shape (same attributes, other values), so the right entity must be found.
* two-hop: an organisation's document names its leader, the leader's own document
  holds the fact ("In which city does the leader of the Amber Falcon Guild live?"):
  both documents are in the prompt, in random order, among distractors.

Documents are drawn from one corpus, so they recur across questions in other
orders and next to other documents: the reuse the chunk cache is for.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

SYSTEM = "Answer the question using only the documents."

_SYLLABLES = ("ka ro ve lin tor ma su be dra qui nel fo zan pe li mor ta wen cor "
              "bri sel gan ul vo tha ren ix ol mi da phe").split()
_JOBS = ("baker pilot surgeon carpenter librarian chemist farmer sailor painter judge "
         "dentist plumber teacher jeweller tailor").split()
_COLOURS = "red blue green yellow purple orange black white silver brown".split()
_ADJ = "Amber Silver Crimson Iron Golden Hidden Northern Quiet Velvet Copper".split()
_NOUN = "Falcon Lantern Harbor Compass Anchor Willow Beacon Raven Thistle Orchid".split()
_KINDS = "Guild Society League Circle Council".split()
_DAYS = "Monday Tuesday Wednesday Thursday Friday Saturday Sunday".split()
_FILLER = (
    "The weather there is usually mild in spring.",
    "Neighbours describe the household as quiet and friendly.",
    "The local market is busy on most mornings.",
    "Many visitors arrive by train from the coast.",
    "The old bridge nearby was repaired last year.",
    "Evenings are often spent reading by the window.",
)


@dataclass(frozen=True)
class Person:
    name: str
    city: str
    job: str
    code: str
    colour: str
    filler: str

    def document(self) -> str:
        return (f"{self.name} is a {self.job} who lives in the city of {self.city}. "
                f"{self.name}'s secret code is {self.code}. {self.filler} "
                f"{self.name}'s favourite colour is {self.colour}.")


@dataclass(frozen=True)
class Organisation:
    name: str
    year: str
    leader: str
    day: str

    def document(self) -> str:
        return (f"The {self.name} was founded in {self.year}. Its leader is {self.leader}. "
                f"Members of the {self.name} meet every {self.day}.")


@dataclass(frozen=True)
class Question:
    """One QA item: the prompt's segments and the gold continuation."""

    qid: str
    # "single" (one document needed) or "two-hop" (two documents needed).
    kind: str
    # The attribute asked for (city, job, code, colour, year).
    attribute: str
    system: str
    documents: tuple[str, ...]
    # Indices into `documents` of the documents the answer needs.
    gold_documents: tuple[int, ...]
    # "Question: ...\nAnswer: <prefix>" (the last segment).
    question: str
    # The gold value without its leading space ("Valmora"); the continuation
    # scored and expected is " " + answer.
    answer: str

    @property
    def segments(self) -> list[str]:
        return [self.system, *self.documents, self.question]


@dataclass(frozen=True)
class DatasetConfig:
    seed: int = 0
    people: int = 80
    organisations: int = 40
    single_hop: int = 120
    two_hop: int = 120
    # Documents per prompt (gold ones included).
    docs_per_prompt: int = 4


@dataclass(frozen=True)
class Dataset:
    config: DatasetConfig
    people: tuple[Person, ...]
    organisations: tuple[Organisation, ...]
    questions: tuple[Question, ...]


def _word(rng: random.Random, syllables: int) -> str:
    return "".join(rng.choice(_SYLLABLES) for _ in range(syllables)).capitalize()


def _unique(rng: random.Random, n: int, make) -> list[str]:
    seen: set[str] = set()
    out = []
    while len(out) < n:
        w = make(rng)
        if w not in seen:
            seen.add(w)
            out.append(w)
    return out


def _corpus(cfg: DatasetConfig, rng: random.Random):
    names = _unique(rng, cfg.people, lambda r: f"{_word(r, 2)} {_word(r, 3)}")
    cities = _unique(rng, cfg.people, lambda r: _word(r, 3))
    codes = _unique(rng, cfg.people, lambda r: str(r.randint(1000, 9999)))
    people = [Person(name, city, rng.choice(_JOBS), code, rng.choice(_COLOURS),
                     rng.choice(_FILLER))
              for name, city, code in zip(names, cities, codes)]
    org_names = _unique(rng, cfg.organisations,
                        lambda r: f"{r.choice(_ADJ)} {r.choice(_NOUN)} {r.choice(_KINDS)}")
    years = _unique(rng, cfg.organisations, lambda r: str(r.randint(1820, 1990)))
    # Distinct leaders, so "the leader of X" names one person.
    leaders = rng.sample(people, cfg.organisations)
    orgs = [Organisation(name, year, leader.name, rng.choice(_DAYS))
            for name, year, leader in zip(org_names, years, leaders)]
    return people, orgs


# attribute -> (question about a name, answer prefix about a name)
_PERSON_QA = {
    "city": ("In which city does {n} live?", "{n} lives in the city of"),
    "job": ("What is {n}'s job?", "{n} is a"),
    "code": ("What is {n}'s secret code?", "{n}'s secret code is"),
    "colour": ("What is {n}'s favourite colour?", "{n}'s favourite colour is"),
}


# The same attributes asked through an organisation's leader (two documents needed).
_TWO_HOP_QA = {
    "city": ("In which city does the leader of the {o} live?",
             "The leader of the {o} lives in the city of"),
    "job": ("What is the job of the leader of the {o}?", "The leader of the {o} is a"),
    "code": ("What is the secret code of the leader of the {o}?",
             "The secret code of the leader of the {o} is"),
    "colour": ("What is the favourite colour of the leader of the {o}?",
               "The favourite colour of the leader of the {o} is"),
}


def _question_text(question: str, prefix: str) -> str:
    return f"Question: {question}\nAnswer: {prefix}"


def _assemble(rng, cfg, gold_docs: list[str], pool: list[str]) -> tuple[tuple[str, ...],
                                                                       tuple[int, ...]]:
    """Gold documents plus distinct distractors from `pool`, shuffled."""
    distractors = rng.sample([d for d in pool if d not in gold_docs],
                             cfg.docs_per_prompt - len(gold_docs))
    docs = gold_docs + distractors
    rng.shuffle(docs)
    return tuple(docs), tuple(sorted(docs.index(g) for g in gold_docs))


def build_dataset(cfg: DatasetConfig = DatasetConfig()) -> Dataset:
    """The same config always gives the same dataset (one seeded RNG, no hashing)."""
    rng = random.Random(cfg.seed)
    people, orgs = _corpus(cfg, rng)
    by_name = {p.name: p for p in people}
    all_docs = [p.document() for p in people] + [o.document() for o in orgs]
    questions: list[Question] = []
    for i in range(cfg.single_hop):
        # One in six single-hop questions asks an organisation's founding year.
        if i % 6 == 5:
            org = rng.choice(orgs)
            attribute, answer = "year", org.year
            text = _question_text(f"When was the {org.name} founded?",
                                  f"The {org.name} was founded in")
            gold = [org.document()]
        else:
            person = rng.choice(people)
            attribute = rng.choice(sorted(_PERSON_QA))
            q, prefix = _PERSON_QA[attribute]
            answer = getattr(person, attribute)
            text = _question_text(q.format(n=person.name), prefix.format(n=person.name))
            gold = [person.document()]
        docs, gold_idx = _assemble(rng, cfg, gold, all_docs)
        questions.append(Question(f"s{i:03d}", "single", attribute, SYSTEM, docs, gold_idx,
                                  text, answer))
    for i in range(cfg.two_hop):
        org = rng.choice(orgs)
        leader = by_name[org.leader]
        attribute = rng.choice(sorted(_TWO_HOP_QA))
        q, prefix = _TWO_HOP_QA[attribute]
        text = _question_text(q.format(o=org.name), prefix.format(o=org.name))
        docs, gold_idx = _assemble(rng, cfg, [org.document(), leader.document()], all_docs)
        questions.append(Question(f"t{i:03d}", "two-hop", attribute, SYSTEM, docs, gold_idx,
                                  text, getattr(leader, attribute)))
    return Dataset(cfg, tuple(people), tuple(orgs), tuple(questions))
