"""Agent loops of real client libraries against the real server (`specdec serve` on
loopback, with an API key), each run to its final answer: the openai SDK (plain and
streamed), langchain-openai, pydantic-ai (function tools, and an output tool's validation
retry), the openai-agents SDK (Chat Completions and Responses models), instructor's
`Mode.TOOLS` re-ask and anthropic's Messages API.

The embedded 135M model calls a tool reliably after a few-shot history (two earlier
question -> call -> result -> answer turns), so each loop starts from one, written in the
framework's own message types; greedy decoding throughout. Every loop checks that the call
happened with schema-valid arguments, that the tool function ran, that its result reached
the server in the next request (recorded off the wire by HTTP client event hooks), and that the
loop ended with a final answer.

Each library also makes one capped call: a structured answer or a forced call whose budget
is above its minimum but short enough that the budget closes it (a "length" ending, with
`specdec.budget_steered` > 0, read off the wire). Where the library accepts a "length" ending
that carries a complete document, its own path parses it; where it refuses one by design, the
test shows the complete answer is in what the library hands the user (its exception), or,
where the exception carries no answer (openai-agents' Responses model), off the wire."""

from __future__ import annotations

import json
from typing import Any

import anthropic
import httpx2
import jsonschema
import openai
import pytest
from pydantic import BaseModel, ConfigDict, Field, field_validator

from tests.serverproc import Server

KEY = "agents-key"
MAX_TOKENS = 80  # a call's markup costs ~30 tokens
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}},
          "required": ["city"], "additionalProperties": False}
DESCRIPTION = "The weather in a city"
TOOL = {"type": "function", "function": {"name": "get_weather", "description": DESCRIPTION,
                                         "parameters": SCHEMA}}
SHOTS = (("Paris", "sunny"), ("Rome", "rainy"))  # the few-shot turns: city, tool result
ASK = "What is the weather in London?"
WEATHER = {"London": "cloudy"}
RECIPE_ASK = "Describe a pancake recipe in detail."  # the model lists steps until it is stopped
CAPPED_ANSWER = 24  # tokens; a Recipe answer's minimum is 12
CAPPED_CALL = 40  # a forced Recipe call's is ~30 (its markup's and the schema's)


