"""OpenAI's Conversations API, `/v1/conversations`: a conversation's items, kept in the
server's store (`server.store`) and continued by a Responses request that names it
(`conversation`: its items come first, and the request's input and output are added).

Create (with up to 20 items and metadata), retrieve, update its metadata, delete; list its
items (paginated as OpenAI's: `after`, `limit` 1-100, `order` asc or desc, newest first by
default), add items, retrieve or delete one. An id not stored is a 404 in OpenAI's shape;
with `specdec serve --store none` every route is a 404 (nothing is kept).
"""

from __future__ import annotations

import uuid
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from specdec.errors import SpecdecError

from .door import Door
from .errors import bad_request, openai_response
from .openapi import error_responses
from .responses import NEEDS, not_found, owner_of, wire_item
from .responses_wire import FAIL_FAST, InputItem
from .store import Item, Store, first_duplicate, page

PREFIX = "/v1/conversations"
MAX_ITEMS = 20  # items one create or add call may give (OpenAI's bound)
Metadata = Annotated[dict[str, str], Field(max_length=16)]


class _Wire(BaseModel):
    """Scalars as the document types them (as `responses_wire`'s)."""

    model_config = ConfigDict(strict=True)


class NewConversation(_Wire):
    model_config = ConfigDict(extra="forbid")
    items: Annotated[list[InputItem], FAIL_FAST, Field(max_length=MAX_ITEMS)] = Field(
        default_factory=list)
    metadata: Metadata | None = None


class NewItems(_Wire):
    model_config = ConfigDict(extra="forbid")
    items: Annotated[list[InputItem], FAIL_FAST, Field(min_length=1, max_length=MAX_ITEMS)]


class Update(_Wire):
    model_config = ConfigDict(extra="forbid")
    metadata: Metadata


REQUEST_BODIES: dict[str, type[BaseModel]] = {
    PREFIX: NewConversation, PREFIX + "/{cid}": Update, PREFIX + "/{cid}/items": NewItems}
ERRORS = error_responses(400, 401, 404, 409, 413, 503)


def error(e: SpecdecError, body: Any = None) -> JSONResponse:
    return openai_response(e, {})


async def items_of(given: list[InputItem], door: Door, owner: str) -> list[Item]:
    """Items as stored: with ids; an `item_reference` is the stored item it names.

    Raises:
        WireError: 400 for an item missing a field its type needs, or an item id twice;
            404 for a reference to an item not stored; 503 where the store fails.
    """
    out = []
    for i, it in enumerate(given):
        missing = [f for f in NEEDS.get(it.type, ()) if not getattr(it, f)]
        if missing:
            raise bad_request(f"a {it.type} item needs {' and '.join(missing)}",
                              f"items[{i}].{missing[0]}")
        if it.type == "item_reference":
            found = await door.stored(door.store.item, str(it.id), owner)
            if found is None:
                raise not_found("item", str(it.id), f"items[{i}].id", "item_not_found")
            out.append(found)
        else:
            out.append(wire_item(it))
    dup = first_duplicate(out)
    if dup is not None:
        raise bad_request(f"Duplicate item found with id {dup}.", "items")
    return out


def router(door: Door) -> APIRouter:
    api = APIRouter()

    def store() -> Store:
        if door.store is None:
            raise not_found("conversation", "", None, "conversation_not_found")
        return door.store

    async def conversation(cid: str, owner: str) -> dict[str, Any]:
        got = await door.stored(store().conversation, cid, owner)
        if got is None:
            raise not_found("conversation", cid, None, "conversation_not_found")
        return got

    async def answer(work: Any) -> Response:
        try:
            return JSONResponse(await work())
        except SpecdecError as e:
            return error(e)

    @api.post(PREFIX, response_model=None, responses=ERRORS)
    async def create(http: Request) -> Response:
        async def work() -> dict[str, Any]:
            body = await door.parse(http, NewConversation, admit=False)
            s = store()
            items = await items_of(body.items, door, owner_of(http))
            return await door.stored(s.new_conversation, f"conv_{uuid.uuid4().hex}",
                                     body.metadata or {}, items, owner_of(http))
        return await answer(work)

    @api.get(PREFIX + "/{cid}", response_model=None, responses=ERRORS)
    async def retrieve(cid: str, http: Request) -> Response:
        async def work() -> dict[str, Any]:
            return await conversation(cid, owner_of(http))
        return await answer(work)

    @api.post(PREFIX + "/{cid}", response_model=None, responses=ERRORS)
    async def update(cid: str, http: Request) -> Response:
        async def work() -> dict[str, Any]:
            body = await door.parse(http, Update, admit=False)
            got = await door.stored(store().update_conversation, cid, body.metadata,
                                    owner_of(http))
            if got is None:
                raise not_found("conversation", cid, None, "conversation_not_found")
            return got
        return await answer(work)

    @api.delete(PREFIX + "/{cid}", response_model=None, responses=ERRORS)
    async def delete(cid: str, http: Request) -> Response:
        async def work() -> dict[str, Any]:
            if not await door.stored(store().delete_conversation, cid, owner_of(http)):
                raise not_found("conversation", cid, None, "conversation_not_found")
            return {"id": cid, "object": "conversation.deleted", "deleted": True}
        return await answer(work)

    async def listed(cid: str, owner: str) -> list[Item]:
        got = await door.stored(store().conversation_items, cid, owner)
        if got is None:
            raise not_found("conversation", cid, None, "conversation_not_found")
        return got

    @api.get(PREFIX + "/{cid}/items", response_model=None, responses=ERRORS)
    async def list_items(cid: str, http: Request, after: str | None = None,
                         limit: int = Query(20, ge=1, le=100),
                         order: str = Query("desc", pattern="^(asc|desc)$")) -> Response:
        async def work() -> dict[str, Any]:
            got = page(await listed(cid, owner_of(http)), after, limit, order)
            if got is None:
                raise bad_request(f"after: no item {after!r} in this conversation", "after")
            return got.wire()
        return await answer(work)

    @api.post(PREFIX + "/{cid}/items", response_model=None, responses=ERRORS)
    async def add_items(cid: str, http: Request) -> Response:
        async def work() -> dict[str, Any]:
            body = await door.parse(http, NewItems, admit=False)
            owner = owner_of(http)
            await conversation(cid, owner)
            items = await items_of(body.items, door, owner)
            async with door.conversation_turn(cid, door.config.request_timeout_s):
                if not await door.stored(store().add_items, cid, items, owner):
                    raise not_found("conversation", cid, None, "conversation_not_found")
            return page(items, None, len(items), "asc").wire()  # type: ignore[union-attr]
        return await answer(work)

    @api.get(PREFIX + "/{cid}/items/{item_id}", response_model=None, responses=ERRORS)
    async def item(cid: str, item_id: str, http: Request) -> Response:
        async def work() -> dict[str, Any]:
            got = next((it for it in await listed(cid, owner_of(http))
                        if it["id"] == item_id), None)
            if got is None:
                raise not_found("item", item_id, None, "item_not_found")
            return got
        return await answer(work)

    @api.delete(PREFIX + "/{cid}/items/{item_id}", response_model=None, responses=ERRORS)
    async def delete_item(cid: str, item_id: str, http: Request) -> Response:
        async def work() -> dict[str, Any]:
            owner = owner_of(http)
            found = await conversation(cid, owner)
            if not await door.stored(store().delete_item, cid, item_id, owner):
                raise not_found("item", item_id, None, "item_not_found")
            return found
        return await answer(work)

    return api
