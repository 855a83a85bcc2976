#!/usr/bin/env python3
"""Structured outputs and tool calls end to end (issue 32), with the stock
`openai` SDK and LangChain's `ChatOpenAI`, against a live gateway:

    python3 scripts/test_structured.py --base-url http://127.0.0.1:PORT/v1
    python3 scripts/test_structured.py --base-url http://127.0.0.1:PROXY/v1 --expect-verified

- the schema suite (scripts/data/structured_schemas.py, 33 schemas): each
  answer, whole and streamed, parses and validates (`jsonschema`), the
  stream equals the whole answer, and the greedy answer under the schema
  equals the unconstrained greedy answer whenever that one already validates;
- `json_object`, the SDK's `chat.completions.parse(response_format=Model)`;
- tools under each `tool_choice`, a streamed call reassembled by the SDK's
  stream helper, a whole tool loop (call, `tool` message, answer);
- LangChain: `with_structured_output(Model)` and `bind_tools` with a loop;
- 400s naming the field for what cannot be used, and hostile schemas that
  are refused or answered, never hung.

--quick runs every fifth schema of the suite (the proxy pass of
scripts/test.sh, where the whole suite already ran directly).
Prints one line per check and "N passed, M failed"; exits non-zero on any
failure.
"""
import argparse
import json
import os
import sys
import time