class Wire:
    """The JSON bodies a client sent and got, by event hooks on its HTTP client (httpx2, the
    SDKs' transport): what the server got and answered. A response is read whole in its hook
    (the client then reads it from memory); a stream is kept as its events' JSON objects."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.responses: list[dict[str, Any] | list[dict[str, Any]]] = []

    def _record(self, request: httpx2.Request) -> None:
        self.bodies.append(json.loads(request.content))

    async def _arecord(self, request: httpx2.Request) -> None:
        self._record(request)

    def _keep(self, response: httpx2.Response) -> None:
        if response.headers.get("content-type", "").startswith("text/event-stream"):
            self.responses.append([json.loads(line[5:]) for line in response.text.splitlines()
                                   if line.startswith("data:") and line[5:].strip() != "[DONE]"])
        else:
            self.responses.append(response.json())

    def _answer(self, response: httpx2.Response) -> None:
        response.read()
        self._keep(response)

    async def _aanswer(self, response: httpx2.Response) -> None:
        await response.aread()
        self._keep(response)

    def sync(self) -> httpx2.Client:
        return httpx2.Client(event_hooks={"request": [self._record], "response": [self._answer]},
                             timeout=300)

    def asynchronous(self) -> httpx2.AsyncClient:
        return httpx2.AsyncClient(event_hooks={"request": [self._arecord],
                                               "response": [self._aanswer]}, timeout=300)


class Weather:
    """The tool: answers from WEATHER and remembers each city it was asked about."""

    def __init__(self) -> None:
        self.asked: list[str] = []

    def __call__(self, city: str) -> str:
        self.asked.append(city)
        return WEATHER.get(city, "unknown")


def chat_history() -> list[dict[str, Any]]:
    """The few-shot turns as Chat Completions messages, then the question."""
    out: list[dict[str, Any]] = []
    for i, (city, sky) in enumerate(SHOTS):
        out += [{"role": "user", "content": f"What is the weather in {city}?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": f"call_{i}", "type": "function", "function": {
                        "name": "get_weather", "arguments": json.dumps({"city": city})}}]},
                {"role": "tool", "tool_call_id": f"call_{i}", "content": sky},
                {"role": "assistant", "content": f"It is {sky} in {city}."}]
    return out + [{"role": "user", "content": ASK}]


def assert_answer(text: str | None) -> None:
    assert text and text.strip()
    assert "cloudy" in text.lower()  # the model used the tool's result


class Recipe(BaseModel):
    """A recipe."""

    title: str
    steps: list[str]


def assert_budget_closed(wire: Wire) -> None:
    """The last response off the wire ended because the budget closed its document: the API's
    own "length" ending, and the tokens the budget chose counted in `specdec.budget_steered`."""
    got = wire.responses[-1]
    if isinstance(got, list):  # a Chat Completions stream's chunks
        finish = [c["finish_reason"] for e in got for c in e.get("choices", ())
                  if c.get("finish_reason")]
        assert finish == ["length"]
        (ext,) = [e["specdec"] for e in got if "specdec" in e]
    else:
        if "choices" in got:
            assert got["choices"][0]["finish_reason"] == "length"
        elif "status" in got:  # Responses
            assert got["status"] == "incomplete"
            assert got["incomplete_details"] == {"reason": "max_output_tokens"}
        else:  # Messages
            assert got["stop_reason"] == "max_tokens"
        ext = got["specdec"]
    assert ext["budget_steered"] > 0


def chat_tool_result(body: dict[str, Any], call_id: str) -> str:
    """The content of the `tool` message answering `call_id` in a chat request body,
    which also holds the assistant turn that made the call."""
    msgs = body["messages"]
    assert any(c["id"] == call_id for m in msgs if m["role"] == "assistant"
               for c in m.get("tool_calls") or ())
    (result,) = [m for m in msgs if m["role"] == "tool" and m["tool_call_id"] == call_id]
    return result["content"] if isinstance(result["content"], str) else \
        "".join(p["text"] for p in result["content"])


@pytest.fixture(scope="module")
def server_args():
    return ("--num-draft-tokens", "4", "--api-key", KEY)


@pytest.fixture
def wire() -> Wire:
    return Wire()


@pytest.fixture
def weather() -> Weather:
    return Weather()


def openai_client(server: Server, wire: Wire) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0,
                         http_client=wire.sync())


def async_openai_client(server: Server, wire: Wire) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0,
                              http_client=wire.asynchronous())


# 1. The openai SDK: the loop by hand, tool_choice omitted (auto with tools).

def test_openai_two_turn_loop_with_tool_choice_omitted(server, wire, weather):
    client = openai_client(server, wire)
    messages = chat_history()
    r = client.chat.completions.create(model="default", messages=messages, tools=[TOOL],
                                       temperature=0, max_tokens=MAX_TOKENS)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, SCHEMA)
    messages.append(choice.message.model_dump(exclude_none=True))
    messages.append({"role": "tool", "tool_call_id": call.id, "content": weather(**args)})
    assert weather.asked == ["London"]

    r = client.chat.completions.create(model="default", messages=messages, tools=[TOOL],
                                       temperature=0, max_tokens=MAX_TOKENS)
    assert r.choices[0].finish_reason == "stop" and not r.choices[0].message.tool_calls
    assert_answer(r.choices[0].message.content)
    assert [("tool_choice" in b) for b in wire.bodies] == [False, False]
    assert chat_tool_result(wire.bodies[1], call.id) == "cloudy"


def test_openai_streamed_loop_accumulates_call_deltas_by_index(server, wire, weather):
    client = openai_client(server, wire)
    messages = chat_history()
    calls: dict[int, dict[str, Any]] = {}
    finish = None
    stream = client.chat.completions.create(model="default", messages=messages, tools=[TOOL],
                                            temperature=0, max_tokens=MAX_TOKENS, stream=True)
    for chunk in stream:
        if not chunk.choices:
            continue
        delta, finish = chunk.choices[0].delta, chunk.choices[0].finish_reason or finish
        for tc in delta.tool_calls or ():
            assert delta.content is None  # a call's chunks carry no text
            if tc.index not in calls:  # the first delta of a call names it
                assert tc.id and tc.type == "function" and tc.function.name
                calls[tc.index] = {"id": tc.id, "name": tc.function.name, "arguments": ""}
            else:
                assert tc.id is None and not tc.function.name
            calls[tc.index]["arguments"] += tc.function.arguments or ""
    assert finish == "tool_calls"
    assert list(calls) == [0] and calls[0]["name"] == "get_weather"
    args = json.loads(calls[0]["arguments"])
    jsonschema.validate(args, SCHEMA)
    messages.append({"role": "assistant", "content": None, "tool_calls": [
        {"id": c["id"], "type": "function",
         "function": {"name": c["name"], "arguments": c["arguments"]}} for c in calls.values()]})
    messages.append({"role": "tool", "tool_call_id": calls[0]["id"], "content": weather(**args)})

    text, finish = "", None
    for chunk in client.chat.completions.create(model="default", messages=messages,
                                                tools=[TOOL], temperature=0,
                                                max_tokens=MAX_TOKENS, stream=True):
        if chunk.choices:
            assert not chunk.choices[0].delta.tool_calls
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
    assert finish == "stop" and weather.asked == ["London"]
    assert_answer(text)
    assert chat_tool_result(wire.bodies[1], calls[0]["id"]) == "cloudy"


def test_openai_parse_refuses_a_capped_answer_its_completion_holds(server, wire):
    # `.parse()` raises LengthFinishReasonError on any "length" ending, before parsing; the
    # exception's `.completion` holds the complete answer, which the response model
    # validates as `.parse()` would have (pydantic's `model_validate_json`).
    client = openai_client(server, wire)
    with pytest.raises(openai.LengthFinishReasonError) as e:
        client.chat.completions.parse(
            model="default", messages=[{"role": "user", "content": RECIPE_ASK}],
            response_format=Recipe, temperature=0, max_tokens=CAPPED_ANSWER)
    assert_budget_closed(wire)
    assert len(wire.bodies) == 1
    assert e.value.completion.choices[0].finish_reason == "length"
    Recipe.model_validate_json(e.value.completion.choices[0].message.content)


def test_openai_stream_refuses_a_capped_answer_its_snapshot_holds(server, wire):
    # `.stream()` raises the same error at the "length" chunk; its `.completion` is the
    # snapshot accumulated from the deltas, the complete answer. (The usage chunk carries
    # the stream's `specdec` extension.)
    client = openai_client(server, wire)
    deltas: list[str] = []
    with pytest.raises(openai.LengthFinishReasonError) as e:
        with client.chat.completions.stream(
                model="default", messages=[{"role": "user", "content": RECIPE_ASK}],
                response_format=Recipe, temperature=0, max_tokens=CAPPED_ANSWER,
                stream_options={"include_usage": True}) as stream:
            for event in stream:
                if event.type == "content.delta":
                    deltas.append(event.delta)
    assert_budget_closed(wire)
    content = e.value.completion.choices[0].message.content
    assert content == "".join(deltas)
    Recipe.model_validate_json(content)


# 2. langchain-openai: bind_tools + ToolMessage loop.

def langchain_llm(server: Server, wire: Wire, tool: Any) -> Any:
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(base_url=server.url + "/v1", api_key=KEY, model="default",
                      temperature=0, max_tokens=MAX_TOKENS, max_retries=0,
                      http_client=wire.sync()).bind_tools([tool])


def test_langchain_bind_tools_loop_to_the_final_message(server, wire, weather):
    from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
    from langchain_core.tools import tool

    @tool
    def get_weather(city: str) -> str:
        """The weather in a city"""
        return weather(city)

    llm = langchain_llm(server, wire, get_weather)
    messages: list[Any] = []
    for i, (city, sky) in enumerate(SHOTS):
        messages += [HumanMessage(f"What is the weather in {city}?"),
                     AIMessage("", tool_calls=[{"name": "get_weather", "args": {"city": city},
                                                "id": f"call_{i}"}]),
                     ToolMessage(sky, tool_call_id=f"call_{i}"),
                     AIMessage(f"It is {sky} in {city}.")]
    messages.append(HumanMessage(ASK))
    for _ in range(3):
        ai = llm.invoke(messages)
        messages.append(ai)
        if not ai.tool_calls:
            break
        for tc in ai.tool_calls:
            jsonschema.validate(tc["args"], SCHEMA)
            messages.append(ToolMessage(get_weather.invoke(tc["args"]), tool_call_id=tc["id"]))
    assert weather.asked == ["London"] and len(wire.bodies) == 2
    call_id = messages[-3].tool_calls[0]["id"]
    assert isinstance(messages[-1], AIMessage) and not messages[-1].tool_calls
    assert messages[-1].response_metadata["finish_reason"] == "stop"
    assert_answer(messages[-1].content)
    assert chat_tool_result(wire.bodies[1], call_id) == "cloudy"


def test_langchain_structured_output_refuses_a_capped_answer_its_error_holds(server, wire):
    # ChatOpenAI.with_structured_output's default method ("json_schema") goes through the
    # openai SDK's `.parse()`, whose LengthFinishReasonError reaches the caller as it is; its
    # `.completion` holds the complete answer. (method="function_calling" parses a forced
    # call's arguments whatever the finish.)
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url=server.url + "/v1", api_key=KEY, model="default",
                     temperature=0, max_tokens=CAPPED_ANSWER, max_retries=0,
                     http_client=wire.sync())
    with pytest.raises(openai.LengthFinishReasonError) as e:
        llm.with_structured_output(Recipe).invoke(RECIPE_ASK)
    assert_budget_closed(wire)
    assert len(wire.bodies) == 1
    assert wire.bodies[0]["response_format"]["type"] == "json_schema"
    Recipe.model_validate_json(e.value.completion.choices[0].message.content)


# 3. pydantic-ai: a function tool to the final text; an output tool's validation retry.

def pydantic_ai_model(server: Server, wire: Wire) -> Any:
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    return OpenAIChatModel("default", provider=OpenAIProvider(
        base_url=server.url + "/v1", api_key=KEY, http_client=wire.asynchronous()))


def test_pydantic_ai_agent_calls_the_tool_and_answers(server, wire, weather):
    from pydantic_ai import Agent
    from pydantic_ai.messages import (ModelRequest, ModelResponse, TextPart, ToolCallPart,
                                      ToolReturnPart, UserPromptPart)

    def get_weather(city: str) -> str:
        """The weather in a city"""
        return weather(city)

    agent = Agent(pydantic_ai_model(server, wire), output_type=str, tools=[get_weather],
                  model_settings={"temperature": 0, "max_tokens": MAX_TOKENS})
    history: list[Any] = []
    for i, (city, sky) in enumerate(SHOTS):
        history += [ModelRequest(parts=[UserPromptPart(f"What is the weather in {city}?")]),
                    ModelResponse(parts=[ToolCallPart("get_weather", {"city": city},
                                                      f"call_{i}")]),
                    ModelRequest(parts=[ToolReturnPart("get_weather", sky, f"call_{i}")]),
                    ModelResponse(parts=[TextPart(f"It is {sky} in {city}.")])]
    result = agent.run_sync(ASK, message_history=history)
    assert weather.asked == ["London"]
    _, called, returned, answered = result.new_messages()
    (call,) = called.parts
    assert isinstance(call, ToolCallPart) and call.tool_name == "get_weather"
    jsonschema.validate(call.args_as_dict(), SCHEMA)
    (ret,) = returned.parts
    assert isinstance(ret, ToolReturnPart) and ret.content == "cloudy"
    assert ret.tool_call_id == call.tool_call_id
    assert answered.finish_reason == "stop"
    assert_answer(result.output)
    assert len(wire.bodies) == 2 and wire.bodies[0]["tool_choice"] == "auto"
    assert chat_tool_result(wire.bodies[1], call.tool_call_id) == "cloudy"


class Forecast(BaseModel):
    model_config = ConfigDict(extra="forbid")
    city: str = Field(max_length=20)
    sky: str = Field(max_length=20)


def test_pydantic_ai_output_tool_validation_retry_is_served(server, wire):
    from pydantic_ai import Agent, ModelRetry
    from pydantic_ai.messages import RetryPromptPart, ToolCallPart, ToolReturnPart

    agent = Agent(pydantic_ai_model(server, wire), output_type=Forecast,
                  instructions="Give the forecast.",
                  model_settings={"temperature": 0, "max_tokens": MAX_TOKENS,
                                  "parallel_tool_calls": False})
    checked: list[Forecast] = []

    @agent.output_validator
    def once(out: Forecast) -> Forecast:
        checked.append(out)
        if len(checked) == 1:
            raise ModelRetry("Give the forecast again.")
        return out

    result = agent.run_sync("The forecast for London is cloudy.")
    assert isinstance(result.output, Forecast) and result.output.city
    assert len(checked) == 2 and len(wire.bodies) == 2
    assert [b["tool_choice"] for b in wire.bodies] == ["required", "required"]
    schema = wire.bodies[0]["tools"][0]["function"]["parameters"]
    calls = [p for m in result.all_messages() for p in m.parts if isinstance(p, ToolCallPart)]
    assert [c.tool_name for c in calls] == ["final_result", "final_result"]
    for c in calls:
        jsonschema.validate(c.args_as_dict(), schema)
    # The re-ask answers the first call: a RetryPromptPart, or (pydantic-ai >= 2.6x) that
    # call's own ToolReturnPart with outcome "retried".
    (retry,) = [p for m in result.all_messages() for p in m.parts
                if isinstance(p, RetryPromptPart) or (
                    isinstance(p, ToolReturnPart) and getattr(p, "outcome", "") == "retried")]
    assert retry.tool_call_id == calls[0].tool_call_id
    assert "Give the forecast again." in chat_tool_result(wire.bodies[1], calls[0].tool_call_id)


def test_pydantic_ai_output_tool_takes_a_capped_call(server, wire):
    # pydantic-ai refuses a "length" ending only where the output was cut (IncompleteToolCall
    # for arguments that do not parse, OutputTokenLimitExceeded for cut JSON text or no
    # output); a complete output tool call is the run's output.
    from pydantic_ai import Agent
    from pydantic_ai.messages import ModelResponse

    agent = Agent(pydantic_ai_model(server, wire), output_type=Recipe,
                  model_settings={"temperature": 0, "max_tokens": CAPPED_CALL})
    result = agent.run_sync(RECIPE_ASK)
    assert isinstance(result.output, Recipe)
    assert_budget_closed(wire)
    assert len(wire.bodies) == 1 and wire.bodies[0]["tool_choice"] == "required"
    (response,) = [m for m in result.all_messages() if isinstance(m, ModelResponse)]
    assert response.finish_reason == "length"


# 4. openai-agents: a function tool on the Chat Completions and the Responses model.

def weather_agent(server: Server, wire: Wire, weather: Weather, model_cls: Any) -> Any:
    """The Agents SDK's agent with the weather function tool, on `model_cls` (its Chat
    Completions or Responses model), greedy."""
    from agents import Agent, FunctionTool, ModelSettings, set_tracing_disabled

    set_tracing_disabled(True)

    async def invoke(ctx: Any, arguments: str) -> str:
        args = json.loads(arguments)
        jsonschema.validate(args, SCHEMA)
        return weather(**args)

    # The schema as given (function_tool's would add pydantic's titles, which this tiny
    # model reads as a cue to write a tool response itself instead of a call).
    tool = FunctionTool(name="get_weather", description=DESCRIPTION, params_json_schema=SCHEMA,
                        on_invoke_tool=invoke)
    return Agent(name="weather", tools=[tool],
                 model=model_cls(model="default", openai_client=async_openai_client(server, wire)),
                 model_settings=ModelSettings(temperature=0, max_tokens=MAX_TOKENS))


def agents_history() -> list[dict[str, Any]]:
    """The few-shot turns as the Agents SDK's Responses input items."""
    items: list[dict[str, Any]] = []
    for i, (city, sky) in enumerate(SHOTS):
        items += [{"role": "user", "content": f"What is the weather in {city}?"},
                  {"type": "function_call", "call_id": f"call_{i}", "name": "get_weather",
                   "arguments": json.dumps({"city": city})},
                  {"type": "function_call_output", "call_id": f"call_{i}", "output": sky},
                  {"role": "assistant", "content": f"It is {sky} in {city}."}]
    return items


