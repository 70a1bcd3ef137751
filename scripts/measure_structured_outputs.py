"""How often the server's strict ``json_schema`` answers are schema-valid: person records
(a name, an integer age, string tags) asked 20 ways, through the real OpenAI-compatible
server on loopback and the ``openai`` client, with ``max_tokens=120``.

Each run crosses prompt sets x settings x grammar layouts:

* prompt sets: ``persons`` (make up a person of some kind) and ``extract`` (pull the record
  out of a sentence: a different prompt style, the check on other prompts);
* settings: ``default`` (greedy, no penalty) or penalties as a user would set them, e.g.
  ``rep=1.1`` (vLLM's ``repetition_penalty``, Ollama's ``repeat_penalty`` default) or
  ``freq=0.5`` (OpenAI's ``frequency_penalty``); combine with commas: ``rep=1.1,pres=0.2``;
* layouts: ``flexible`` (the product: the model's own JSON whitespace) and ``compact`` (the
  grammar before it: ``", "`` / ``": "`` and no other whitespace), to measure what the
  whitespace change does.

A reply counts as valid when it parses, has exactly the three keys with the right types and
ended with ``finish_reason == "stop"``. Results go to a JSON file after every request (a
long run can be read while it goes) and a table is printed at the end.

Run: python scripts/measure_structured_outputs.py --model qwen2.5-coder-0.5b-instruct \\
        --settings default rep=1.1 --out results/structured-qwen.json
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
FORMAT = {"type": "json_schema",
          "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
KINDS = ["beekeeper in Lyon", "retired sailor", "jazz pianist", "nurse in Nairobi",
         "chess prodigy", "mountain guide", "baker in Vienna", "software tester",
         "marine biologist", "taxi driver in Lima", "opera singer", "farmer in Iowa",
         "museum curator", "street artist", "airline pilot", "librarian in Oslo",
         "wildlife photographer", "primary school teacher", "firefighter", "potter in Kyoto"]
SENTENCES = [
    "Maria is 34 and loves hiking and chess.",
    "Old Tom, 81, still fishes every morning and grows tomatoes.",
    "Priya (27) is a data scientist who runs marathons.",
    "At 45, Jonas repairs bicycles and plays the accordion.",
    "Little Ada is 9; she collects stamps and reads comics.",
    "Kwame, aged 52, teaches physics and sings in a choir.",
    "Lena is a 23-year-old violinist who also climbs.",
    "Carlos, 38, is a chef who surfs on weekends.",
    "Yuki is 61, a retired engineer who paints watercolours.",
    "Fatima, 30, codes in Rust and keeps bees.",
    "Sven (70) builds model ships and walks his dog.",
    "Amara is 19 and studies law; she plays basketball.",
    "Dmitri, 44, drives trucks and listens to podcasts.",
    "Chloe is 33, a vet who volunteers at a shelter.",
    "Raj, 56, owns a bookshop and loves cricket.",
    "Ines is 28, a photographer who travels by train.",
    "Hugo, 12, skateboards and builds robots.",
    "Grace is 67, gardens, bakes bread and knits.",
    "Omar, 40, is a pilot and an amateur astronomer.",
    "Elena (25) dances tango and works as a nurse.",
]
PROMPTS = {
    "persons": [f"Make up a person record for a {k}: name, age and a few tags." for k in KINDS],
    "extract": [f"Extract a person record (name, age, tags) from: {s}" for s in SENTENCES],
}
KEYS = {"rep": "repetition_penalty", "freq": "frequency_penalty", "pres": "presence_penalty"}


def valid_person(text: str) -> bool:
    """Whether ``text`` is one JSON document following :data:`SCHEMA` (checked by hand)."""
    try:
        doc = json.loads(text)
    except json.JSONDecodeError:
        return False
    return (isinstance(doc, dict) and set(doc) == {"name", "age", "tags"}
            and isinstance(doc["name"], str)
            and isinstance(doc["age"], int) and not isinstance(doc["age"], bool)
            and isinstance(doc["tags"], list) and all(isinstance(t, str) for t in doc["tags"]))


def parse_setting(text: str) -> dict[str, float]:
    """``default`` -> {}; ``rep=1.1,freq=0.5`` -> request penalties."""
    if text == "default":
        return {}
    out: dict[str, float] = {}
    for part in text.split(","):
        key, _, value = part.partition("=")
        if key not in KEYS or not value:
            raise SystemExit(f"bad setting {part!r}: use default or {'/'.join(KEYS)}=VALUE")
        out[KEYS[key]] = float(value)
    return out


class _Server:
    """The real server (uvicorn) on a loopback socket, on a daemon thread."""

    def __init__(self, runtime: Any) -> None:
        import uvicorn

        from adapters.openai_server import ServerConfig, create_app

        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.port = int(self.sock.getsockname()[1])
        self.server = uvicorn.Server(uvicorn.Config(
            create_app(runtime, ServerConfig()), log_level="warning", lifespan="on"))
        self.thread = threading.Thread(target=self.server.run,
                                       kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        while not self.server.started:
            time.sleep(0.05)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


def main(argv: list[str] | None = None) -> int:
    """Run the measurement; write JSON to ``--out`` and print a table."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="shipped model name or a local folder")
    ap.add_argument("--prompts", nargs="+", default=["persons", "extract"],
                    choices=sorted(PROMPTS))
    ap.add_argument("--settings", nargs="+", default=["default", "rep=1.1"])
    ap.add_argument("--layouts", nargs="+", default=["flexible"],
                    choices=["flexible", "compact"])
    ap.add_argument("--max-tokens", type=int, default=120)
    ap.add_argument("--limit", type=int, default=20, help="prompts per set")
    ap.add_argument("--match", default="", help="only prompts containing this text")
    ap.add_argument("--out", type=Path, default=Path("results/structured-outputs.json"))
    args = ap.parse_args(argv)
    settings = {s: parse_setting(s) for s in args.settings}

    import openai

    from agentspec.chat import grammar_sources
    from agentspec.runtime import Runtime

    flexible_style = dict(grammar_sources.FLEXIBLE_JSON)
    t0 = time.perf_counter()
    runtime = Runtime.load(args.model, store=False)
    load_s = time.perf_counter() - t0
    model = str(runtime.target.name)
    server = _Server(runtime)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="local",
                           max_retries=0, timeout=3600)
    report: dict[str, Any] = {
        "model": model, "max_tokens": args.max_tokens, "schema": SCHEMA,
        "command": " ".join([Path(sys.argv[0]).name, *(argv or sys.argv[1:])]),
        "load_s": round(load_s, 1), "runs": []}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    try:
        for layout in args.layouts:
            # The grammar source reads this at request time: compact = the old grammar.
            grammar_sources.FLEXIBLE_JSON = (flexible_style if layout == "flexible"
                                             else dict(grammar_sources.JSON_STYLE))
            for prompt_set in args.prompts:
                for label, penalties in settings.items():
                    run: dict[str, Any] = {"layout": layout, "prompts": prompt_set,
                                           "setting": label, "penalties": penalties,
                                           "valid": 0, "n": 0, "replies": []}
                    report["runs"].append(run)
                    chosen = [p for p in PROMPTS[prompt_set] if args.match in p]
                    for prompt in chosen[: args.limit]:
                        # OpenAI's penalties as parameters, vLLM's repetition_penalty in
                        # the extra body (as a vLLM client sends it).
                        extra = {k: v for k, v in penalties.items() if k != "repetition_penalty"}
                        if "repetition_penalty" in penalties:
                            extra["extra_body"] = {
                                "repetition_penalty": penalties["repetition_penalty"]}
                        start = time.perf_counter()
                        out = client.chat.completions.create(
                            model=model, max_tokens=args.max_tokens,
                            response_format=FORMAT,  # type: ignore[arg-type]
                            messages=[{"role": "user", "content": prompt}], **extra)
                        choice = out.choices[0]
                        text = choice.message.content or ""
                        ok = choice.finish_reason == "stop" and valid_person(text)
                        run["n"] += 1
                        run["valid"] += ok
                        run["replies"].append({
                            "prompt": prompt, "valid": ok, "finish_reason": choice.finish_reason,
                            "completion_tokens": out.usage.completion_tokens if out.usage else None,
                            "seconds": round(time.perf_counter() - start, 2), "text": text})
                        args.out.write_text(json.dumps(report, indent=2))
                    print(f"{layout:9} {prompt_set:8} {label:16} valid {run['valid']}/{run['n']}",
                          flush=True)
    finally:
        server.stop()
        grammar_sources.FLEXIBLE_JSON = flexible_style
    print(f"\nmodel {model}, max_tokens {args.max_tokens}")
    print("| layout | prompts | setting | schema-valid | mean tokens |")
    print("|---|---|---|---|---|")
    for run in report["runs"]:
        toks = [r["completion_tokens"] or 0 for r in run["replies"]]
        mean = sum(toks) / max(len(toks), 1)
        print(f"| {run['layout']} | {run['prompts']} | {run['setting']} | "
              f"{run['valid']}/{run['n']} | {mean:.0f} |")
    print(f"results: {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
