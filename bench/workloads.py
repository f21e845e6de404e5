"""Fixed workloads: prompts and constraints shipped with the repo, shared by the benchmarks
and the integration/exactness tests."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SYSTEM = "You are a precise assistant. Reply with the requested data only."


@dataclass(frozen=True)
class Case:
    """One workload item.

    Attributes:
        name: short id.
        user: the user message.
        kind: constraint kind (`json_schema`, `regex`, `choice`, `json_object`, `grammar`).
        value: the constraint value.
    """

    name: str
    user: str
    kind: str
    value: Any = None

    def messages(self) -> list[dict[str, str]]:
        return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": self.user}]


FLAT = {"type": "object",
        "properties": {"name": {"type": "string", "maxLength": 30},
                       "age": {"type": "integer", "minimum": 0, "maximum": 120},
                       "email": {"type": "string", "maxLength": 40}},
        "required": ["name", "age", "email"], "additionalProperties": False}

NESTED = {"type": "object",
          "properties": {"company": {"type": "string", "maxLength": 30},
                         "address": {"type": "object",
                                     "properties": {"city": {"type": "string", "maxLength": 20},
                                                    "zip": {"type": "string",
                                                            "pattern": "^[0-9]{5}$"}},
                                     "required": ["city", "zip"],
                                     "additionalProperties": False}},
          "required": ["company", "address"], "additionalProperties": False}

ARRAY = {"type": "object",
         "properties": {"tags": {"type": "array", "minItems": 2, "maxItems": 4,
                                 "items": {"type": "string", "maxLength": 12}}},
         "required": ["tags"], "additionalProperties": False}

ENUMS = {"type": "object",
         "properties": {"sentiment": {"enum": ["positive", "negative", "neutral"]},
                        "confidence": {"enum": ["low", "medium", "high"]},
                        "language": {"type": "string", "enum": ["en", "fr", "de"]}},
         "required": ["sentiment", "confidence", "language"], "additionalProperties": False}

REFS = {"$defs": {"Item": {"type": "object",
                           "properties": {"product": {"type": "string", "maxLength": 20},
                                          "quantity": {"type": "integer", "minimum": 1,
                                                       "maximum": 99}},
                           "required": ["product", "quantity"],
                           "additionalProperties": False}},
        "type": "object",
        "properties": {"items": {"type": "array", "items": {"$ref": "#/$defs/Item"},
                                 "minItems": 1, "maxItems": 3}},
        "required": ["items"], "additionalProperties": False}

ANYOF = {"type": "object",
         "properties": {"answer": {"anyOf": [{"type": "integer"}, {"type": "string",
                                                                  "maxLength": 20},
                                             {"type": "null"}]},
                        "unit": {"anyOf": [{"type": "string", "maxLength": 10},
                                           {"type": "null"}]}},
         "required": ["answer", "unit"], "additionalProperties": False}

CASES: tuple[Case, ...] = (
    Case("flat", "Invent a person with name, age and email as JSON.", "json_schema", FLAT),
    Case("nested", "Give a company with its address (city, 5-digit zip) as JSON.",
         "json_schema", NESTED),
    Case("array", "List a few tags for a blog post about cooking pasta.", "json_schema", ARRAY),
    Case("enums", "Classify: 'I love this phone, it is great!'", "json_schema", ENUMS),
    Case("refs", "Order: two apples and one bread. Give the items as JSON.", "json_schema",
         REFS),
    Case("anyof", "How many legs does a spider have? Answer as JSON.", "json_schema", ANYOF),
    Case("regex", "Give today's date as YYYY-MM-DD.", "regex", r"20[0-9]{2}-[01][0-9]-[0-3][0-9]"),
    Case("choice", "Is the sky blue on a clear day? Answer yes or no.", "choice", ["yes", "no"]),
    Case("json_object", "Describe a cat as a JSON object with two fields.", "json_object"),
)


# Extraction: the answer's strings are spans of the prompt (prompt lookup's workload).
CONTACT = {"type": "object",
           "properties": {"name": {"type": "string"}, "title": {"type": "string"},
                          "company": {"type": "string"}, "email": {"type": "string"},
                          "phone": {"type": "string"}, "city": {"type": "string"}},
           "required": ["name", "title", "company", "email", "phone", "city"],
           "additionalProperties": False}

ORDER = {"type": "object",
         "properties": {"order_id": {"type": "string"}, "customer": {"type": "string"},
                        "items": {"type": "array", "maxItems": 4,
                                  "items": {"type": "object",
                                            "properties": {"product": {"type": "string"},
                                                           "quantity": {"type": "integer"}},
                                            "required": ["product", "quantity"],
                                            "additionalProperties": False}},
                        "ship_to": {"type": "string"}},
         "required": ["order_id", "customer", "items", "ship_to"],
         "additionalProperties": False}

EXTRACT_ASK = "Extract the fields from the text below as JSON, copying values exactly.\n\n"

EXTRACTION: tuple[Case, ...] = (
    Case("extract_contact", EXTRACT_ASK + "Text: Please welcome Dr. Margaret Okonkwo-Lindqvist, "
         "the new Head of Applied Research at Brightwater Analytics. Reach her at "
         "margaret.okonkwo-lindqvist@brightwater-analytics.com or +44 20 7946 0958; she "
         "works from the Edinburgh office.", "json_schema", CONTACT),
    Case("extract_order", EXTRACT_ASK + "Text: Order PO-2026-118734 placed by Sebastian "
         "Villanueva-Hartmann: 3 x Ergonomic Mesh Office Chair, 2 x Adjustable Standing Desk "
         "Converter, 1 x Noise Cancelling Headphones. Deliver to 4417 Cedar Hollow Road, "
         "Apartment 12B, Portland, Oregon 97205.", "json_schema", ORDER),
    Case("extract_contact2", EXTRACT_ASK + "Text: From the conference badge: Rajesh "
         "Subramanian-Castellanos, Principal Infrastructure Engineer, Northwind Logistics "
         "International. Email rajesh.subramanian@northwind-logistics.example, mobile "
         "+1 (415) 555-0187, based in San Francisco.", "json_schema", CONTACT),
)

# The same schema answered again and again (a ticket-triage endpoint): the keys, enum values
# and shapes repeat across requests while the values differ (suffix proposals' case).
TICKET = {"type": "object",
          "properties": {"category": {"enum": ["billing", "login", "shipping", "bug", "other"]},
                         "priority": {"enum": ["low", "medium", "high", "urgent"]},
                         "product": {"type": "string", "maxLength": 30},
                         "needs_reply": {"type": "boolean"},
                         "summary": {"type": "string", "maxLength": 60}},
          "required": ["category", "priority", "product", "needs_reply", "summary"],
          "additionalProperties": False}
TRIAGE_ASK = "Triage this support ticket as JSON.\n\nTicket: "
REPEATED: tuple[Case, ...] = tuple(
    Case(f"ticket{i}", TRIAGE_ASK + text, "json_schema", TICKET) for i, text in enumerate((
        "I was charged twice for my Pro plan this month, please refund one.",
        "Cannot log in to the mobile app since the update, it says invalid token.",
        "My order of the desk lamp has not arrived after three weeks.",
        "The export button in the web dashboard crashes the page.",
        "How do I change the email address on my account?",
        "Invoice for March shows the wrong company name.",
        "Password reset emails never arrive.",
        "The tracking number for my headphones order does not work.",
    )))


CLOSING_FORMATS = ("email", "uri", "hostname", "ipv4", "ipv6", "date", "time", "date-time",
                   "duration", "uuid")
EMAIL = {"type": "string", "format": "email"}


def one_property(schema: dict) -> dict:
    """An object of one required property `v` of `schema`."""
    return {"type": "object", "properties": {"v": schema}, "required": ["v"],
            "additionalProperties": False}


_v = one_property
# Schemas whose closing needs the budget's search (`specdec.budget`): every kind of
# constraint the token budget must close (string formats, patterns, long enums, counts,
# nesting, const, anyOf / oneOf).
CLOSING_KINDS: dict[str, dict] = {
    **{f"format_{f}": _v({"type": "string", "format": f}) for f in CLOSING_FORMATS},
    "contact": {"type": "object", "properties": {
        "first": {"type": "string"}, "last": {"type": "string"},
        "phone": {"type": "string", "pattern": "^[0-9]{10}$"}, "email": EMAIL},
        "required": ["first", "last", "phone", "email"], "additionalProperties": False},
    "pattern_separators": _v({"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}:[a-z]+$"}),
    "pattern_alternation": _v({"type": "string", "pattern": "^(ab|cd)+x$"}),
    "long_enum": _v({"enum": ["supercalifragilistic", "antidisestablishmentarianism"]}),
    "min_items": _v({"type": "array", "items": EMAIL, "minItems": 3}),
    "min_length": _v({"type": "string", "minLength": 40}),
    # (llguidance takes minProperties where every listed property is required; the walk
    # writes further keys alike, so one beyond the listed ones: `{"a": 1, "": 1}`)
    "min_properties": {"type": "object", "minProperties": 2, "required": ["a"],
                       "properties": {"a": {"type": "integer"}},
                       "additionalProperties": {"type": "integer"}},
    "nested": _v({"type": "object",
                  "properties": {"b": _v({"type": "string", "format": "date-time"})},
                  "required": ["b"], "additionalProperties": False}),
    "const": _v({"const": "fixed-value-here"}),
    "any_of": _v({"anyOf": [EMAIL, {"type": "string", "format": "uuid"}]}),
    "one_of": _v({"oneOf": [{"type": "string", "format": "duration"},
                            {"type": "integer", "minimum": 10}]}),
}