@pytest.mark.parametrize("api", ["chat", "responses"])
def test_openai_agents_function_tool_to_final_output(server, wire, weather, api):
    from agents import OpenAIChatCompletionsModel, OpenAIResponsesModel, Runner
    from agents.items import MessageOutputItem, ToolCallItem, ToolCallOutputItem

    model_cls = OpenAIChatCompletionsModel if api == "chat" else OpenAIResponsesModel
    agent = weather_agent(server, wire, weather, model_cls)
    items = agents_history()
    result = Runner.run_sync(agent, items + [{"role": "user", "content": ASK}], max_turns=4)
    assert weather.asked == ["London"]
    assert [type(i) for i in result.new_items] == [ToolCallItem, ToolCallOutputItem,
                                                   MessageOutputItem]
    call = result.new_items[0].raw_item
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "London"}
    assert result.new_items[1].output == "cloudy"
    assert_answer(result.final_output)
    assert len(wire.bodies) == 2
    if api == "chat":
        assert chat_tool_result(wire.bodies[1], call.call_id) == "cloudy"
    else:
        sent = [i for i in wire.bodies[1]["input"] if i.get("call_id") == call.call_id]
        assert [i["type"] for i in sent] == ["function_call", "function_call_output"]
        assert sent[1]["output"] == "cloudy"


