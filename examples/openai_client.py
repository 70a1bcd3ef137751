"""Talk to `agentspec serve` with the official OpenAI client: sessions, streaming, tools.

Start the server first (local-only mode, loopback):

    .venv/bin/agentspec serve --port 8000

then run:

    .venv/bin/python examples/openai_client.py [--base-url http://127.0.0.1:8000/v1]

With API keys (``AGENTSPEC_API_KEYS='my-key=my-team' agentspec serve ...``) pass
``--api-key my-key``. Requests that share an ``X-Session-Id`` share a suffix cache: the second
turn below re-emits the document of the first, so most of it is drafted from the cache and
verified many tokens per forward. Output is identical to the model's own greedy decoding.
"""

from __future__ import annotations

import argparse
import json
import uuid
from typing import Any

import openai

DOC = '{"service": "checkout", "replicas": 3, "region": "eu-west-1", "owner": "payments"}'
WEATHER: Any = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}


def main() -> None:
    """Run three requests in one session and print the answers and their speed-ups."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--api-key", default="local", help="any value in local-only mode")
    args = parser.parse_args()

    session = f"example-{uuid.uuid4().hex[:8]}"
    client = openai.OpenAI(base_url=args.base_url, api_key=args.api_key,
                           default_headers={"X-Session-Id": session})
    model = client.models.list().data[0].id
    print(f"model {model}, session {session}")

    # 1. Streaming: deltas arrive as the model commits tokens.
    messages: Any = [{"role": "user", "content": (
        f"Here is config.json:\n{DOC}\nReply with the file unchanged.")}]
    print("\n[stream] ", end="")
    for chunk in client.chat.completions.create(model=model, messages=messages,
                                                max_tokens=80, stream=True):
        if chunk.choices and chunk.choices[0].delta.content:
            print(chunk.choices[0].delta.content, end="", flush=True)
    print()

    # 2. The same document again in the same session: drafted from the session cache.
    messages[0]["content"] = f"Here is config.json:\n{DOC}\nSet replicas to 5; reply with the file."
    out = client.chat.completions.create(model=model, messages=messages, max_tokens=80)
    stats = out.model_extra.get("agentspec", {}) if out.model_extra else {}
    print(f"\n[edit] {out.choices[0].message.content}")
    print(f"       {stats.get('generated_tokens')} tokens in {stats.get('forwards')} forwards "
          f"(mean accepted length {stats.get('mean_accepted_len')})")

    # 3. A forced tool call; arguments come back as a JSON string, as from OpenAI. One
    # worked example in the history is enough for the 135M model to write a clean call.
    force: Any = {"type": "function", "function": {"name": "get_weather"}}
    ask: Any = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 18, "sky": "sunny"}'},
        {"role": "assistant", "content": "It is sunny and 18 C in Paris."},
        {"role": "user", "content": "What is the weather in London?"},
    ]
    out = client.chat.completions.create(model=model, max_tokens=40, tools=[WEATHER],
                                         tool_choice=force, messages=ask)
    for call in out.choices[0].message.tool_calls or []:
        if call.type != "function":
            continue
        print(f"\n[tool] {call.function.name}({json.dumps(json.loads(call.function.arguments))})")
    if not out.choices[0].message.tool_calls:  # a 135M model sometimes gets the JSON wrong
        print(f"\n[tool] no well-formed call; the model wrote: {out.choices[0].message.content!r}")


if __name__ == "__main__":
    main()