import jsonschema
import openai
from openai import OpenAI
from pydantic import BaseModel

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "data"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from structured_schemas import SCHEMAS  # noqa: E402
from test_openai_sdk import COMPLETION_MODEL as MODEL, Checks, check  # noqa: E402

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
                   "required": ["city"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {
    "name": "get_time", "description": "The current time in a time zone.",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 30}},
                   "required": ["zone"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather like in Paris right now?"}]
# A conversation that shows the model JSON answers, so that some unconstrained
# greedy answers already validate (the equality check then has cases).
FEW_SHOT = [
    {"role": "system", "content": "You answer with a single JSON value and nothing else."},
    {"role": "user", "content": "How many days are in a week?"},
    {"role": "assistant", "content": "7"},
    {"role": "user", "content": "Describe a person named Bob aged 20."},
    {"role": "assistant", "content": '{"name": "Bob", "age": 20}'},
    {"role": "user", "content": "List two fruits."},
    {"role": "assistant", "content": '["apple", "pear"]'},
    {"role": "user", "content": "Is water wet?"},
    {"role": "assistant", "content": "true"},
]


class Person(BaseModel):
    name: str
    age: int


def schema_format(name, schema):
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base-url", required=True)
    ap.add_argument("--expect-verified", action="store_true",
                    help="a gateway proxy is in front: answers must say receipt-verified: true")
    ap.add_argument("--quick", action="store_true", help="every fifth schema of the suite")
    ap.add_argument("--max-tokens", type=int, default=200)
    args = ap.parse_args()
    client = OpenAI(base_url=args.base_url, api_key="unused", timeout=300, max_retries=0)
    c = Checks()

    def create(**kw):
        raw = client.chat.completions.with_raw_response.create(model=MODEL, temperature=0, **kw)
        if args.expect_verified:
            v = raw.headers.get("receipt-verified")
            check(v == "true", f"receipt-verified header {v!r}")
        return raw.parse()

    def streamed_text(**kw):
        text, finish = "", None
        for chunk in client.chat.completions.create(model=MODEL, temperature=0, stream=True, **kw):
            for ch in chunk.choices:
                text += ch.delta.content or ""
                finish = ch.finish_reason or finish
        return text, finish

    suite = SCHEMAS[::5] if args.quick else SCHEMAS
    same = {"validating": 0, "equal": 0}

    def schema_case(name, prompt, schema):
        def run():
            msgs = FEW_SHOT + [{"role": "user", "content": prompt}]
            kw = dict(messages=msgs, max_tokens=args.max_tokens)
            r = create(response_format=schema_format(name, schema), **kw)
            ch = r.choices[0]
            check(ch.finish_reason == "stop", f"finish {ch.finish_reason}: {ch.message.content!r}")
            value = json.loads(ch.message.content)
            jsonschema.validate(value, schema)
            text, finish = streamed_text(response_format=schema_format(name, schema), **kw)
            check(text == ch.message.content, f"stream {text!r} != whole {ch.message.content!r}")
            check(finish == "stop", f"stream finish {finish}")
            free = create(**kw).choices[0].message.content
            try:
                jsonschema.validate(json.loads(free), schema)
                same["validating"] += 1
                check(free == ch.message.content,
                      f"unconstrained {free!r} validates but constrained is {ch.message.content!r}")
                same["equal"] += 1
            except (json.JSONDecodeError, jsonschema.ValidationError):
                pass
            return json.dumps(value)[:60]
        return run

    for name, prompt, schema in suite:
        c.run(f"schema {name}: parses, validates, stream == whole", schema_case(name, prompt, schema))
    def equality_has_cases():
        check(args.quick or same["validating"] >= 1,
              "no unconstrained answer validated: the equality check tested nothing")
        return f"unconstrained greedy validated for {same['validating']}; equal: {same['equal']}"

    c.run("greedy under a schema equals unconstrained greedy where that validates",
          equality_has_cases)

    def json_object():
        r = create(messages=[{"role": "user", "content":
                              "Give a JSON object with a cat's name and colour."}],
                   response_format={"type": "json_object"}, max_tokens=args.max_tokens)
        check(r.choices[0].finish_reason == "stop", r.choices[0].finish_reason)
        v = json.loads(r.choices[0].message.content)
        check(isinstance(v, dict), f"not an object: {v!r}")
        return r.choices[0].message.content[:60]

    def completions_extension():
        r = client.completions.create(
            model=MODEL, temperature=0, max_tokens=args.max_tokens,
            prompt='A person as JSON: {"name": "Bob", "age": 20}\nAnother person as JSON:',
            extra_body={"response_format": schema_format("person", SCHEMAS[0][2])})
        check(r.choices[0].finish_reason == "stop", r.choices[0].finish_reason)
        jsonschema.validate(json.loads(r.choices[0].text), SCHEMAS[0][2])
        return r.choices[0].text.strip()[:60]

    def sdk_parse():
        # The GA helper and the beta one that older examples use.
        out = []
        for parse in (client.chat.completions.parse, client.beta.chat.completions.parse):
            r = parse(model=MODEL, temperature=0, max_tokens=args.max_tokens,
                      response_format=Person,
                      messages=[{"role": "user", "content": "Describe a person named Ada aged 36."}])
            p = r.choices[0].message.parsed
            check(isinstance(p, Person), f"parsed {p!r}")
            out.append(repr(p))
        return "; ".join(out)

    def check_call(call, tool):
        check(call.type == "function" and call.id.startswith("call_"), f"call {call}")
        check(call.function.name == tool["function"]["name"], f"name {call.function.name}")
        jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])

    def tool_choice_each():
        seen = []
        for choice in ["none", "auto", "required",
                       {"type": "function", "function": {"name": "get_time"}}]:
            r = create(messages=ASK, tools=[WEATHER, CLOCK], tool_choice=choice, max_tokens=80)
            ch = r.choices[0]
            calls = ch.message.tool_calls or []
            if choice == "none":
                check(not calls and ch.message.content, f"none: {ch.message}")
            elif choice == "auto":
                check(bool(calls) == (ch.finish_reason == "tool_calls"), f"auto: {ch}")
                for call in calls:
                    check_call(call, WEATHER if call.function.name == "get_weather" else CLOCK)
            else:
                check(ch.finish_reason == "tool_calls" and calls, f"{choice}: {ch}")
                check(ch.message.content is None, f"content beside calls: {ch.message.content!r}")
                want = CLOCK if isinstance(choice, dict) else None
                for call in calls:
                    check_call(call, want or (WEATHER if call.function.name == "get_weather"
                                              else CLOCK))
            seen.append(f"{choice if isinstance(choice, str) else 'named'}:"
                        f"{'call' if calls else 'text'}")
        return ", ".join(seen)

    def streamed_call_reassembled():
        kw = dict(model=MODEL, temperature=0, messages=ASK, tools=[WEATHER],
                  tool_choice="required", max_tokens=80)
        with client.chat.completions.stream(**kw) as s:
            final = s.get_final_completion()
        whole = create(**{k: v for k, v in kw.items() if k not in ("model", "temperature")})
        got, want = final.choices[0].message.tool_calls, whole.choices[0].message.tool_calls
        check(len(got) == len(want) >= 1, f"{len(got)} calls streamed, {len(want)} whole")
        for a, b in zip(got, want):
            # Ids differ (each response has its own receipt id); the calls do not.
            check(a.id.startswith("call_") and a.id != b.id, f"ids {a.id} {b.id}")
            check((a.function.name, a.function.arguments) == (b.function.name,
                                                              b.function.arguments),
                  f"streamed {a} != whole {b}")
        check(final.choices[0].finish_reason == "tool_calls", final.choices[0].finish_reason)
        return got[0].function.arguments

    def calls_with_stop_sequences():
        # A stop sequence may cut the call syntax: the stream must still say
        # exactly what the whole answer says (text or calls, finish reason).
        out = []
        # '", "arg' cuts right after a complete name: a stream that sent the
        # call's header before the cut would disagree with the whole answer.
        for stop in (['"}'], ["</tool_call>"], ["\n"], ["get_"], ['", "arg']):
            kw = dict(messages=ASK, tools=[WEATHER], tool_choice="required", max_tokens=60,
                      stop=stop)
            whole = create(**kw).choices[0]
            content, calls, finish = "", {}, None
            for chunk in client.chat.completions.create(model=MODEL, temperature=0, stream=True,
                                                        **kw):
                for ch in chunk.choices:
                    content += ch.delta.content or ""
                    for d in ch.delta.tool_calls or []:
                        c = calls.setdefault(d.index, ["", ""])
                        c[0] += (d.function.name or "") if d.function else ""
                        c[1] += (d.function.arguments or "") if d.function else ""
                    finish = ch.finish_reason or finish
            want = [[t.function.name, t.function.arguments]
                    for t in whole.message.tool_calls or []]
            check([calls[i] for i in sorted(calls)] == want, f"{stop}: {calls} != {want}")
            check(content == (whole.message.content or ""),
                  f"{stop}: content {content!r} != {whole.message.content!r}")
            check(finish == whole.finish_reason, f"{stop}: {finish} != {whole.finish_reason}")
            for name, args in want:
                if whole.finish_reason == "tool_calls":
                    json.loads(args)
            out.append(f"{stop[0]!r}:{whole.finish_reason}")
        return ", ".join(out)

    def tool_loop():
        r = create(messages=ASK, tools=[WEATHER], tool_choice="required", max_tokens=80)
        msg = r.choices[0].message
        call = msg.tool_calls[0]
        history = ASK + [msg.model_dump(exclude_none=True),
                         {"role": "tool", "tool_call_id": call.id,
                          "content": json.dumps({"temperature_c": 21, "sky": "clear"})}]
        r2 = create(messages=history, tools=[WEATHER], tool_choice="none", max_tokens=40)
        ch = r2.choices[0]
        check(ch.message.content and not ch.message.tool_calls, f"answer {ch.message}")
        check(ch.finish_reason in ("stop", "length"), ch.finish_reason)
        return repr(ch.message.content[:60])

    def langchain_structured_and_tools():
        from langchain_core.messages import HumanMessage, ToolMessage
        from langchain_core.tools import tool
        from langchain_openai import ChatOpenAI

        llm = ChatOpenAI(model=MODEL, base_url=args.base_url, api_key="unused", temperature=0,
                         max_tokens=args.max_tokens, max_retries=0)
        p = llm.with_structured_output(Person).invoke("Describe a person named Ada aged 36.")
        check(isinstance(p, Person), f"structured {p!r}")

        @tool
        def get_weather(city: str) -> str:
            """The current weather in a city."""
            return f"21 C and clear in {city}"

        bound = llm.bind_tools([get_weather], tool_choice="get_weather", strict=True)
        msgs = [HumanMessage("What is the weather like in Paris right now?")]
        ai = bound.invoke(msgs)
        check(len(ai.tool_calls) >= 1, f"no tool calls: {ai}")
        tc = ai.tool_calls[0]
        check(tc["name"] == "get_weather" and isinstance(tc["args"].get("city"), str), f"{tc}")
        msgs += [ai, ToolMessage(get_weather.invoke(tc["args"]), tool_call_id=tc["id"])]
        answer = llm.bind_tools([get_weather], tool_choice="none").invoke(msgs)
        check(answer.content and not answer.tool_calls, f"answer {answer}")
        return f"{p!r}; {tc['args']}"

    def refused(param, **kw):
        try:
            create(messages=ASK, max_tokens=8, **kw)
        except openai.BadRequestError as e:
            got = (e.body or {}).get("param")
            check(got == param, f"param {got!r} != {param!r}: {e.body}")
            return (e.body or {}).get("message", "")[:70]
        raise AssertionError("no 400")

    def bad_requests():
        out = []
        deep = {"type": "string"}
        for _ in range(40):
            deep = {"type": "array", "items": deep}
        for param, kw in [
            ("response_format", dict(response_format=schema_format("x", {
                "type": "object", "if": {"required": ["a"]}, "then": {"required": ["b"]}}))),
            ("response_format", dict(response_format=schema_format("x", {
                "type": "string", "pattern": "(?=a)b"}))),
            ("response_format", dict(response_format=schema_format("x", deep))),
            ("response_format", dict(response_format=schema_format("x", {
                "enum": list(range(5000))}))),
            ("response_format", dict(response_format={"type": "xml"})),
            ("tools", dict(tools=[{"type": "function", "function": {
                "name": "f", "parameters": {"type": "object", "properties": {
                    "a": {"type": "array", "uniqueItems": True}}}}}], tool_choice="required")),
            ("tools[0].function.name", dict(tools=[{"type": "function",
                                                    "function": {"name": "a b"}}])),
            ("tool_choice", dict(tools=[WEATHER], tool_choice={
                "type": "function", "function": {"name": "nope"}})),
        ]:
            out.append(refused(param, **kw))
        return f"{len(out)} refusals"

    def hostile_schemas_are_bounded():
        # Nested quantifiers and a large alternation: compiled by derivatives
        # (no backtracking) and bounded by the engine's fuel: answered, or
        # refused, within the request's time, never hung.
        results = []
        for schema in [{"type": "string", "pattern": "^(a+)+(b|a+)*c$", "maxLength": 30},
                       {"type": "string", "pattern": "^(" + "|".join(
                           f"w{i}x{i}" for i in range(800)) + ")$"},
                       {"type": "array", "items": {"type": "object", "properties": {
                           f"p{i}": {"type": "integer"} for i in range(200)}}, "maxItems": 1}]:
            t = time.monotonic()
            try:
                r = create(messages=ASK, max_tokens=24, response_format=schema_format("h", schema))
                results.append(f"{r.choices[0].finish_reason} {time.monotonic() - t:.1f}s")
            except openai.APIStatusError as e:
                check(e.status_code in (400, 500), f"status {e.status_code}")
                results.append(f"{e.status_code} {time.monotonic() - t:.1f}s")
        return ", ".join(results)

    c.run("response_format json_object answers an object", json_object)
    c.run("/v1/completions with response_format (extension) validates", completions_extension)
    c.run("SDK chat.completions.parse and beta.chat.completions.parse return a Person",
          sdk_parse)
    c.run("tools under each tool_choice (none, auto, required, named)", tool_choice_each)
    c.run("streamed tool call reassembled by the SDK equals the whole answer",
          streamed_call_reassembled)
    c.run("tool calls cut by stop sequences: the stream says what the whole answer says",
          calls_with_stop_sequences)
    c.run("a tool loop: call, tool message, answer", tool_loop)
    c.run("LangChain with_structured_output and bind_tools with a tool loop",
          langchain_structured_and_tools)
    c.run("unusable schemas and tools get 400 naming the field", bad_requests)
    c.run("hostile schemas are refused or answered, never hung", hostile_schemas_are_bounded)
    return c.summary()


if __name__ == "__main__":
    sys.exit(main())