def test_openai_agents_loop_by_previous_response_id(server, wire, weather):
    # The Agents SDK chaining turns by id (`auto_previous_response_id`): after the first
    # request, each sends only its new items (the tool's result; then the next question, in
    # a second run by `previous_response_id`) and the server continues the stored response.
    from agents import OpenAIResponsesModel, Runner
    from agents.items import MessageOutputItem, ToolCallItem, ToolCallOutputItem

    agent = weather_agent(server, wire, weather, OpenAIResponsesModel)
    items = agents_history()
    result = Runner.run_sync(agent, items + [{"role": "user", "content": ASK}], max_turns=4,
                             auto_previous_response_id=True)
    assert weather.asked == ["London"]
    assert [type(i) for i in result.new_items] == [ToolCallItem, ToolCallOutputItem,
                                                   MessageOutputItem]
    assert_answer(result.final_output)
    first, second = wire.bodies
    first_id = wire.responses[0]["id"]
    assert second["previous_response_id"] == first_id
    assert [i.get("type") for i in second["input"]] == ["function_call_output"]
    assert second["input"][0]["output"] == "cloudy"
    # a second run continues the first by its last response's id
    again = Runner.run_sync(agent, "And what should I wear there?", max_turns=2,
                            previous_response_id=result.last_response_id)
    assert again.final_output
    third = wire.bodies[2]
    assert third["previous_response_id"] == result.last_response_id
    assert [i["content"] for i in third["input"]] == ["And what should I wear there?"]


