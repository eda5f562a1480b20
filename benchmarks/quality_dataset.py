# SPDX-License-Identifier: Apache-2.0
"""A synthetic RAG question set for the quality evaluation (issue 11), built offline.

Every document is a short paragraph with one planted fact among filler sentences;
questions need one document (single-hop) or two (two-hop: the fact in one document
names a person whose own fact is in another). Each question's prompt holds its gold
document(s) and distractor documents drawn from the same corpus, in a seeded order,
so the chunk cache sees realistic reuse across questions. Everything is a pure
function of the seed: the same seed gives byte-identical questions on any machine
(only `random.Random(str)`, no hash() of objects, no set iteration).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

SEP = "##"

# Names are combined (first x last) so that hundreds of distinct people exist.
_FIRST = ("Mira Ivan Lena Tomas Sara Omar Nina Pavel Alma Jonas Ruth Felix Clara Hugo "
          "Vera Emil Ada Bruno Ines Otto Lina Marco Zoe Anton Rosa Karl Maya Leon Ida "
          "Victor").split()
_LAST = ("Olsen Petrov Novak Berg Haas Moreau Silva Kowalski Lund Fischer Costa Dahl "
         "Weber Rossi Varga Brandt Keller Horvat Nilsen Ortiz").split()
_CODE_A = ("Amber Cobalt Silver Crimson Golden Hidden Northern Quiet Rapid Scarlet Stone "
           "Violet Winter Iron Coral").split()
_CODE_B = ("Falcon Harbor Lantern Meadow Orbit Pine River Summit Tiger Willow Comet "
           "Glacier Beacon Canyon").split()
_CITIES = ("Lisbon Oslo Krakow Porto Geneva Dublin Tallinn Seville Bergen Leipzig Turin "
           "Ghent Utrecht Malmo Split Graz Lyon Bilbao Aarhus Riga").split()
_FILLER = (
    "The report was reviewed during the spring planning meeting.",
    "Several teams contributed notes to this summary.",
    "The budget for the year was approved without changes.",
    "Meetings usually take place on Tuesday mornings.",
    "A short update is sent to all staff every month.",
    "The archive keeps older versions of this page.",
    "New members receive a welcome guide in their first week.",
    "The schedule was adjusted after the winter holidays.",
    "Questions about this page go to the help desk.",
    "The previous version of this note was written last year.",
)

SYSTEM = ("<|im_start|>system\nYou answer questions using the documents. Reply with the "
          "answer only, in a few words.<|im_end|>\n<|im_start|>user\nDocuments:")


@dataclass(frozen=True)
class Question:
    """One RAG question and the documents its prompt carries."""

    qid: int
    # "single" (one gold document) or "two_hop" (two).
    kind: str
    # The question segment (the last one): the question, the chat template's tail and
    # the start of the assistant's answer (a cue the gold answer completes).
    question: str
    # The short gold answer, as written in the gold document.
    answer: str
    # Document texts in prompt order (gold and distractors).
    documents: tuple[str, ...]
    # Indices into `documents` of the gold document(s).
    gold: tuple[int, ...]

    @property
    def segments(self) -> list[str]:
        return [SYSTEM, *self.documents, self.question]

    @property
    def prompt(self) -> str:
        """The chunked prompt text: `system ## doc ## ... ## question`."""
        return f" {SEP} ".join(self.segments)


@dataclass(frozen=True)
class DatasetConfig:
    # Questions of each kind.
    num_single: int = 100
    num_two_hop: int = 100
    # Documents per prompt, gold included.
    docs_per_prompt: int = 6
    # Filler sentences around each planted fact.
    filler_sentences: int = 2
    seed: int = 0


@dataclass(frozen=True)
class _Chain:
    """One project, its leader and the leader's office: three facts, three documents."""

    project: str
    leader: str
    room: str
    city: str


def _paragraph(rng: random.Random, fact: str, n: int) -> str:
    # The fact sits at a random place among the filler, so the answer is not always
    # at the start of a chunk (where boundary recompute would favour it).
    sentences = rng.sample(_FILLER, n)
    sentences.insert(rng.randint(0, n), fact)
    return " ".join(sentences)


def _chains(rng: random.Random, n: int) -> list[_Chain]:
    people = [f"{a} {b}" for a in _FIRST for b in _LAST]
    projects = [f"Project {a} {b}" for a in _CODE_A for b in _CODE_B]
    rooms = [f"Room {r}" for r in range(101, 999)]
    if n > min(len(people), len(projects)):
        raise ValueError(f"at most {min(len(people), len(projects))} chains")
    people, projects, rooms = rng.sample(people, n), rng.sample(projects, n), rng.sample(rooms, n)
    return [_Chain(projects[i], people[i], rooms[i], rng.choice(_CITIES)) for i in range(n)]


def _chat_question(text: str, cue: str) -> str:
    # The assistant turn starts with a cue that the answer completes ("... is led by"):
    # a 135M model answers a bare question with a copied sentence, not the answer, so
    # without the cue exact match would measure the output format, not the reading.
    return f"Question: {text}<|im_end|>\n<|im_start|>assistant\n{cue}"


def build_dataset(cfg: DatasetConfig = DatasetConfig()) -> list[Question]:
    """The question set: a pure function of `cfg`."""
    rng = random.Random(f"quality-{cfg.seed}")
    chains = _chains(rng, cfg.num_single + cfg.num_two_hop)
    lead_doc, room_doc, city_doc = [], [], []
    for c in chains:
        n = cfg.filler_sentences
        lead_doc.append(_paragraph(rng, f"{c.project} is led by {c.leader}.", n))
        room_doc.append(_paragraph(rng, f"{c.leader}'s office is in {c.room}.", n))
        city_doc.append(_paragraph(rng, f"{c.leader} was born in {c.city}.", n))
    corpus = lead_doc + room_doc + city_doc

    questions: list[Question] = []
    for i, c in enumerate(chains):
        if i < cfg.num_single:
            # Three single-hop forms in turn.
            form = i % 3
            if form == 0:
                q, cue = f"Who leads {c.project}?", f"{c.project} is led by"
                a, gold = c.leader, [lead_doc[i]]
            elif form == 1:
                q, cue = f"In which room is {c.leader}'s office?", f"{c.leader}'s office is in"
                a, gold = c.room, [room_doc[i]]
            else:
                q, cue = f"In which city was {c.leader} born?", f"{c.leader} was born in"
                a, gold = c.city, [city_doc[i]]
            kind = "single"
        else:
            q = f"In which room is the office of the person who leads {c.project}?"
            cue = f"The person who leads {c.project} has an office in"
            a, gold, kind = c.room, [lead_doc[i], room_doc[i]], "two_hop"
        # Distractors never carry a fact about this question's chain (its city
        # document included): the gold documents are the only evidence.
        own = {lead_doc[i], room_doc[i], city_doc[i]}
        pool = [d for d in corpus if d not in own]
        docs = gold + rng.sample(pool, cfg.docs_per_prompt - len(gold))
        rng.shuffle(docs)
        questions.append(Question(
            qid=i, kind=kind, question=_chat_question(q, cue), answer=a, documents=tuple(docs),
            gold=tuple(docs.index(g) for g in gold)))
    return questions
