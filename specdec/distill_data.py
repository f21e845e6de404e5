"""Prompts for distilling a draft: structured extraction, JSON tasks and plain chat.

Everything is generated from the word lists below with a seeded RNG, so the data needs no
download and the same seed gives the same prompts. Each item carries the constraint its
response is sampled under (None: unconstrained), so the draft sees the target's outputs
both ways.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Any

from .grammar import Constraint

FIRST = ["Alice", "Bob", "Carla", "David", "Elena", "Farid", "Grace", "Hiro", "Ines", "Jamal",
         "Kira", "Liam", "Maya", "Noah", "Olga", "Pablo", "Quinn", "Rosa", "Sam", "Tara",
         "Umar", "Vera", "Wen", "Xavier", "Yara", "Zoe", "Marco", "Priya", "Lucas", "Amara"]
LAST = ["Johnson", "Smith", "Garcia", "Chen", "Müller", "Okafor", "Rossi", "Tanaka", "Novak",
        "Silva", "Kowalski", "Dubois", "Haddad", "Larsen", "Patel", "Nguyen", "Brown", "Ivanova",
        "Moreau", "Kim", "Alvarez", "Berg", "Costa", "Weber", "Singh"]
CITIES = ["Paris", "Lisbon", "Osaka", "Toronto", "Nairobi", "Berlin", "Austin", "Lima",
          "Seoul", "Oslo", "Dublin", "Cairo", "Denver", "Madrid", "Sydney", "Prague", "Boston",
          "Mumbai", "Vienna", "Seattle"]
JOBS = ["software engineer", "nurse", "teacher", "architect", "chef", "data analyst",
        "pilot", "accountant", "photographer", "electrician", "lawyer", "designer"]
PRODUCTS = ["wireless mouse", "coffee grinder", "desk lamp", "yoga mat", "backpack",
            "water bottle", "mechanical keyboard", "running shoes", "tea kettle", "monitor stand",
            "phone case", "notebook"]
COMPANIES = ["Acme Corp", "Globex", "Initech", "Umbrella Labs", "Northwind", "Blue Harbor",
             "Peak Systems", "Greenleaf", "Orbit Media", "Sunrise Foods"]
EVENTS = ["product launch", "charity run", "jazz concert", "science fair", "book signing",
          "team offsite", "hackathon", "farmers market"]
STREETS = ["Elm Street", "Main Street", "Oak Avenue", "Park Road", "River Lane", "Hill Drive",
           "Maple Court", "Station Road"]
TOPICS = ["photosynthesis", "the water cycle", "black holes", "compound interest", "vaccines",
          "the French Revolution", "machine learning", "climate change", "volcanoes",
          "the immune system", "electric cars", "the stock market", "gravity", "DNA",
          "renewable energy", "the internet", "sleep", "coffee", "honey bees", "recycling"]
CHAT = ["Explain {t} in two sentences.", "What is {t}?", "Give me three facts about {t}.",
        "Write a short poem about {t}.", "Why does {t} matter?",
        "Summarize {t} for a ten-year-old.", "What are the pros and cons of {t}?",
        "Tell me a fun fact about {t}."]
SENTIMENT = ["I loved the {p}, it works perfectly!", "The {p} broke after two days.",
             "The {p} is okay, nothing special.", "Terrible support, and the {p} arrived late.",
             "Best {p} I have ever bought."]


@dataclass(frozen=True)
class DistillPrompt:
    """One chat prompt and the constraint its response is sampled under."""

    messages: tuple[dict[str, str], ...]
    constraint: Constraint | None


def _obj(props: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    return {"type": "object", "properties": props, "required": required or list(props),
            "additionalProperties": False}


S, INT, N = {"type": "string"}, {"type": "integer"}, {"type": "number"}


def _person(r: random.Random) -> tuple[str, dict[str, Any]]:
    f, la, c = r.choice(FIRST), r.choice(LAST), r.choice(CITIES)
    age, job = r.randint(19, 78), r.choice(JOBS)
    email = f"{f.lower()}.{la.lower()}@{r.choice(['example.com', 'mail.org', 'corp.net'])}"
    phone = f"+1-{r.randint(200, 999)}-{r.randint(100, 999)}-{r.randint(1000, 9999)}"
    text = r.choice([
        f"{f} {la} is a {age}-year-old {job} from {c}. You can reach them at {email} or "
        f"{phone}.",
        f"Contact: {f} {la} ({job}), based in {c}. Email {email}, phone {phone}. Age: {age}.",
        f"Meet {f} {la}! At {age}, {f} works as a {job} in {c}. Write to {email}.",
    ])
    schema = _obj({"name": S, "age": INT, "job": S, "city": S, "email": S})
    return text, schema


def _order(r: random.Random) -> tuple[str, dict[str, Any]]:
    f, la = r.choice(FIRST), r.choice(LAST)
    n, p, q = r.randint(1000, 99999), r.choice(PRODUCTS), r.randint(1, 9)
    price = round(r.uniform(3, 250), 2)
    addr = f"{r.randint(1, 999)} {r.choice(STREETS)}, {r.choice(CITIES)}"
    date = f"2026-{r.randint(1, 12):02d}-{r.randint(1, 28):02d}"
    text = (f"Order #{n}: {f} {la} bought {q} x {p} at ${price} each on {date}. "
            f"Ship to {addr}.")
    schema = _obj({"order_id": INT, "customer": S, "product": S, "quantity": INT,
                   "unit_price": N, "date": S, "address": S})
    return text, schema


def _event(r: random.Random) -> tuple[str, dict[str, Any]]:
    e, c, co = r.choice(EVENTS), r.choice(CITIES), r.choice(COMPANIES)
    date = f"{r.choice(['March', 'June', 'September', 'November'])} {r.randint(1, 28)}"
    time = f"{r.randint(8, 20)}:{r.choice(['00', '15', '30', '45'])}"
    text = f"The {e} organized by {co} takes place in {c} on {date} at {time}."
    schema = _obj({"event": S, "organizer": S, "city": S, "date": S, "time": S})
    return text, schema


def _review(r: random.Random) -> tuple[str, dict[str, Any]]:
    p = r.choice(PRODUCTS)
    text = r.choice(SENTIMENT).format(p=p) + f" - {r.choice(FIRST)}, {r.randint(1, 5)} stars"
    schema = _obj({"product": S, "rating": {"type": "integer", "minimum": 1, "maximum": 5},
                   "sentiment": {"enum": ["positive", "neutral", "negative"]},
                   "reviewer": S})
    return text, schema


def _json_task(r: random.Random) -> tuple[str, dict[str, Any]]:
    kind = r.randrange(4)
    if kind == 0:
        t = r.choice(TOPICS)
        return (f"Describe {t} as JSON with a title, a one-sentence summary and three keywords.",
                _obj({"title": S, "summary": S,
                      "keywords": {"type": "array", "items": S, "minItems": 3, "maxItems": 3}}))
    if kind == 1:
        c = r.choice(CITIES)
        return (f"Give a JSON object for the city of {c}: its country, an estimated population "
                "and two famous landmarks.",
                _obj({"city": S, "country": S, "population": INT,
                      "landmarks": {"type": "array", "items": S, "maxItems": 2}}))
    if kind == 2:
        n = r.randint(2, 4)
        return (f"List {n} {r.choice(['books', 'movies', 'songs', 'games'])} about "
                f"{r.choice(TOPICS)} as JSON.",
                _obj({"items": {"type": "array", "maxItems": n,
                                "items": _obj({"title": S, "year": INT})}}))
    p = r.choice(PRODUCTS)
    return (f"Create a product listing for a {p} as JSON with name, price in USD, whether it "
            "is in stock and a short description.",
            _obj({"name": S, "price": N, "in_stock": {"type": "boolean"}, "description": S}))


EXTRACTORS = [_person, _order, _event, _review]


def make_prompts(n: int, seed: int) -> list[DistillPrompt]:
    """n prompts: ~45% extraction from a text, ~25% JSON tasks, ~30% plain chat.

    Args:
        n: how many prompts.
        seed: RNG seed (the same seed gives the same list).
    """
    r = random.Random(seed)
    out: list[DistillPrompt] = []
    for _ in range(n):
        u = r.random()
        if u < 0.45:
            text, schema = r.choice(EXTRACTORS)(r)
            show = r.random() < 0.3
            ask = r.choice(["Extract the details from this text as JSON.",
                            "Return the fields of the following text as a JSON object.",
                            "Read the text and fill in the JSON."])
            if show:
                ask += " Schema: " + json.dumps(schema, separators=(",", ":"))
            msg = f"{ask}\n\nText: {text}"
            v = r.random()
            c = (Constraint.json_schema(schema) if v < 0.8 else
                 Constraint.json_object() if v < 0.9 else None)
        elif u < 0.70:
            msg, schema = _json_task(r)
            c = Constraint.json_schema(schema) if r.random() < 0.85 else None
        elif u < 0.78:
            p = r.choice(PRODUCTS)
            msg = ("Is this review positive, neutral or negative? Answer with one word.\n\n"
                   + r.choice(SENTIMENT).format(p=p))
            c = Constraint.choice(["positive", "neutral", "negative"]) if r.random() < 0.5 \
                else None
        else:
            msg = r.choice(CHAT).format(t=r.choice(TOPICS))
            c = None
        messages: list[dict[str, str]] = []
        if r.random() < 0.3:
            messages.append({"role": "system", "content": "You are a helpful assistant."})
        messages.append({"role": "user", "content": msg})
        out.append(DistillPrompt(tuple(messages), c))
    return out