@pytest.mark.parametrize("api", ["chat", "responses"])
def test_openai_agents_capped_output(server, wire, api):
    # The Chat Completions model takes a "length" ending that carries content (it refuses
    # only an empty one) and the output schema validates it. The Responses model raises
    # ModelBehaviorError on any `incomplete` response, whose message carries only the status
    # and details: the answer is not in what the SDK hands back, only off the wire, where
    # the same output schema validates it.
    from agents import (Agent, ModelSettings, OpenAIChatCompletionsModel, OpenAIResponsesModel,
                        Runner, set_tracing_disabled)
    from agents.agent_output import AgentOutputSchema
    from agents.exceptions import ModelBehaviorError

    set_tracing_disabled(True)
    model_cls = OpenAIChatCompletionsModel if api == "chat" else OpenAIResponsesModel
    agent = Agent(name="cook", output_type=Recipe,
                  model=model_cls(model="default", openai_client=async_openai_client(server, wire)),
                  model_settings=ModelSettings(temperature=0, max_tokens=CAPPED_ANSWER))
    if api == "chat":
        result = Runner.run_sync(agent, RECIPE_ASK, max_turns=1)
        assert isinstance(result.final_output, Recipe)
    else:
        with pytest.raises(ModelBehaviorError, match="status=incomplete"):
            Runner.run_sync(agent, RECIPE_ASK, max_turns=1)
        (text,) = [p["text"] for item in wire.responses[-1]["output"]
                   for p in item.get("content") or () if p["type"] == "output_text"]
        assert isinstance(AgentOutputSchema(Recipe).validate_json(text), Recipe)
    assert_budget_closed(wire)
    assert len(wire.bodies) == 1


# 5. instructor: Mode.TOOLS with a validation re-ask.

def test_instructor_tools_mode_reasks_after_a_validation_error(server, wire):
    import instructor

    seen: list[str] = []

    class Report(BaseModel):
        city: str = Field(max_length=20)
        sky: str = Field(max_length=20)

        @field_validator("sky")
        @classmethod
        def not_the_first(cls, v: str) -> str:
            seen.append(v)
            if len(seen) == 1:
                raise ValueError("name the sky again")
            return v

    client = instructor.from_openai(openai_client(server, wire), mode=instructor.Mode.TOOLS)
    report = client.chat.completions.create(
        model="default", response_model=Report, max_retries=2, temperature=0,
        max_tokens=MAX_TOKENS,
        messages=[{"role": "user", "content": "The forecast for London is cloudy."}])
    assert isinstance(report, Report) and report.city and len(seen) == 2
    assert len(wire.bodies) == 2
    assert [b["tool_choice"] for b in wire.bodies] == [
        {"type": "function", "function": {"name": "Report"}}] * 2
    schema = wire.bodies[0]["tools"][0]["function"]["parameters"]
    (asked,) = [m for m in wire.bodies[1]["messages"] if m["role"] == "assistant"]
    (call,) = asked["tool_calls"]
    jsonschema.validate(json.loads(call["function"]["arguments"]), schema)
    reask = chat_tool_result(wire.bodies[1], call["id"])
    assert "name the sky again" in reask


def test_instructor_refuses_a_capped_call_its_exception_holds(server, wire):
    # instructor raises IncompleteOutputException on any "length" ending, before parsing and
    # without a re-ask; its `last_completion` holds the complete call, whose arguments the
    # response model validates.
    import instructor
    from instructor.core import IncompleteOutputException

    client = instructor.from_openai(openai_client(server, wire), mode=instructor.Mode.TOOLS)
    with pytest.raises(IncompleteOutputException) as e:
        client.chat.completions.create(
            model="default", response_model=Recipe, max_retries=2, temperature=0,
            max_tokens=CAPPED_CALL, messages=[{"role": "user", "content": RECIPE_ASK}])
    assert_budget_closed(wire)
    assert len(wire.bodies) == 1
    (call,) = e.value.last_completion.choices[0].message.tool_calls
    assert call.function.name == "Recipe"
    Recipe.model_validate_json(call.function.arguments)


# 6. anthropic: tools, tool_choice auto, a tool_result turn.

def test_anthropic_tool_use_then_tool_result_to_the_final_text(server, wire, weather):
    client = anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0,
                                 http_client=wire.sync())
    tool = {"name": "get_weather", "description": DESCRIPTION, "input_schema": SCHEMA}
    messages: list[dict[str, Any]] = []
    for i, (city, sky) in enumerate(SHOTS):
        messages += [{"role": "user", "content": f"What is the weather in {city}?"},
                     {"role": "assistant", "content": [{"type": "tool_use", "id": f"toolu_{i}",
                                                        "name": "get_weather",
                                                        "input": {"city": city}}]},
                     {"role": "user", "content": [{"type": "tool_result",
                                                   "tool_use_id": f"toolu_{i}",
                                                   "content": sky}]},
                     {"role": "assistant", "content": f"It is {sky} in {city}."}]
    messages.append({"role": "user", "content": ASK})

    def create() -> anthropic.types.Message:
        return client.messages.create(model="default", max_tokens=MAX_TOKENS, messages=messages,
                                      tools=[tool], tool_choice={"type": "auto"},
                                      extra_body={"temperature": 0})

    m = create()
    assert m.stop_reason == "tool_use"
    (use,) = [b for b in m.content if b.type == "tool_use"]
    assert use.name == "get_weather" and use.id
    jsonschema.validate(use.input, SCHEMA)
    messages += [{"role": "assistant", "content": [b.model_dump(exclude_none=True)
                                                   for b in m.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                               "content": weather(**use.input)}]}]
    m = create()
    assert m.stop_reason == "end_turn" and [b.type for b in m.content] == ["text"]
    assert_answer(m.content[0].text)
    assert weather.asked == ["London"]
    sent = wire.bodies[1]["messages"]
    assert sent[-2]["content"][-1]["id"] == use.id
    assert sent[-1]["content"] == [{"type": "tool_result", "tool_use_id": use.id,
                                    "content": "cloudy"}]


def test_anthropic_parse_takes_a_capped_answer(server, wire):
    # messages.parse validates the text against `output_format` whatever the stop_reason.
    client = anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0,
                                 http_client=wire.sync())
    msg = client.messages.parse(model="default", max_tokens=CAPPED_ANSWER, output_format=Recipe,
                                messages=[{"role": "user", "content": RECIPE_ASK}],
                                extra_body={"temperature": 0})
    assert msg.stop_reason == "max_tokens"
    assert isinstance(msg.parsed_output, Recipe)
    assert_budget_closed(wire)
